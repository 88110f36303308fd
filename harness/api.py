"""The harness from Python: ``harness.run``, ``harness.max_batch`` and ``harness.advise`` (re-exported by
``harness``), each the command of the same name with its run directory and report, returning the typed result.

A spec is a spec file's path or a dict of its fields; a dict's relative paths (a framework entry's ``python`` or
``model`` factory, ``dataset.path``) are resolved against ``root`` (default: the current folder) as a file's are
against its folder, and ``{root}`` in an entry's ``python`` is the harness's checkout. A bad spec raises SpecError (one
line naming the spec, or ``<dict>``, and the field) before anything runs. Guide: docs/guide/python.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.spec import Spec

if TYPE_CHECKING:
    from harness.results.data import Run
    from harness.studies.max_batch import MaxBatchResult

SpecSource = str | os.PathLike[str] | dict[str, Any]


def spec_of(spec: SpecSource, root: str | os.PathLike[str] | None = None, offline: bool = False) -> tuple[Spec, str]:
    """The spec, validated and with its data ready (``harness.studies.prepare.ready``), and the name errors give it.

    Args:
        spec: a spec file's path, or a dict of its fields.
        root: what a dict's relative paths are resolved against (default: the current folder).
        offline: never download a dataset.

    Returns:
        (the spec, its name: the path as given, or ``"<dict>"``).

    Raises:
        SpecError: a bad spec, one line naming the spec and the field.
        TypeError: ``spec`` is neither a path nor a dict."""
    from harness import spec as spec_module
    from harness.studies.prepare import ready

    if isinstance(spec, dict):
        name = "<dict>"
        loaded = spec_module.from_data(spec, name, Path(root) if root is not None else Path.cwd())
    elif isinstance(spec, (str, os.PathLike)):
        name = str(spec)
        loaded = spec_module.load(spec)
    else:
        raise TypeError(f"a spec is a path or a dict, not {type(spec).__name__}")
    return ready(loaded, name, offline=offline), name


def run(spec: SpecSource, out: str | os.PathLike[str] = "results", root: str | os.PathLike[str] | None = None,
        offline: bool = False) -> Run:
    """Runs every trial of ``spec`` (``harness run``) and writes its run directory with report.md and report.html.

    Args:
        spec: a spec file's path, or a dict of its fields.
        out: the folder that receives the run directory.
        root: what a dict's relative paths are resolved against (default: the current folder).
        offline: never download a dataset.

    Returns:
        The run (``harness.Run``: ``records``, ``trials`` and ``epochs`` as pandas frames, ``path``).

    Raises:
        SpecError: a bad spec, before anything runs."""
    from harness.results import report
    from harness.results.data import load_run
    from harness.studies.sweep import run_spec

    loaded, name = spec_of(spec, root, offline)
    run_dir = run_spec(loaded, Path(out), name)
    report.write(run_dir)
    return load_run(Path(run_dir).resolve())


def max_batch(spec: SpecSource, framework: str, out: str | os.PathLike[str] = "results",
              root: str | os.PathLike[str] | None = None, offline: bool = False, **options: Any) -> MaxBatchResult:
    """The largest batch size of one entry that fits (``harness max-batch``), its run directory written to ``out``.

    Args:
        spec: a spec file's path, or a dict of its fields.
        framework: the entry's label or framework name.
        out: the folder that receives the run directory.
        root: what a dict's relative paths are resolved against (default: the current folder).
        offline: never download a dataset.
        options: ``harness.studies.max_batch.find_max_batch``'s keyword arguments (``memory_limit_mb``, ``margin``,
            ``run_checks``, ...).

    Returns:
        The ``MaxBatchResult``: ``limit`` and ``recommended`` (batch sizes, samples), ``probes``, ...

    Raises:
        SpecError: a bad spec or an entry it cannot choose, before any probe."""
    from harness.plan.entries import entry_named
    from harness.studies.max_batch import find_max_batch, write_run

    loaded, name = spec_of(spec, root, offline)
    entry = entry_named(loaded, framework, name)
    result = find_max_batch(loaded, entry.row, spec_file=name, **options)
    write_run(result, loaded, Path(out), name)
    return result


def advise(spec: SpecSource, out: str | os.PathLike[str] = "results", root: str | os.PathLike[str] | None = None,
           offline: bool = False, **options: Any) -> dict[str, Any]:
    """Which batch size, per objective (``harness advise``), its run directory written to ``out``.

    Args:
        spec: a spec file's path, or a dict of its fields.
        out: the folder that receives the run directory.
        root: what a dict's relative paths are resolved against (default: the current folder).
        offline: never download a dataset.
        options: ``harness.studies.advise.Options``'s fields (``frameworks``, ``objectives``, ``target`` (test
            accuracy, a fraction), ``budget_s`` (seconds), ``repeats``, ...).

    Returns:
        advice.json's object, with ``run_dir`` added: per entry and objective ``batch_size`` (None with ``reason``)
        and the evidence.

    Raises:
        SpecError: a bad spec or option, before anything runs."""
    from harness.studies.advise import Options
    from harness.studies.advise import advise as advise_study

    loaded, name = spec_of(spec, root, offline)
    folder = advise_study(loaded, name, Options(out=Path(out), **options))
    return {**json.loads((folder / "advice.json").read_text(encoding="utf-8")), "run_dir": str(folder)}
