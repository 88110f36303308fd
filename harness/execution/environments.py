"""Framework environments: ``create`` (``harness envs create``), one virtual environment per framework under
``envs/``, made with uv or pip from requirements/, kept while up to date. What a run checks in an entry's
interpreter is the probe (``harness.execution.probes``)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from harness.execution import installers
from harness.spec import ROOT, Spec


def requirements_file(framework: str, gpu: bool = False) -> Path:
    """``requirements/<framework>-cpu.txt`` or ``-gpu.txt`` in the harness's folder."""
    return ROOT / "requirements" / f"{framework}-{'gpu' if gpu else 'cpu'}.txt"


def choose_build(gpu: bool = False, cpu: bool = False, gpu_info: dict[str, Any] | None = None) -> tuple[bool, str]:
    """Which builds ``envs create`` installs: (True for CUDA builds, why, in words). ``--gpu`` / ``--cpu`` decide
    when given; else CUDA builds when NVML sees an NVIDIA GPU (``harness.measure.machine.gpus``, or ``gpu_info`` in
    its shape), CPU builds otherwise."""
    if gpu:
        return True, "--gpu given"
    if cpu:
        return False, "--cpu given"
    from harness.measure.machine import gpus

    info = gpus() if gpu_info is None else gpu_info
    if info.get("available"):
        names = sorted({d["name"] for d in info.get("devices", [])})
        count = len(info.get("devices", []))
        return True, f"NVML sees {count} NVIDIA GPU(s) ({', '.join(names)}); --cpu builds CPU ones instead"
    return False, f"NVML sees no NVIDIA GPU ({info.get('reason', 'none found')}); --gpu builds CUDA ones instead"


def plan_create(framework: str, envs_dir: Path, gpu: bool, name: str | None = None,
                packages: tuple[str, ...] = ()) -> str:
    """One line: what ``create(framework, envs_dir, gpu, name=name, packages=packages)`` would do (keep, make, or
    remake and why). Raises ValueError as ``create`` does for a framework without a requirements file."""
    requirements = requirements_for(framework, gpu)
    target = envs_dir / (name or framework)
    shown = f"{requirements.relative_to(ROOT)}" + (f" + {' '.join(packages)}" if packages else "")
    stamp = target / ".harness-stamp"
    label = name or framework
    if not (target / "bin" / "python").exists():
        return f"{label}: would create {target} from {shown}"
    if up_to_date(framework, envs_dir, gpu, name, packages):
        return f"{label}: {target} is up to date ({shown})"
    before = stamp.read_text().splitlines()[1:2] if stamp.exists() else []
    return (f"{label}: would remake {target} from {shown}" +
            (f" (it was made from {before[0]})" if before else " (made from other requirements or Python)"))


def up_to_date(framework: str, envs_dir: Path, gpu: bool, name: str | None = None,
               packages: tuple[str, ...] = ()) -> bool:
    """Whether ``envs_dir/<name>`` was made (whole) from the requirements, packages and Python that ``create`` would
    make it from now, so that ``create`` keeps it."""
    target = envs_dir / (name or framework)
    stamp = target / ".harness-stamp"
    return ((target / "bin" / "python").exists() and stamp.exists()
            and _stamp_matches(stamp, requirements_for(framework, gpu), packages))


def requirements_for(framework: str, gpu: bool) -> Path:
    """``requirements_file(framework, gpu)``; raises ValueError naming the frameworks that have one when it is
    missing."""
    requirements = requirements_file(framework, gpu)
    if not requirements.exists():
        known = sorted({p.name.rsplit("-", 1)[0] for p in requirements.parent.glob("*-cpu.txt")})
        raise ValueError(f"no {requirements.relative_to(ROOT)}; environments can be made for {', '.join(known)}")
    return requirements


def _stamp_matches(stamp: Path, requirements: Path, packages: tuple[str, ...] = ()) -> bool:
    lines = stamp.read_text().splitlines()
    return bool(lines) and lines[0].strip() == _stamp(requirements, packages)


