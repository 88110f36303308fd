"""Whether an adapter can train a trial: the one place that decides, from the adapter's declaration
(``adapters.declaration.Declaration``) alone, without importing its framework.

The plan asks it for every trial of a built-in adapter before anything runs (``harness.plan.unsupported_reason``);
max-batch asks it before its first probe; the worker asks it again for every trial before the framework is imported
(a built-in adapter's declaration from the registry; an adapter registered through ``HARNESS_ADAPTERS`` from its
class, known only where the class is imported). Adapters do not re-check: a trial that reaches an adapter is one it
declared it can train. What a trial asks besides its model is one value, ``Conditions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.neutral.info import TASKS, ModelInfo, describe_feature, requirements
from harness.spec.devices import device_kind

if TYPE_CHECKING:
    from adapters.declaration import Declaration

__all__ = ["Conditions", "NativeTask", "data_parallel_gap", "execution_gap", "has_batchnorm", "input_gap", "limit_gap",
           "native_gap", "noise_gap", "support_gap", "unsupported"]


@dataclass(frozen=True)
class Conditions:
    """How a trial trains, beyond its model: what the support rule judges (``unsupported``). A trial gives its own
    (``harness.plan.Trial.conditions``); a spec's before any trial exists, ``harness.plan.spec_conditions``.

    precision: ``harness.spec.Precision``. compile: ``harness.spec.CompileMode`` ("default": the adapter's own
    mode). device: "cpu" or "cuda:N". data_parallel: the devices of one trial (1: none), with ``sync_batchnorm``.
    input: ``harness.spec.InputMode``. memory_limit: under a memory cap (``memory_limit_mb``). gradient_noise:
    measuring gradient norms (``harness.spec.GradientNoiseSpec``).
    """

    precision: str = "fp32"
    compile: str = "default"
    device: str = "cpu"
    data_parallel: int = 1
    sync_batchnorm: bool = False
    input: str = "resident"
    memory_limit: bool = False
    gradient_noise: bool = False


def unsupported(declaration: Declaration, info: ModelInfo | NativeTask,
                conditions: Conditions = Conditions()) -> str | None:
    """Why the adapter of ``declaration`` cannot train ``info`` (the neutral model's analysis, or a model of your own:
    ``NativeTask``) under ``conditions``: the first reason of ``support_gap`` (``native_gap`` for a model of your
    own), ``execution_gap``, ``data_parallel_gap``, ``input_gap``, ``noise_gap`` and ``limit_gap``, one line; None
    when it can."""
    c = conditions
    return ((native_gap(declaration, info) if isinstance(info, NativeTask) else support_gap(declaration, info))
            or execution_gap(declaration, c.precision, c.compile, c.device)
            or data_parallel_gap(declaration, info, c.data_parallel, c.sync_batchnorm, c.device)
            or input_gap(declaration, c.input, c.data_parallel)
            or noise_gap(declaration, c.gradient_noise, c.data_parallel, c.input)
            or limit_gap(declaration, info, c))


@dataclass(frozen=True)
class NativeTask:
    """What the plan knows of a model of your own before its probe: the task the spec's dataset sets
    (``harness.neutral.native.task``). Whether it has batchnorm is unknown here, so sync batchnorm is decided as if
    it had (the adapter's declaration)."""

    task: str


def native_gap(declaration: Declaration, native: NativeTask) -> str | None:
    """None when the adapter adopts a model of your own (``Capabilities.native_model``) for ``native``'s task; else
    one line saying what it lacks."""
    can = declaration.capabilities
    if not can.native_model:
        return f"the {declaration.name} adapter trains no model of your own" + (
            f": {can.native_note}" if can.native_note else "")
    if native.task not in can.tasks:
        return f"the {declaration.name} adapter does not support {describe_feature(native.task)} (the dataset)"
    return None


def support_gap(declaration: Declaration, info: ModelInfo) -> str | None:
    """None when the declaration's ``layers`` and ``tasks`` (``Capabilities``) cover every requirement of ``info``
    (``harness.neutral.info.requirements``); else one line naming the first one missing and where, e.g. "the pytorch
    adapter does not support residual blocks (model.layers.1)"."""
    can = declaration.capabilities
    for feature, where in requirements(info):
        if feature not in (can.tasks if feature in TASKS else can.layers):
            return f"the {declaration.name} adapter does not support {describe_feature(feature)} ({where})"
    return None


def execution_gap(declaration: Declaration, precision: str, compile: str, device: str) -> str | None:
    """None when the adapter trains in ``precision`` with ``compile`` on ``device``'s kind; else one line saying which
    it lacks, e.g. "the mxnet adapter does not train in fp16 on cpu (only on cuda)", followed by the declaration's
    note on that precision (why not) where there is one."""
    can, kind = declaration.capabilities, device_kind(device)
    if kind not in can.precisions.get(precision, frozenset()):
        where = sorted(can.precisions.get(precision, ()))
        also = f" (only on {', '.join(where)})" if where else ""
        why = f": {can.notes[precision]}" if precision in can.notes else ""
        return f"the {declaration.name} adapter does not train in {precision} on {kind}{also}{why}"
    mode = can.mode(compile)
    if mode not in can.compile_modes:
        return f"the {declaration.name} adapter has no {mode} mode (its modes: {', '.join(sorted(can.compile_modes))})"
    return None


def data_parallel_gap(declaration: Declaration, info: ModelInfo | NativeTask, devices: int, sync_batchnorm: bool,
                      device: str = "cpu") -> str | None:
    """None when the adapter trains ``info`` on ``devices`` devices (with ``sync_batchnorm``, which matters only for a
    model with batchnorm) on ``device``'s kind; else one line saying what it lacks."""
    if devices <= 1:
        return None
    parallel = declaration.data_parallel
    if not parallel.kind:
        return f"the {declaration.name} adapter does not train data-parallel" + (
            f": {parallel.mechanism}" if parallel.mechanism else "")
    if sync_batchnorm and has_batchnorm(info) and device_kind(device) not in parallel.sync_batchnorm:
        why = f": {parallel.sync_batchnorm_note}" if parallel.sync_batchnorm_note else ""
        return f"the {declaration.name} adapter has no synchronised batchnorm on {device_kind(device)}{why}"
    return None


def input_gap(declaration: Declaration, source: str, devices: int = 1) -> str | None:
    """None when the adapter trains with ``source`` (``harness.spec.InputMode``) on ``devices`` devices; else one
    line saying what it lacks. Loader mode needs the declaration's ``loader`` (``Capabilities.loader``), and is not
    combined with data parallelism (each device would need its shard of every batch from the loader)."""
    if source != "loader":
        return None
    if not declaration.capabilities.loader:
        return f"the {declaration.name} adapter has no data loader mode (input: loader)"
    if devices > 1:
        return "input: loader is not combined with data parallelism yet (each device would need its own shard)"
    return None


def noise_gap(declaration: Declaration, gradient_noise: bool, devices: int = 1, source: str = "resident") -> str | None:
    """None unless the trial measures gradient norms (``harness.spec.GradientNoiseSpec``) and the adapter cannot:
    it must declare ``gradient_noise`` (``Capabilities.gradient_noise``), and the norms are measured on one device
    from resident batches."""
    if not gradient_noise:
        return None
    if not declaration.capabilities.gradient_noise:
        return f"the {declaration.name} adapter does not measure gradient norms (gradient_noise)"
    if devices > 1 or source == "loader":
        return "gradient_noise is measured on one device with resident input"
    return None


def limit_gap(declaration: Declaration, info: ModelInfo | NativeTask, conditions: Conditions) -> str | None:
    """The reason of the first of the declaration's ``limits`` (``Capabilities.limits``) that the trial matches,
    else None."""
    c, can = conditions, declaration.capabilities
    facts = {"data_parallel": c.data_parallel > 1, "sync_batchnorm": c.sync_batchnorm and has_batchnorm(info),
             "compile": can.mode(c.compile), "precision": c.precision, "device": device_kind(c.device),
             "input": c.input, "memory_limit": c.memory_limit, "native": isinstance(info, NativeTask)}
    for limit in can.limits:
        if all(getattr(limit, key) in (None, value) for key, value in facts.items()):
            return limit.reason
    return None


def has_batchnorm(info: ModelInfo | NativeTask) -> bool:
    """Whether the trained model has batchnorm: a neutral model with a batchnorm layer, or any model of its own
    (whose layers are not known here: assumed to)."""
    return isinstance(info, NativeTask) or any(layer.kind == "batchnorm" for layer in info.walk())
