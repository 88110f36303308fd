"""Compile workers: where a framework's worker counts in its memory peak what compiling its steps borrowed (XLA's
autotuner on a GPU tries algorithms in whatever memory the cap leaves free, and JAX cannot reset its peak after it),
the search has an uncounted worker of kind ``compile`` fill the persistent compilation cache before the first probe
and the first run check of each size, and compares only the peaks of the workers that read their steps from it.

Design: docs/design/max-batch.md (the third GPU run: two run checks of JAX at one size peaked 13,097 and 5,340 MB).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from harness.plan import entry_for
from harness.spec import Spec
from harness.studies.max_batch.probe import Probe
from harness.studies.max_batch.probe import peak as probe_peak


def compiles_into_peak(spec: Spec, framework: str, device: str) -> bool:
    """True where ``framework``'s declaration says the allocator peak its workers report on ``device``'s kind
    includes what compiling borrowed (``Memory.compile_peak``: JAX on a GPU)."""
    from adapters import declaration  # the registry imports no framework

    declared = declaration(entry_for(spec, framework).name)
    return declared is not None and ("cpu" if device == "cpu" else "cuda") in declared.memory.compile_peak


@contextmanager
def cached(spec: Spec, compile_first: bool) -> Iterator[tuple[Spec, str | None]]:
    """(the spec the search runs, the note that says how its steps were compiled, None without compile workers).
    With ``compile_first`` and no ``compilation_cache`` in ``spec``: a copy naming a temporary cache folder, removed
    when the block ends."""
    if not compile_first:
        yield spec, None
        return
    folder = None if spec.compilation_cache is not None else tempfile.mkdtemp(prefix="harness-max-batch-cache-")
    where = "a temporary one: the spec sets no compilation_cache" if folder else spec.compilation_cache
    note = (f"each size's steps were compiled into a persistent compilation cache ({where}) by a worker of kind "
            "compile before the probes and run checks whose peaks are compared: a worker that compiles counts in its "
            "peak what compiling borrowed (XLA's autotuning on a GPU)")
    try:
        yield (spec if folder is None else spec.model_copy(update={"compilation_cache": folder})), note
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def compile_record(outcome: Any, index: int, batch_size: int, purpose: str, kind: str, devices: int,
                   device: str) -> Probe | None:
    """The record of a compile worker (``outcome``: harness.execution.launcher.Outcome) before the first ``kind``
    worker ("probe" or "run") of ``batch_size``: kind ``compile``, ok, its peak shown but never compared; None when
    it did not end ok (its failure is then the size's own, and no second worker runs)."""
    if outcome.status != "ok":
        return None
    peak, source = probe_peak(outcome, device)
    what = "run check" if kind == "run" else "probe"
    return Probe(index=index, batch_size=batch_size, status="ok", reason="", peak_bytes=peak, peak_source=source,
                 seconds=outcome.wall_seconds, purpose=f"compile, for the {what}'s cache: {purpose}",
                 global_batch_size=batch_size * devices, kind="compile")