def _stamp(requirements: Path, packages: tuple[str, ...] = ()) -> str:
    """What an environment was made from: the requirements file (and the files it includes), the packages added to
    it (a spec entry's ``packages``) and the Python."""
    digest = hashlib.sha256(sys.version.encode())
    for path in (requirements, requirements.parent / "worker.txt"):
        if path.exists():
            digest.update(path.name.encode() + path.read_bytes())
    if packages:  # an environment without packages keeps the digest it always had
        digest.update(("\n".join(sorted(packages))).encode())
    return digest.hexdigest()


def create(framework: str, envs_dir: Path, gpu: bool = False, name: str | None = None,
           packages: tuple[str, ...] = (), installer: installers.Installer | None = None,
           torch_index: str | None = None) -> tuple[Path, bool]:
    """Makes (or keeps, when it was made from the same requirements, packages and Python) ``envs_dir/<name>`` (default
    name: the framework's): a virtual environment with the framework's requirements, ``-gpu.txt`` (CUDA builds) when
    ``gpu`` else ``-cpu.txt``, then ``packages`` (pip requirements a spec entry needs beside its framework, installed
    after them, so that they may replace a pinned version: torchvision needs its own torch), installed by
    ``installer`` (default ``installers.choose()``: uv told pip's sources where it is found, else pip); its
    ``.harness-stamp`` says what it was made from, so a switch of requirements remakes it (a switch of installer does
    not: both install the same). ``torch_index`` (``installers.torch_index``: PyTorch's CPU index) is added to the
    sources where the requirements or packages name torch, torchvision or torchaudio (``installers.uses_torch``); its
    stamp names it, and a switch of index does not remake it. Returns (its python, whether it was made now). Raises
    ValueError for a framework without a requirements file and subprocess.CalledProcessError (its ``output`` the
    command's) when an install fails; a failed or interrupted one leaves no half-made environment behind."""
    requirements = requirements_for(framework, gpu)
    target = envs_dir / (name or framework)
    python = target / "bin" / "python"
    stamp = target / ".harness-stamp"
    if up_to_date(framework, envs_dir, gpu, name, packages):
        return python, False
    if target.exists():
        shutil.rmtree(target)
    chosen = installer or installers.choose()
    env = chosen.environment()
    index = torch_index if torch_index and installers.uses_torch(requirements, packages) else None
    try:
        for command in chosen.commands(python, requirements, packages, extra_index=index):
            installers.run(command, env)
        # First line: the digest that decides; second: what from, for people (a switch of --gpu/--cpu remakes it).
        added = f" + {' '.join(packages)}" if packages else ""
        stamp.write_text(f"{_stamp(requirements, packages)}\n{requirements.relative_to(ROOT)}{added} "
                         f"({'CUDA' if gpu else 'CPU'} builds, installed with {chosen.version or chosen.kind}"
                         f"{f', torch from {index} too' if index else ''})\n")
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return python, True


def default_jobs(installer: installers.Installer | None) -> int:
    """How many environments ``harness envs create`` makes side by side by default: with uv two, never more than
    the machine's cores nor one per GiB of available memory (compiling to bytecode runs a Python process per core);
    with pip one. On the 2-core VM, the four environments of specs/quick.yaml from empty caches: uv two at a time 67 s
    (the first ``make run`` of a fresh clone), pip one after another 235 s, at a load of about 4.5 from other work
    both; an earlier session's uv one at a time 121 and 98 s against 81 and 92 s two at a time (from a warm uv cache,
    where compiling is most of the work, 80 and 73 s against 83 and 97 s). pip two at a time was not faster under
    load (374 s at a load of 11)."""
    if installer is None or installer.kind != "uv":
        return 1
    return max(1, min(2, os.cpu_count() or 1, _available_gib()))


