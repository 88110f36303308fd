"""What a max-batch search checks before its first probe (``harness.studies.max_batch.search.find_max_batch`` and
the ``max-batch`` command): its bounds (``check_bounds``, a ValueError), the data parallelism it searches under
(``check_data_parallel``), and whether the framework's adapter can train the trial it would probe at all
(``check_supported``), asked of the plan's one rule, ``harness.plan.support.unsupported``, with the adapter's
declaration (``adapters.declaration``, which imports no framework). A refusal of the last two is a ``SpecError``: one
line naming the spec file, the field, and the reason a ``harness run`` of the same trial would record (as
``unsupported``, "not run: <reason>"); the command prints it and exits 2."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.plan import accumulation_conflict, check_devices, entry_for, spec_conditions, trained_model
from harness.plan.support import unsupported
from harness.spec import DataParallelSpec, Spec, SpecError


def check_search(spec: Spec, framework: str, device: str, devices: int | None, spec_file: str | Path,
                 memory_limit_mb: float | None = None) -> DataParallelSpec | None:
    """Both checks, in order: ``check_data_parallel``, then ``check_supported`` of the trial the search probes (under
    ``memory_limit_mb``, None: the spec's). Returns the search's DataParallelSpec (None: one device). Raises
    SpecError."""
    dp = check_data_parallel(spec, device, devices, spec_file)
    capped = (memory_limit_mb if memory_limit_mb is not None else spec.memory_limit_mb) is not None
    check_supported(spec, framework, device, dp, spec_file, "--data-parallel" if devices is not None else
                    "data_parallel", memory_limit=capped)
    return dp


def check_data_parallel(spec: Spec, device: str, devices: int | None,
                        spec_file: str | Path) -> DataParallelSpec | None:
    """The data parallelism of a search on ``devices`` devices (None: the spec's own ``data_parallel``), checked
    before anything runs: at least one device, not combined with gradient accumulation, and no more devices than
    this machine has (``harness.plan.check_devices``: on the CPU one logical device per available core, on a GPU
    machine the GPUs NVML counts). Whether the adapter trains this model data-parallel is ``check_supported``'s.
    Returns the DataParallelSpec, None for one device. Raises SpecError naming ``spec_file`` and
    ``--data-parallel`` (the spec's ``data_parallel`` when ``devices`` is None)."""
    field = "--data-parallel" if devices is not None else "data_parallel"
    own = spec.data_parallel
    if devices is not None and devices < 1:
        raise SpecError(spec_file, field, f"the device count is at least 1, not {devices}")
    dp = own if devices is None else DataParallelSpec(
        devices=devices, sync_batchnorm=own is not None and own.sync_batchnorm)
    if dp is None or dp.size == 1:
        return None
    if spec.accumulation_steps > 1:
        raise SpecError(spec_file, field, accumulation_conflict(dp.size, spec.accumulation_steps))
    gpus = None
    if device != "cpu":
        from harness.measure import machine

        found = machine.gpus()
        gpus = len(found["devices"]) if found.get("available") else None
    try:
        check_devices(spec.model_copy(update={"data_parallel": dp, "variants": None}), spec_file, device, gpus)
    except SpecError as err:
        raise SpecError(spec_file, field, err.message) from None
    return dp


def check_supported(spec: Spec, framework: str, device: str, dp: DataParallelSpec | None, spec_file: str | Path,
                    field: str = "data_parallel", memory_limit: bool = False) -> None:
    """Raises SpecError when the adapter of ``framework`` (an entry's label or adapter name,
    ``harness.plan.entry_for``) cannot train the trial every probe of the search runs: the spec's model and its
    ``precision``, ``compile`` and ``input`` (probes drop the spec's ``variants``) on ``device`` ("cpu", "cuda:N"),
    on ``dp``'s devices with its ``sync_batchnorm`` (None: one device), under a memory cap or not (``memory_limit``).
    The message is
    ``harness.plan.support.unsupported``'s reason, the one a run records; the error names ``field`` when the trial
    would be supported on one device (data parallelism is what the adapter lacks), else no field. An adapter of
    ``HARNESS_ADAPTERS`` has no declaration here: its worker decides, at the first probe (which then stops the
    search with that reason)."""
    from adapters import declaration  # the registry imports no framework

    entry = entry_for(spec, framework)
    declared = declaration(entry.name)
    if declared is None:
        return
    info = trained_model(spec, entry)
    conditions = replace(spec_conditions(spec, device, dp), memory_limit=memory_limit, gradient_noise=False)
    why = unsupported(declared, info, conditions)
    if why is None:
        return
    alone = conditions.data_parallel > 1 and unsupported(
        declared, info, replace(conditions, data_parallel=1, sync_batchnorm=False)) is None
    raise SpecError(spec_file, field if alone else "", why)


def check_bounds(margin: float | None, tolerance: float, run_checks: int, min_batch: int, max_batch: int) -> int:
    """``max_batch``, once the search's bounds are checked. Raises ValueError for a margin outside [0, 1), a
    negative tolerance or run-check count, or a range that is not 1 <= min_batch <= max_batch."""
    if margin is not None and not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), not {margin}")
    if tolerance < 0 or run_checks < 0:
        raise ValueError(f"tolerance and run_checks must be >= 0, not {tolerance} and {run_checks}")
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"need 1 <= min_batch <= max_batch, not {min_batch} and {max_batch}")
    return max_batch
