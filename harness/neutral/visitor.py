"""The walk every framework's model builder makes over the neutral model: one method per layer kind.

A builder subclasses ``LayerVisitor`` and defines ``visit_<kind>(layer, *args)`` for each layer kind it builds
(``visit_conv2d``, ``visit_residual``, ...); ``visit(layer, *args)`` calls the one for ``layer.kind``, as the
standard library's ``ast.NodeVisitor`` does for syntax nodes. A kind the builder has no method for raises
``UnknownLayer`` naming the adapter, the kind and the layer's spec path, in every framework alike: the plan refuses
such a model before anything runs (the declaration's ``layers``), so reaching it means the declaration and the
builder disagree.
"""

from __future__ import annotations

from typing import Any, ClassVar

from harness.neutral.info import LayerInfo


class UnknownLayer(ValueError):
    """A builder met a layer kind it has no ``visit_<kind>`` for."""


class LayerVisitor:
    """Dispatches ``visit(layer, ...)`` to ``visit_<layer.kind>(layer, ...)``. ``adapter``: the adapter's name, for
    the message of ``UnknownLayer``."""

    adapter: ClassVar[str] = "this"

    def visit(self, layer: LayerInfo, *args: Any) -> Any:
        """The result of ``visit_<layer.kind>(layer, *args)``. Raises UnknownLayer when there is no such method."""
        method = getattr(self, f"visit_{layer.kind}", None)
        if method is None:
            raise UnknownLayer(f"the {self.adapter} adapter cannot build {layer.kind} layers "
                               f"(model.layers.{layer.path})")
        return method(layer, *args)

    @classmethod
    def kinds(cls) -> frozenset[str]:
        """The layer kinds this builder has a method for (tests compare them with the declaration's ``layers``)."""
        return frozenset(name.removeprefix("visit_") for name in dir(cls) if name.startswith("visit_"))