def _available_gib() -> int:
    """Whole GiB of memory available to new processes (psutil's ``available``: Linux's MemAvailable)."""
    import psutil

    return int(psutil.virtual_memory().available // 2**30)


def _kept(framework: str, envs_dir: Path, gpu: bool, name: str, packages: tuple[str, ...]) -> bool:
    try:
        return up_to_date(framework, envs_dir, gpu, name, packages)
    except ValueError:  # no requirements file: create says so
        return False


# ---------------------------------------------------------------------------------- what an environment got


def site_packages(python: Path) -> Path | None:
    """The site-packages folder of the virtual environment whose interpreter is ``python`` (``ENV/bin/python``), or
    None where it has none."""
    found = sorted((python.parent.parent / "lib").glob("python3*/site-packages"))
    return found[-1] if found else None


def _installed(site: Path) -> dict[str, str]:
    """The distributions in ``site`` (normalized name: version), from their ``NAME-VERSION.dist-info`` folders."""
    out = {}
    for info in site.glob("*.dist-info"):
        name, _, version = info.name.removesuffix(".dist-info").partition("-")
        out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def _torch_build(version: str, site: Path) -> str:
    """CPU or CUDA, for torch ``version`` in ``site``: its local version (+cpu, +cu128, +rocm6.4), else what its
    torch/version.py says (``cuda = None`` for a CPU build: PyPI's releases carry no local version)."""
    local = version.partition("+")[2]
    if local == "cpu":
        return "CPU"
    if re.fullmatch(r"cu\d{3,}", local):
        return f"CUDA {local[2:-1]}.{local[-1]}"
    if local.startswith("rocm"):
        return f"ROCm {local[4:]}"
    try:
        text = (site / "torch" / "version.py").read_text(encoding="utf-8")
    except OSError:
        return "build unknown"
    found = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(.+)$", text, re.MULTILINE)
    value = found.group(1).strip().strip("'\"") if found else ""
    return "CPU" if value == "None" else f"CUDA {value}" if value else "build unknown"


def builds(python: Path) -> list[str]:
    """The frameworks an environment holds and which build of each, read from its files (nothing is imported):
    ``["torch 2.13.0+cpu CPU build"]``. torch: its version and torch/version.py; JAX: a CUDA plugin beside jaxlib;
    TensorFlow: tensorflow-cpu, or the NVIDIA libraries beside tensorflow; MXNet: mxnet-cuNNN. Other packages from
    NVIDIA's CUDA libraries, with none of those: "CUDA libraries"."""
    site = site_packages(python)
    if site is None:
        return []
    dists = _installed(site)
    nvidia = any(name.startswith("nvidia-") for name in dists)
    out = []
    if "torch" in dists:
        out.append(f"torch {dists['torch']} {_torch_build(dists['torch'], site)} build")
    if "jaxlib" in dists:
        plugins = sorted(filter(None, (re.fullmatch(r"jax-(cuda|rocm)(\d+)-plugin", n) for n in dists)),
                         key=lambda m: m[0])
        kind = f"{'CUDA' if plugins[0][1] == 'cuda' else 'ROCm'} {plugins[0][2]}" if plugins else "CPU"
        out.append(f"jax {dists.get('jax', dists['jaxlib'])} {kind} build")
    for name in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        if name in dists:
            kind = "CPU build" if name == "tensorflow-cpu" else "CUDA build" if nvidia else "build, no CUDA libraries"
            out.append(f"{name} {dists[name]} {kind}")
    for name in sorted(n for n in dists if n == "mxnet" or n.startswith("mxnet-")):
        digits = name.removeprefix("mxnet-cu")
        out.append(f"{name} {dists[name]} {f'CUDA {digits[:-1]}.{digits[-1]}' if digits.isdigit() else 'CPU'} build")
    if not out and nvidia:
        out.append("CUDA libraries")
    return out


def disk_size(folder: Path) -> int:
    """Bytes on disk under ``folder``, each file once (hard links shared with uv's cache or another environment count
    here in full, as ``du -s FOLDER`` counts them), links not followed."""
    seen, total = set(), 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(parent, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def shown_size(size: int) -> str:
    """Bytes in words: "850 MB", "5.7 GB" (powers of ten)."""
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"


def what_it_got(python: Path) -> str:
    """One phrase: the builds an environment holds (``builds``) and its size on disk (``disk_size``):
    "torch 2.13.0+cpu CPU build; 1.2 GB"."""
    return "; ".join([", ".join(builds(python)) or "no framework build found",
                      shown_size(disk_size(python.parent.parent))])


#: What ``create_each`` yields per environment: (folder, framework, (python, made now) or the exception that stopped
#: it: subprocess.CalledProcessError, ValueError or OSError).
Outcome = tuple[str, str, tuple[Path, bool] | Exception]


def create_each(wanted: list[tuple[str, str, tuple[str, ...]]], envs_dir: Path, gpu: bool = False,
                installer: installers.Installer | None = None, jobs: int = 1,
                torch_index: str | None = None) -> Iterator[Outcome]:
    """``create`` (with ``torch_index``) for each (folder, framework, packages) of ``wanted``, ``jobs`` at a time
    (threads, each waiting on its installer's processes), yielding each outcome as it ends. After a failure no
    further one starts; those under way finish (each made whole, or removed). Interrupted (KeyboardInterrupt,
    SystemExit), it ends the install commands under way, waits until their half-made environments are removed, and
    raises again."""
    chosen = installer
    if chosen is None and not all(_kept(framework, envs_dir, gpu, folder, packages)
                                  for folder, framework, packages in wanted):
        chosen = installers.choose()  # once for all of them
    if jobs <= 1 or len(wanted) <= 1:
        failed = False
        for folder, framework, packages in wanted:
            if failed:
                break
            try:
                yield folder, framework, create(framework, envs_dir, gpu, name=folder, packages=packages,
                                                installer=chosen, torch_index=torch_index)
            except (subprocess.CalledProcessError, ValueError, OSError) as err:
                failed = True
                yield folder, framework, err
        return
    pending = list(wanted)
    running: dict[Future[tuple[Path, bool]], tuple[str, str]] = {}
    failed = False
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="envs-create")
    try:
        while True:
            # each started here, only while nothing failed: after a failure none starts (no race with the pool)
            while pending and not failed and len(running) < jobs:
                folder, framework, packages = pending.pop(0)
                running[pool.submit(create, framework, envs_dir, gpu, folder, packages, chosen,
                                    torch_index)] = (folder, framework)
            if not running:
                return
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                folder, framework = running.pop(future)
                try:
                    outcome: tuple[Path, bool] | Exception = future.result()
                except (subprocess.CalledProcessError, ValueError, OSError) as err:
                    failed, outcome = True, err
                yield folder, framework, outcome
    except BaseException:  # interrupted, or the caller stopped reading: end the installs under way
        installers.stop_all()
        raise
    finally:
        pool.shutdown(wait=True)


def spec_environments(spec: Spec) -> list[tuple[str, str, tuple[str, ...]]]:
    """The environments under envs/ that ``spec``'s entries run in, each once: (the folder's name, the framework
    whose requirements it is made from, the packages its entries add). An entry whose interpreter is not
    ``envs/<folder>/bin/python`` (the harness's own, a container, a path elsewhere) is not one of them. Raises
    ValueError when two entries of one folder name different frameworks or packages."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for entry in spec.entries:
        python = Path(entry.python) if entry.python and not entry.command else None
        if python is None or python.parent.parent.parent != ROOT / "envs" or python.name != "python":
            continue
        folder, made = python.parent.parent.name, (entry.name, tuple(entry.packages))
        if out.setdefault(folder, made) != made:
            raise ValueError(f"envs/{folder} is named by entries of {out[folder][0]} {list(out[folder][1])} and of "
                             f"{entry.name} {entry.packages}: give each its own environment")
    return [(folder, framework, packages) for folder, (framework, packages) in out.items()]


def spec_elsewhere(spec: Spec) -> list[str]:
    """The entries of ``spec`` whose interpreter ``create`` does not make (not ``envs/<folder>/bin/python``: a path
    elsewhere, a command prefix, or the harness's own interpreter), one line each saying so."""
    out = []
    for entry in spec.entries:
        python = Path(entry.python) if entry.python and not entry.command else None
        if python is not None and python.parent.parent.parent == ROOT / "envs" and python.name == "python":
            continue
        where = (f"its command `{' '.join(entry.command)}`" if entry.command else
                 f"its interpreter {entry.python}" if entry.python else "the harness's own interpreter")
        out.append(f"{entry.row}: {where} is not made here (envs create makes envs/<folder>/bin/python only; "
                   "install the framework there yourself)")
    return out


def spec_entry(framework: str, python: Path) -> str:
    """The spec line that runs ``framework`` in the environment at ``python``."""
    try:
        shown = "{root}/" + str(python.relative_to(ROOT))
    except ValueError:
        shown = str(python)
    return f'  - {{name: {framework}, python: "{shown}"}}'


def default_frameworks() -> list[str]:
    """The built-in adapters' names, in the registry's order."""
    import adapters  # the registry imports no framework

    return [declared.name for declared in adapters.declarations()]
