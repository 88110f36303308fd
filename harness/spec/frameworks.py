"""A spec's framework entries: a framework's name, or a mapping that says which Python its workers run in.
Imports only ``harness.spec.base``."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, model_validator

from harness.spec.base import _Strict

# The folder that holds the harness package (the repository root in a checkout): ``{root}`` in a framework entry.
ROOT = Path(__file__).resolve().parent.parent.parent


def slug(text: str) -> str:
    """``text`` as it appears in trial ids and file names: lower case, runs of other characters as '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.") or "framework"


class NativeModel(_Strict):
    """A model of your own, by import path: ``factory`` is ``"package.module:callable"`` or ``"file.py:callable"`` (a
    file relative to the spec's folder), called with ``kwargs`` in the entry's worker after the framework's seed is
    set; it returns the framework's own model object (``torch.nn.Module``, ``keras.Model``, a Flax module, a Gluon
    ``HybridBlock``), whose output is the logits: (batch, classes), or (batch, length, vocabulary) for next-token
    prediction. The harness keeps the loss, optimizer, batch order, precision, compile mode and timing
    (docs/guide/own-model.md)."""

    factory: str = Field(min_length=3, pattern=r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @property
    def from_file(self) -> bool:
        """Whether the factory's module is a file (``models.py:make``) rather than an importable module."""
        module = self.factory.rsplit(":", 1)[0]
        return module.endswith(".py") or "/" in module or os.sep in module


class FrameworkEntry(_Strict):
    """One row of a comparison: a framework (its adapter's name) and the Python its workers run in.

    A spec's ``frameworks`` list holds names (``pytorch``: the harness's own interpreter) or such mappings, e.g.
    ``{name: pytorch, label: "PyTorch 2.15", python: envs/pytorch/bin/python}`` or ``{name: mxnet, command: [docker,
    run, --rm, -i, --pid=host, -v, "{root}:{root}", nvcr.io/nvidia/mxnet:23.09-py3, python]}``.

    backend: for an adapter that runs on several frameworks, which one (Keras 3: ``{name: keras, backend: jax}``);
    the entry's ``name`` then becomes the adapter's, ``keras-jax`` (so ``{name: keras-jax}`` says the same), and the
    plan checks that such an adapter exists (``harness.plan.check_framework_name``).
    label: the row's name in reports, compare and history (default: ``name``); labels are unique within a spec.
    model: a model of your own (``NativeModel``) instead of the spec's neutral ``model``. packages: what the entry's
    environment needs beside its framework (pip requirements, e.g. ``torchvision==0.29.1``): ``harness envs create
    --spec`` installs them, the probe requires them, the report lists their versions.
    python: the interpreter (a path; a relative one is taken relative to the spec file's folder). command: an argv
    prefix that starts a Python (``taskset -c 2-7 {python}``, ``docker run -i ... python``, ``srun ... python``);
    the worker's arguments follow it. In ``python`` and ``command``, ``{root}`` is the folder that holds the harness
    (the worker imports the harness from there, so a container must see it at the same path) and, in ``command``,
    ``{python}`` is ``python`` (default: the harness's own interpreter). ``harness.spec.load`` substitutes them.
    """

    name: str = Field(min_length=1)
    backend: str | None = Field(default=None, min_length=1, pattern=r"^[a-z0-9_]+$")
    label: str | None = Field(default=None, min_length=1, max_length=80)
    python: str | None = Field(default=None, min_length=1)
    command: list[str] | None = Field(default=None, min_length=1)
    model: NativeModel | None = None
    packages: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _name_with_backend(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(backend := data.get("backend"), str) and isinstance(
                name := data.get("name"), str) and backend and not name.endswith(f"-{backend}"):
            return {**data, "name": f"{name}-{backend}"}
        return data

    @model_validator(mode="after")
    def _python_through_command(self) -> FrameworkEntry:
        if self.python and self.command and not any("{python}" in part for part in self.command):
            raise ValueError("with both python and command, command must start the python through {python}")
        return self

    @property
    def row(self) -> str:
        """The label, or the name when there is none."""
        return self.label or self.name

    @property
    def slug(self) -> str:
        """The label as it appears in trial ids and file names (see ``slug``)."""
        return slug(self.row)

    def argv(self) -> list[str]:
        """The argv prefix that starts this entry's Python (placeholders substituted)."""
        python = (self.python or sys.executable).replace("{root}", str(ROOT))
        if self.command:
            return [part.replace("{python}", python).replace("{root}", str(ROOT)) for part in self.command]
        return [python]


FrameworkItem = Annotated[Annotated[str, Tag("name")] | Annotated[FrameworkEntry, Tag("entry")],
                          Discriminator(lambda v: "name" if isinstance(v, str) else "entry")]


def as_entry(item: FrameworkItem) -> FrameworkEntry:
    """A ``frameworks`` item as an entry."""
    return FrameworkEntry(name=item) if isinstance(item, str) else item


def select_frameworks(items: list[Any], wanted: list[str]) -> list[Any]:
    """The CLI's ``--frameworks``: each wanted word picks the file's entries with that label, else those with that
    name, else stands for itself (a plain framework name)."""
    out: list[Any] = []
    for word in wanted:
        rows = [i for i in items if isinstance(i, dict) and i.get("label") == word]
        rows = rows or [i for i in items if i == word or (isinstance(i, dict) and i.get("name") == word)]
        out += rows or [word]
    return out


def expand_backends(items: Any) -> Any:
    """A ``frameworks`` list with every entry whose ``backend`` is a list (``{name: keras, backend: [jax, torch,
    tensorflow], model: ...}``: the same model on each backend) made one entry per backend, labelled
    ``<label>-<backend>`` where it has a label, ``{backend}`` in its ``python`` and ``command`` standing for the
    backend (``"{root}/envs/keras-{backend}/bin/python"``); other items as they are."""
    if not isinstance(items, list):
        return items
    out: list[Any] = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("backend"), list):
            for backend in item["backend"]:
                one = {**item, "backend": backend}
                if item.get("label"):
                    one["label"] = f"{item['label']}-{backend}"
                if isinstance(item.get("python"), str):
                    one["python"] = item["python"].replace("{backend}", str(backend))
                if isinstance(item.get("command"), list):
                    one["command"] = [str(part).replace("{backend}", str(backend)) for part in item["command"]]
                out.append(one)
        else:
            out.append(item)
    return out


def resolve_entries(items: list[FrameworkItem], base_dir: Path) -> list[FrameworkItem]:
    """Substitutes ``{root}`` and ``{python}`` and makes relative interpreter paths and model files absolute
    (relative to ``base_dir``, the spec file's folder)."""
    out: list[FrameworkItem] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
            continue
        python = item.python.replace("{root}", str(ROOT)) if item.python else None
        if python and ("/" in python or os.sep in python) and not Path(python).is_absolute():
            python = str((base_dir / python).absolute())
        resolved = item.model_copy(update={"python": python})
        model = item.model
        if model is not None and model.from_file:
            module, name = model.factory.rsplit(":", 1)
            if not Path(module).is_absolute():
                model = model.model_copy(update={"factory": f"{(base_dir / module).absolute()}:{name}"})
        out.append(resolved.model_copy(update={"command": resolved.argv() if item.command else None, "model": model}))
    return out
