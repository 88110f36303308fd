"""The checks of a spec that need more than its fields (the neutral model, the dataset files, the adapter registry,
this machine's devices), and whether an entry's adapter can train its model (``unsupported_reason``, from
``harness.plan.support``'s one rule). Every failure is a ``SpecError`` naming the file and the field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness import spec as spec_module
from harness.neutral import datasets, image_folder, models
from harness.plan.entries import check_framework_name, entry_for
from harness.plan.planner import available_cpus, data_parallel_devices, data_parallel_settings
from harness.plan.support import Conditions, NativeTask
from harness.plan.trial import trained
from harness.spec import (
    Cifar10Data,
    DataParallelSpec,
    FrameworkEntry,
    ImageFolderData,
    Spec,
    SpecError,
    SyntheticTokens,
)
from harness.spec.devices import device_index


def load(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> Spec:
    """``harness.spec.load`` (read, override, field rules), then ``check``. Raises SpecError."""
    spec = spec_module.load(path, overrides)
    check(spec, path)
    return spec


def checked_spec(data: Any, file: str | os.PathLike[str]) -> Spec:
    """``harness.spec.validate`` of already-parsed data, then ``check``. Raises SpecError."""
    spec = spec_module.validate(data, file)
    check(spec, file)
    return spec


def check(spec: Spec, file: str | os.PathLike[str]) -> None:
    """The checks that need the adapters, the dataset files and the model. Raises SpecError naming ``file``."""
    for i, entry in enumerate(spec.entries):
        check_framework_name(entry.name, file, f"frameworks.{i}", entry.backend)
    base = Path(file).parent
    if isinstance(spec.dataset, Cifar10Data):
        try:
            datasets.resolve_cifar10_path(spec.dataset, base_dir=base)
        except datasets.DatasetError as err:
            raise SpecError(file, "dataset.path", str(err)) from None
    if isinstance(spec.dataset, ImageFolderData):  # the model is checked against the folder the spec means
        spec = spec.model_copy(update={"dataset": check_image_folder(spec.dataset, file)})
    if spec.model is None:
        lacking = [entry.row for entry in spec.entries if entry.model is None]
        if lacking:
            raise SpecError(file, "model", f"the entries {', '.join(lacking)} have no model of their own "
                                           "(frameworks.N.model): give the spec a model, or each entry one")
    try:
        if spec.model is not None:
            model_info(spec)
        else:
            datasets.describe_input(spec.dataset)
    except models.ModelError as err:
        raise SpecError(file, "model.layers" + (f".{err.path}" if err.path is not None else ""), str(err)) from None
    except datasets.DatasetError as err:  # an image folder's listing or first header (its path as given)
        raise SpecError(file, f"dataset.{err.field or 'path'}", str(err)) from None
    check_data_parallel(spec, file)
    augmenting = spec.augmentation or any((spec.variants and spec.variants.augmentation) or [])
    if augmenting and isinstance(spec.dataset, SyntheticTokens):
        field = "augmentation" if spec.augmentation else "variants.augmentation"
        raise SpecError(file, field, "augmentation (random crops and flips of images) needs an image dataset, not "
                                     "token sequences")


def check_image_folder(cfg: ImageFolderData, file: str | os.PathLike[str]) -> ImageFolderData:
    """An image folder's checks that need no decoding: the folder exists and has class folders, none of them empty,
    the test classes are training classes, and without ``size`` the first image's size can be read from its header
    (``harness.neutral.image_folder.describe``). A relative ``path`` is taken relative to the spec file. Returns
    ``cfg`` with that path. Raises SpecError naming the dataset field to fix (``dataset.path``, ``dataset.size``)."""
    base = Path(file).parent
    if not cfg.path.is_absolute():
        cfg = cfg.model_copy(update={"path": base / cfg.path})
    try:
        image_folder.describe(cfg)
    except datasets.DatasetError as err:
        raise SpecError(file, f"dataset.{err.field or 'path'}", str(err)) from None
    return cfg


def accumulation_conflict(devices: int, accumulation_steps: int) -> str:
    """What a spec (or a max-batch search) that combines data parallelism and gradient accumulation is told."""
    return (f"{devices} devices with accumulation_steps {accumulation_steps}: data parallelism and gradient "
            "accumulation are not combined in one trial (compare them as separate trials)")


def check_data_parallel(spec: Spec, file: str | os.PathLike[str]) -> None:
    """Every global batch size splits into N equal per-device batches, and data parallelism is not combined with
    gradient accumulation. Raises SpecError naming ``file`` and the field."""
    for field, dp in data_parallel_settings(spec):
        if dp is None or dp.size == 1:
            continue
        if spec.accumulation_steps > 1:
            raise SpecError(file, field, accumulation_conflict(dp.size, spec.accumulation_steps))
        for i, batch in enumerate(spec.batch_sizes):
            if batch % dp.size:
                raise SpecError(file, f"batch_sizes.{i}", f"the global batch size {batch} does not split into "
                                                          f"{dp.size} equal per-device batches ({field}: {dp.size})")


def check_devices(spec: Spec, file: str | os.PathLike[str], device: str, gpus: int | None = None) -> None:
    """The data-parallel devices exist on this machine: on the CPU at most one device per available core; on a GPU
    machine (``device`` "cuda:N") N GPUs from ``device`` on, or the listed ones, among the ``gpus`` NVML counts
    (None: not checked). Raises SpecError naming ``file`` and the field."""
    for field, dp in data_parallel_settings(spec):
        if dp is None or dp.size == 1:
            continue
        if device == "cpu":
            if isinstance(dp.devices, list):
                raise SpecError(file, field, f"lists GPUs ({', '.join(dp.devices)}) but the run is on the CPU; give "
                                             "a device count")
            if dp.size > available_cpus():
                raise SpecError(file, field, f"{dp.size} devices on the CPU, but this process may use "
                                             f"{available_cpus()} cores (one logical device per core at most)")
            continue
        wanted = data_parallel_devices(dp, device)
        if gpus is not None and (missing := [d for d in wanted if device_index(d) >= gpus]):
            raise SpecError(file, field, f"{', '.join(missing)} named, but this machine has {gpus} GPU(s)")


def model_info(spec: Spec) -> models.ModelInfo:
    """The spec's neutral model analysed for its dataset's input and classes. Raises models.ModelError, and
    ValueError for a spec without one (every entry brings a model of its own)."""
    if spec.model is None:
        raise ValueError("the spec has no neutral model: every framework entry brings its own")
    return models.analyze(spec.model, *datasets.describe_input(spec.dataset))


def trained_model(spec: Spec, entry: FrameworkEntry) -> models.ModelInfo | NativeTask:
    """What ``entry`` trains, as the plan's rule takes it (``harness.plan.support.unsupported``): the neutral
    model's analysis, or for an entry with a model of its own the task the dataset sets."""
    return trained(None if entry.model is not None else spec.model, entry.model, spec.dataset)


