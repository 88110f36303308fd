"""The report's "Models" section, for a run where some framework entry brings a model of its own
(``harness.spec.NativeModel``): per row, what it trained (the spec's neutral model, or a factory and its kwargs),
the model's type, its trainable parameters side by side, the training FLOPs per sample and what counted them, and
whether the row is proven to train the same model as others: the neutral model's rows are (the same canonical
weights and batches, tests/adapters/test_equivalence.py), a family's rows that start a model of your own from weights
drawn once per seed are among themselves (Keras on its backends, tests/adapters/test_keras_native.py), and any other
model of your own is not claimed equal to another framework's."""

from __future__ import annotations

from typing import Any

import adapters  # the registry of declarations: imports no framework
from harness.record.trial import TrialRecord
from harness.results.metrics import title
from harness.results.sections import Paragraph, Section, simple_table
from harness.results.tables import ReportData


def models_section(data: ReportData) -> Section | None:
    """The section, or None for a run whose every row trained the spec's neutral model."""
    probed = {entry.label: entry.model for entry in data.run.frameworks}
    if not any(probed.values()):
        return None
    first: dict[str, TrialRecord] = {}
    for record in data.records:
        if record.status == "ok":
            first.setdefault(record.row, record)
    rows = []
    for entry in data.run.frameworks:
        model: dict[str, Any] | None = probed.get(entry.label)
        ran = first.get(entry.label)
        metrics = ran.metrics if ran is not None else None
        count = (model or {}).get("parameter_count") or (metrics.parameter_count if metrics else None)
        flops = metrics.train_flops_per_sample if metrics else None
        source = (metrics.flops_source if metrics else None) or ""
        rows.append([title(entry.label),
                     "the spec's neutral model" if model is None else f"`{_factory(model)}`",
                     "" if model is None else str(model.get("model_type", "")),
                     "" if count is None else f"{count:,}",
                     "" if flops is None else f"{flops:,}",
                     source if flops is not None or not source else f"none: {source}",
                     _proven(entry.name, model)])
    table = simple_table(["row", "model", "type", "parameters", "training FLOPs per sample", "counted by",
                          "proven equal"], rows)
    note = Paragraph("Parameters: the trainable arrays' sizes. Training FLOPs: forward and backward of one sample, 2 "
                     "per multiply-accumulate; a model of your own's by the framework's own counter where it has one. "
                     "Models of different frameworks that are not proven equal are different models, however alike.")
    return Section("models", "Models", (table, note))


def _factory(model: dict[str, Any]) -> str:
    """``module:callable(kwargs)``, the module of a file shown by its file name."""
    module, _, name = str(model.get("factory", "")).rpartition(":")
    shown = module.rsplit("/", 1)[-1]
    kwargs = ", ".join(f"{k}={v!r}" for k, v in (model.get("kwargs") or {}).items())
    return f"{shown}:{name}({kwargs})"


def _proven(adapter: str, model: dict[str, Any] | None) -> str:
    """Which rows this one is proven to train the same model as."""
    if model is None:
        return "yes: every neutral row (the same weights and batches)"
    declaration = adapters.BUILTIN.get(adapter)
    if declaration is not None and declaration.family.shared_weights:
        family = declaration.family.name or declaration.name
        return f"yes, among the {family} rows of this factory (the same weights, drawn once per seed)"
    return "no: a model of your own"
