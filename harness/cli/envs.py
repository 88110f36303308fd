"""``harness envs create``: one virtualenv per framework under envs/, from requirements/<framework>-cpu|gpu.txt."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.cli.common import EXIT_USAGE


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
    envs.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from harness.execution import environments
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
    print(f"harness envs create: {'CUDA' if gpu else 'CPU'} builds (requirements/<framework>-"
          f"{'gpu' if gpu else 'cpu'}.txt): {why}", file=sys.stderr)
    lines = []
    for folder, framework, packages in wanted:
        if args.dry_run:
            print(environments.plan_create(framework, envs_dir, gpu, name=folder, packages=packages))
            continue
        try:
            python, made = environments.create(framework, envs_dir, gpu=gpu, name=folder, packages=packages)
        except ValueError as err:
            print(f"harness envs create: {err}", file=sys.stderr)
            return EXIT_USAGE
        except subprocess.CalledProcessError as err:
            print(f"harness envs create: {framework}: `{' '.join(map(str, err.cmd))}` failed with status "
                  f"{err.returncode}", file=sys.stderr)
            return 1
        print(f"{folder}: {python} ({'created' if made else 'up to date'})", file=sys.stderr)
        lines.append(environments.spec_entry(framework, python))
    if lines:
        print("frameworks:\n" + "\n".join(lines))
    return 0


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
