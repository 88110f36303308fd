"""``harness envs create``: one virtualenv per framework under envs/, from requirements/<framework>-cpu|gpu.txt."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cli.common import EXIT_USAGE

if TYPE_CHECKING:
    from harness.execution.installers import Installer


def add_parser(sub: Any) -> None:
    envs = sub.add_parser("envs", help="framework environments: one virtualenv per framework under envs/")
    envs_sub = envs.add_subparsers(dest="envs_command", required=True)
    create = envs_sub.add_parser("create", help="create (or keep, when up to date) envs/<framework> from "
                                                "requirements/<framework>-cpu.txt or -gpu.txt")
    create.add_argument("frameworks", nargs="*", help="default: every built-in framework")
    create.add_argument("--spec", default=None, help="instead: the environments a spec's entries run in "
                                                     "(envs/<folder>/bin/python), with the packages they name")
    build = create.add_mutually_exclusive_group()
    build.add_argument("--gpu", action="store_true", help="use requirements/<framework>-gpu.txt (CUDA builds) "
                                                          "whatever the machine")
    build.add_argument("--cpu", action="store_true", help="use requirements/<framework>-cpu.txt (CPU builds) "
                                                          "whatever the machine")
    create.add_argument("--dry-run", action="store_true", help="say which requirements would be installed where, "
                                                               "and change nothing")
    create.add_argument("--dir", default=None, help="where the environments go (default: envs/ beside the harness)")
    create.add_argument("--installer", choices=("auto", "uv", "pip"), default="auto",
                        help="what installs: uv (told pip's configured sources) where it is found, else pip "
                             "(default auto); both install the same distributions")
    create.add_argument("--torch-index", default=None, metavar="URL|none",
                        help="an index (PEP 503) that environments installing torch, torchvision or torchaudio take "
                             "them from too, the best match with pip's sources (default: $HARNESS_TORCH_INDEX, else "
                             "for CPU builds PyTorch's CPU index https://download.pytorch.org/whl/cpu where it "
                             "answers); none: pip's sources alone, the pins as they are")
    create.add_argument("--jobs", type=int, default=None,
                        help="environments made side by side (default: 2 with uv where the cores and memory "
                             "allow, else 1: harness.execution.environments.default_jobs)")
    envs.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from harness.execution import environments, installers
    from harness.spec import ROOT

    envs_dir = Path(args.dir) if args.dir else ROOT / "envs"
    gpu, why = environments.choose_build(args.gpu, args.cpu)
    try:  # every name first: an unknown one is one line, before anything is made
        wanted = _wanted(args)
        for _, framework, _ in wanted:
            environments.requirements_for(framework, gpu)
    except ValueError as err:
        print(f"harness envs create: {err}", file=sys.stderr)
        return EXIT_USAGE
    # what the requirements are written for; which build each environment got is on its own line
    print(f"harness envs create: requirements/<framework>-{'gpu' if gpu else 'cpu'}.txt, written for "
          f"{'CUDA' if gpu else 'CPU'} builds: {why}", file=sys.stderr)
    if args.spec:  # what it will not make, said before anything is made (a dry run too)
        from harness import spec as spec_module

        for line in environments.spec_elsewhere(spec_module.load(args.spec)):
            print(f"harness envs create: {line}", file=sys.stderr)
    missing = [w for w in wanted if not environments.up_to_date(w[1], envs_dir, gpu, w[0], w[2])]
    try:
        installer, jobs, torch_index = _sources(args, missing, gpu)
    except ValueError as err:
        print(f"harness envs create: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        for folder, framework, packages in wanted:
            print(environments.plan_create(framework, envs_dir, gpu, name=folder, packages=packages))
        return 0
    made: dict[str, tuple[str, Path]] = {}
    failed = 0
    started = time.monotonic()
    for folder, framework, outcome in environments.create_each(wanted, envs_dir, gpu, installer, jobs=jobs,
                                                               torch_index=torch_index):
        if isinstance(outcome, subprocess.CalledProcessError):
            failed += 1
            log = _keep_log(envs_dir, folder, outcome)
            print(f"harness envs create: {folder}: `{_shown(outcome.cmd)}` failed with status {outcome.returncode}"
                  f": {installers.last_words(outcome.output) or 'no output'} (its output: {log})", file=sys.stderr)
        elif isinstance(outcome, ValueError):
            print(f"harness envs create: {outcome}", file=sys.stderr)
            return EXIT_USAGE
        elif isinstance(outcome, Exception):
            failed += 1
            print(f"harness envs create: {folder}: {type(outcome).__name__}: {outcome}", file=sys.stderr)
        else:
            python, fresh = outcome
            packages = next(p for f, _, p in wanted if f == folder)
            if fresh and (problem := _import_problem(framework, python, packages)) is not None:
                failed += 1
                shutil.rmtree(python.parent.parent, ignore_errors=True)  # not kept as if it were made
                print(f"harness envs create: {folder}: {problem}; removed", file=sys.stderr)
                continue
            print(_made_line(folder, python, time.monotonic() - started if fresh else None, gpu), file=sys.stderr)
            made[folder] = (framework, python)
    if failed:
        return 1
    lines = [environments.spec_entry(made[folder][0], made[folder][1]) for folder, _, _ in wanted if folder in made]
    if lines:
        print("frameworks:\n" + "\n".join(lines))
    return 0


def _sources(args: argparse.Namespace, missing: list[tuple[str, str, tuple[str, ...]]],
             gpu: bool) -> tuple[Installer | None, int, str | None]:
    """For the environments to make (``missing``): the installer (``installers.choose``: only then is pip's
    configuration read), how many at a time, and the index for torch (``installers.torch_index``: only where one of
    them installs torch, torchvision or torchaudio), each said in a line. Raises ValueError when the installer asked
    for cannot be used."""
    from harness.execution import environments, installers

    if not missing:
        return None, 1, None
    installer = installers.choose(None if args.installer == "auto" else args.installer)
    jobs = max(1, min(args.jobs if args.jobs is not None else environments.default_jobs(installer), len(missing)))
    print(f"harness envs create: {'would install' if args.dry_run else 'installing'}"
          f"{installer.describe().removeprefix('installing')}" +
          (f"; {jobs} environments at a time" if jobs > 1 else ""), file=sys.stderr)
    torch_index = None
    if any(installers.uses_torch(environments.requirements_for(f, gpu), p) for _, f, p in missing):
        torch_index, said = installers.torch_index(args.torch_index, gpu)
        print(f"harness envs create: {said}", file=sys.stderr)
    return installer, jobs, torch_index


def _made_line(folder: str, python: Path, took_s: float | None, gpu: bool) -> str:
    """An environment made now (``took_s`` seconds since the first started) or kept (None): its interpreter, which
    builds it holds and its size (``environments.what_it_got``); a CUDA build of torch kept where CPU builds are
    wanted says how to replace it."""
    from harness.execution import environments

    got = environments.what_it_got(python)
    line = f"{folder}: {python} ({'up to date' if took_s is None else f'created, {took_s:.0f} s'}; {got})"
    if not gpu and took_s is None and re.search(r"torch \S+ CUDA", got):
        line += (f"; a CUDA build of torch: remove {python.parent.parent} and create it again for the CPU build "
                 "from PyTorch's CPU index")
    return line


def _import_problem(framework: str, python: Path, packages: tuple[str, ...]) -> str | None:
    """Why a new environment is not what it says, in one line, or None: its framework, through its adapter as a
    trial imports it (``harness.execution.probes.probe``; an adapter the registry does not know is not probed), then
    each of its packages (``probes.package_problem``)."""
    import adapters  # the registry imports no framework
    from harness.execution import probes
    from harness.spec import FrameworkEntry

    if adapters.declaration(framework) is not None:
        try:
            probes.probe(FrameworkEntry(name=framework, python=str(python)))
        except ValueError as err:
            return str(err)
    return probes.package_problem(python, packages)


def _shown(command: Any) -> str:
    """A failed install command in few words: the program and what it installed (a requirements file)."""
    words = [str(w) for w in (command if isinstance(command, (list, tuple)) else [command])]
    program = Path(words[0]).name if words else "?"
    tail = words[words.index("-r"):] if "-r" in words else words[-3:]
    return " ".join([program, *words[1:3], "...", *tail]) if len(words) > 3 + len(tail) else " ".join(words)


def _keep_log(envs_dir: Path, folder: str, err: subprocess.CalledProcessError) -> Path:
    """Writes a failed install's whole output beside the environments (its environment is removed)."""
    log = envs_dir / f"{folder}.failed.log"
    try:
        envs_dir.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(map(str, err.cmd))}\n{err.output or ''}", encoding="utf-8")
    except OSError:
        pass
    return log


def _wanted(args: argparse.Namespace) -> list[tuple[str, str, tuple[str, ...]]]:
    """(folder, framework, packages) of each environment to make: a spec's (``--spec``: those its entries run in,
    ``harness.execution.environments.spec_environments``), else each framework named (default: every built-in one)
    in a folder of its name. Raises ValueError (and SpecError for a spec that does not load)."""
    from harness.execution import environments

    if args.spec:
        from harness import spec

        if args.frameworks:
            raise ValueError("give frameworks or --spec, not both")
        return environments.spec_environments(spec.load(args.spec))  # its field rules: the data need not be there
    return [(f, f, ()) for f in (args.frameworks or environments.default_frameworks())]
