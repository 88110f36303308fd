"""Every model of your own checked once, in its entry's own interpreter, before anything runs: the environment probe
(``harness.execution.probes.probe``) carries the ``request`` and runs ``check`` there, after the adapter's
import; ``checked`` turns its report into run.json's record or the spec error. ``check``: the adapter made with
default options, its framework seeded, the factory imported and called (``harness.neutral.native.make``), the object
adopted (``Adapter.native_model``: the framework's own model type or an error), built for the task, a batch of two
samples predicted and its logits' shape compared with what the dataset needs, and the trainable parameters counted.
A family that starts every backend from the same weights (Keras: ``Family.shared_weights``) draws them here,
once per seed, for the trials to load. Any failure is a ``SpecError`` naming the spec file and
``frameworks.N.model`` (or ``.model.factory``), one line, exit 2 before anything is written
(docs/guide/own-model.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.spec import FrameworkEntry, Spec, SpecError


def request(spec: Spec, entry: FrameworkEntry) -> dict[str, Any] | None:
    """What ``check`` needs to check ``entry``'s model of its own in its interpreter (the model, the dataset's input
    and classes, the seeds), as JSON data; None for an entry that trains the spec's neutral model."""
    if entry.model is None:
        return None
    from harness.neutral import datasets

    feed, classes = datasets.describe_input(spec.dataset)
    return {"model": entry.model.model_dump(mode="json"), "classes": classes, "seeds": spec.seeds or [spec.seed],
            "input": {"kind": feed.kind, "shape": list(feed.shape), "vocab": feed.vocab,
                      "per_position": feed.per_position}}


def checked(entry: FrameworkEntry, info: dict[str, Any], file: str | os.PathLike[str], index: int) -> dict[str, Any]:
    """What run.json records of ``entry``'s model of its own, from its probe's report (``info["model_check"]``, what
    ``check`` returned there): factory, kwargs, model type, parameter count, logits shape. Raises SpecError ``FILE:
    frameworks.N.model[.factory]: reason`` when the check failed."""
    assert entry.model is not None
    report = info.get("model_check") or {"ok": False, "error": "the probe did not check the model"}
    if not report.get("ok"):
        raise SpecError(file, f"frameworks.{index}.{report.get('field') or 'model'}", str(report.get("error")))
    return {"factory": entry.model.factory, "kwargs": entry.model.kwargs,
            **{k: report[k] for k in ("model_type", "parameter_count", "output_shape")}}


def check(name: str, request: dict[str, Any]) -> dict[str, Any]:
    """In the entry's interpreter: the adapter ``name`` trains the model of ``request`` (model, input, classes,
    seeds) for the dataset's task, or why not. Returns {"ok": True, model_type, parameter_count, output_shape} or
    {"ok": False, field, error}."""
    import numpy as np

    import adapters
    from harness.neutral import native
    from harness.neutral.data import cache_folder
    from harness.neutral.info import Input
    from harness.spec import NativeModel, OptimizerSpec

    model = NativeModel.model_validate(request["model"])
    shape = request["input"]
    feed = Input(shape["kind"], tuple(shape["shape"]), shape["vocab"], shape["per_position"])
    classes, seeds = int(request["classes"]), [int(s) for s in request["seeds"]]
    try:
        cls = adapters.get(name)
        declared = cls.declaration
        weights: Path | None = None
        family = declared.family
        if family.shared_weights:  # drawn once per seed, here, for every trial of the family to load
            for seed in seeds:
                path = native.shared_weights_path(family.name or declared.name, model, feed, classes, seed,
                                                  cache_folder())
                found = native.draw_shared_weights(family.shared_weights, model, feed, classes, seed, path)
                weights = weights or found
        adapter = cls()
        adapter.prepare("cpu", 1, seeds[0])
        made = native.make(model, seeds[0])
        adopted = adapter.native_model(made, native.NativeSource(model.factory, feed, classes, seeds[0], weights))
        adapter.build(adopted, native.task(feed), OptimizerSpec())
        sample = (np.zeros((2, *feed.shape), np.float32) if feed.kind == "images" else
                  np.zeros((2, *feed.shape), np.int64))
        logits = adapter.predict(sample)
        native.check_output(tuple(logits.shape), feed, classes, model.factory)
        return {"ok": True, "model_type": f"{type(made).__module__}.{type(made).__qualname__}",
                "parameter_count": int(sum(w.size for w in adapter.get_weights().values())),
                "output_shape": list(logits.shape[1:])}
    except native.NativeModelError as err:
        return {"ok": False, "field": err.field, "error": str(err)}
    except Exception as exc:  # noqa: BLE001 - whatever the model or the framework raised, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"ok": False, "field": "model", "error": f"{model.factory}: {type(exc).__name__}: {first}"[:400]}