def spec_conditions(spec: Spec, device: str = "cpu", data_parallel: DataParallelSpec | None = None) -> Conditions:
    """The conditions every trial of ``spec`` shares on ``device`` (its precision, compile mode, input, memory cap
    and gradient-norm measurement), on ``data_parallel``'s devices (None: one); a variant's trial has its own
    (``Trial.conditions``)."""
    devices, sync = (1, False) if data_parallel is None else (data_parallel.size, data_parallel.sync_batchnorm)
    return Conditions(spec.precision, spec.compile, device, devices, sync, spec.input, spec.memory_limit_mb is not None,
                      spec.gradient_noise is not None)


def unsupported_reason(spec: Spec, framework: str, conditions: Conditions | None = None) -> str | None:
    """Why the entry ``framework`` (its label or its adapter's name, ``entry_for``) cannot train its model (the
    spec's, or one of its own) under ``conditions`` (None: ``spec_conditions`` on the CPU), decided now from its
    adapter's declaration without importing the framework (``harness.plan.support.unsupported``); None when it can,
    and for an adapter of ``HARNESS_ADAPTERS``, whose declaration only its worker reads (the worker asks the same
    function). The spec must have passed ``check``."""
    from adapters import declaration  # the registry imports no framework
    from harness.plan.support import unsupported

    entry = entry_for(spec, framework)
    declared = declaration(entry.name)
    if declared is None:
        return None
    return unsupported(declared, trained_model(spec, entry), conditions or spec_conditions(spec))
