"""Framework environments: the probe that checks, once per run, that each framework entry's interpreter starts and
has what its worker needs, and ``create`` (``harness envs create``), one virtual environment per framework under
``envs/``. A worker needs, in its interpreter, only numpy (1.26 or 2.x), pydantic, PyYAML and its framework: the
harness itself is imported from the folder that holds it (``harness.execution.bootstrap``), never installed there."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from harness.execution import installers
from harness.execution.entry import PROBE_PREFIX
from harness.execution.native_probe import checked, request
from harness.spec import ROOT, FrameworkEntry, Spec, SpecError

PROBE_TIMEOUT_S = 300.0  # a container image may have to start; importing TensorFlow alone takes seconds
LIGHT_DEPENDENCIES = {"numpy": "numpy", "pydantic": "pydantic", "yaml": "PyYAML"}  # module -> distribution
#: What loading a dataset needs in the worker, module -> distribution.
DATASET_DEPENDENCIES = {"digits": {"sklearn": "scikit-learn"}, "image_folder": {"PIL": "Pillow"}}

# Runs in the entry's interpreter: ``-c PROBE ROOT NAME HARNESS_ADAPTERS DEVICE MODEL MODULE...`` (MODEL: the JSON
# request of a model of your own, or ""; the modules it must find:
# the light dependencies and what the dataset needs; the registry travels as an argument: a container does not inherit
# the environment). Standard library first, then the light dependencies, then the adapter (which imports the
# framework, as a trial would), for a GPU whether the framework can use it (Adapter.device_problem), and for an entry
# with a model of its own that model (harness.execution.native_probe.check). One marked JSON line on standard output.
PROBE = r"""
import importlib.metadata as md, importlib.util, json, os, platform, sys, traceback
root, name, registry, device, model, modules = (*sys.argv[1:6], sys.argv[6:])
# What is installed in this interpreter: its own paths, not the current directory or the harness's folder (whose
# egg-info an editable install leaves there).
own = [p for p in sys.path if p and os.path.abspath(p) not in (os.getcwd(), os.path.abspath(root))]
packages = sorted({f"{d.metadata['Name']}=={d.version}" for d in md.distributions(path=own) if d.metadata["Name"]},
                  key=str.lower)
sys.path.insert(0, root)
if registry:
    os.environ["HARNESS_ADAPTERS"] = registry
out = {"python_version": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
       "missing": [m for m in modules if importlib.util.find_spec(m) is None], "packages": packages}
if not out["missing"]:
    import numpy
    out["numpy"] = numpy.__version__
    try:
        import adapters
        adapter = adapters.get(name)()
        out["versions"] = adapter.versions()
        if device != "cpu":
            out["device_problem"] = adapter.device_problem(device)
        if model:  # a model of your own, checked in the same interpreter
            from harness.execution.native_probe import check
            out["model_check"] = check(name, json.loads(model))
    except BaseException as exc:
        out["framework_error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        out["framework_missing"] = isinstance(exc, ImportError)
        out["traceback"] = traceback.format_exc()[-2000:]
sys.stdout.write(PREFIX + json.dumps(out) + "\n")
"""


def _probe_code() -> str:
    return PROBE.replace("PREFIX", repr(PROBE_PREFIX))


_CACHE: dict[tuple[Any, ...], dict[str, Any]] = {}
#: ``via(code, args, timeout_s) -> (exit status, standard output, standard error)``: a probe run elsewhere.
ProbeRunner = Callable[[str, list[str], float], "tuple[int, str, str] | None"]


def _declared_environment() -> dict[str, str]:
    import adapters  # the registry imports no framework

    return {key: value for record in adapters.records() for key, value in record.environment.items()}


def probe(entry: FrameworkEntry, needed: dict[str, str] | None = None,
          timeout_s: float = PROBE_TIMEOUT_S, device: str = "cpu", loader: dict[str, str] | None = None,
          model: dict[str, Any] | None = None, via: ProbeRunner | None = None) -> dict[str, Any]:
    """Starts ``entry``'s interpreter once and returns what it reports: ``python_version``, ``executable``,
    ``numpy``, ``versions`` (the adapter's: framework, CUDA, cuDNN where built in), ``packages`` (every installed
    distribution as ``name==version``, the environment's ``pip freeze``), and ``argv`` (the prefix). Results are
    kept for the life of this process (one probe per entry and run). needed: further modules the trial needs
    there (module -> distribution, e.g. scikit-learn for the digits dataset). loader: the modules the adapter's data
    loader needs there for ``input: loader`` (its declaration's ``loader_modules``, e.g. JAX's grain). device: "cpu" or
    "cuda:N"; for a GPU the report's ``device_problem`` is why the framework cannot use it
    (``Adapter.device_problem``), or None. model: a model of your own to check there
    (``harness.execution.native_probe.request``); its report is ``model_check``. via: runs the probe instead of a
    fresh interpreter, ``via(code, args, timeout_s) -> (exit status, stdout, stderr)`` (a forked child of the
    preloaded parent the entry's trials will fork from: ``harness.execution.launcher.server_probes``); when it
    fails or gives no report, the probe starts the interpreter as usual, whose error is the one raised.

    Raises ValueError with a one-line reason when the prefix cannot start, exits without a report, lacks numpy,
    pydantic, PyYAML or a needed or loader module, or cannot import the framework. A framework that cannot use
    ``device`` is not an error here: ``probe_entries`` decides."""
    argv = entry.argv()
    needed, loader = needed or {}, loader or {}
    request = json.dumps(model, sort_keys=True) if model is not None else ""
    key = (tuple(argv), entry.name, os.environ.get("HARNESS_ADAPTERS", ""), device, tuple(sorted(needed)),
           tuple(sorted(loader)), request)
    if key in _CACHE:
        return _CACHE[key]
    shown = " ".join(argv)
    # the adapters' declared defaults (log levels; JAX's GPU backend, started by its device query, would otherwise map
    # 75 % of the GPU's memory), a value of the caller's environment first
    env = {**_declared_environment(), **os.environ, "PYTHONUNBUFFERED": "1"}
    args = [str(ROOT), entry.name, key[2], device, request, *LIGHT_DEPENDENCIES, *needed, *loader]
    answer = None
    if via is not None:  # in a child of the preloaded parent the trials fork from; as a cold start where it cannot
        try:
            answer = via(_probe_code(), args, timeout_s)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            answer = None
        if answer is not None and not any(x.startswith(PROBE_PREFIX) for x in answer[1].splitlines()):
            answer = None  # no report: the cold start below says why, in its own words
    if answer is None:
        try:
            proc = subprocess.run([*argv, "-c", _probe_code(), *args], stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=timeout_s, env=env)
        except (FileNotFoundError, PermissionError) as err:
            raise ValueError(f"cannot start {argv[0]!r}: {err.strerror or err}") from None
        except subprocess.TimeoutExpired:
            raise ValueError(f"`{shown}` did not answer the probe within {timeout_s:g} s") from None
        answer = (proc.returncode, proc.stdout, proc.stderr)
    returncode, stdout, stderr = answer
    line = next((x for x in stdout.splitlines() if x.startswith(PROBE_PREFIX)), None)
    if line is None:
        last = next((x.strip() for x in reversed(stderr.splitlines()) if x.strip()), "")
        raise ValueError(f"`{shown}` exited with status {returncode} without reporting" +
                         (f": {last[:300]}" if last else ""))
    info = json.loads(line[len(PROBE_PREFIX):])
    where = info.get("executable") or shown
    light = [LIGHT_DEPENDENCIES[m] for m in info["missing"] if m in LIGHT_DEPENDENCIES]
    if light:
        raise ValueError(f"{where} (Python {info['python_version']}) lacks {', '.join(light)}: a worker needs numpy, "
                         "pydantic and PyYAML in its interpreter (pip install numpy pydantic PyYAML there)")
    for what, modules in (("the spec's dataset needs", needed),
                          (f"the {entry.name} adapter's data loader needs for input: loader", loader)):
        names = ", ".join(dict.fromkeys(modules[m] for m in info["missing"] if m in modules))
        if names:
            raise ValueError(f"{where} lacks {names}, which {what} in the worker (pip install {names} there)")
    if info.get("framework_error"):
        what = "is not installed in" if info.get("framework_missing") else "cannot be imported in"
        raise ValueError(f"{entry.name} {what} {where} ({info['framework_error']})")
    info["argv"] = argv
    _CACHE[key] = info
    return info


def gpu_fix(entry: FrameworkEntry) -> str:
    """What makes ``entry``'s interpreter able to use a GPU: ``harness envs create --gpu NAME`` for an environment
    under envs/, else a CUDA build of the framework installed there (requirements/NAME-gpu.txt)."""
    python = Path(entry.python) if entry.python and not entry.command else None
    if python is not None and python.parent.parent.parent == ROOT / "envs":
        return f"make a GPU environment with `harness envs create --gpu {python.parent.parent.name}`"
    gpu_file = requirements_file(entry.name, gpu=True)
    what = (f"the CUDA build of requirements/{gpu_file.name}" if gpu_file.exists()
            else f"a CUDA build of {entry.name}")
    return f"install {what} in that interpreter"


def probe_entries(spec: Spec, file: str | os.PathLike[str], device: str = "cpu",
                  via: Callable[[FrameworkEntry], ProbeRunner | None] | None = None) -> list[dict[str, Any]]:
    """Probes every framework entry of ``spec`` for ``device`` (the spec's, resolved: "cpu" or "cuda:N"), each where
    ``via(entry)`` runs it (``probe``'s ``via``), else in a fresh interpreter; returns
    what run.json records per entry: label, name, python and command as given, and the probe's report
    (python_version, executable, platform, numpy, versions, packages, argv). Raises SpecError ``FILE: frameworks.N:
    reason`` for the first that fails, also when its framework cannot use ``device`` (a CPU-only build on a GPU
    machine), naming the command that makes a GPU environment."""
    out = []
    for i, entry in enumerate(spec.entries):
        if entry.python and not entry.command and ("/" in entry.python) and not Path(entry.python).exists():
            hint = ""
            if Path(entry.python).parent.parent.parent == ROOT / "envs":
                hint = f"; `harness envs create --spec {file}` makes the environments this spec runs in"
            raise SpecError(file, f"frameworks.{i}", f"no interpreter at {entry.python}{hint}")
        try:
            info = probe(entry, DATASET_DEPENDENCIES.get(spec.dataset.name), device=device,
                         loader=loader_modules(spec, entry.name), model=request(spec, entry),
                         via=via(entry) if via is not None else None)
        except ValueError as err:
            raise SpecError(file, f"frameworks.{i}", str(err)) from None
        if info.get("device_problem"):
            where = info.get("executable") or " ".join(info["argv"])
            raise SpecError(file, f"frameworks.{i}", f"{entry.row} in {where} cannot use {device}: "
                                                     f"{info['device_problem']}; {gpu_fix(entry)} (or set device: cpu)")
        versions = {**info.get("versions", {}), **_package_versions(entry, info, file, i)}
        kept = ("traceback", "missing", "device_problem", "model_check")
        out.append({"label": entry.row, "name": entry.name, "python": entry.python, "command": entry.command,
                    **{k: v for k, v in info.items() if k not in kept}, "versions": versions,
                    **({"model": checked(entry, info, file, i)} if entry.model is not None else {})})
    return out


def _package_versions(entry: FrameworkEntry, info: dict[str, Any], file: str | os.PathLike[str],
                      index: int) -> dict[str, str]:
    """The installed version of each of ``entry.packages`` (pip requirements) in the entry's interpreter, as the
    probe listed its distributions. Raises SpecError ``frameworks.N.packages`` for one that is not installed, naming
    the command that installs it."""
    installed = {_distribution(line.split("==", 1)[0]): line.split("==", 1)[1]
                 for line in info.get("packages", []) if "==" in line}
    out: dict[str, str] = {}
    for requirement in entry.packages:
        name = _distribution(re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0])
        if name not in installed:
            where = info.get("executable") or " ".join(entry.argv())
            raise SpecError(file, f"frameworks.{index}.packages", f"{where} lacks {requirement}, which the entry "
                                  f"{entry.row} needs: `harness envs create --spec {file}` installs it (or pip "
                                  f"install {requirement!r} there)")
        out[name] = installed[name]
    return out


def _distribution(name: str) -> str:
    """A distribution's name normalised as pip compares them (PEP 503: lower case, runs of -_. as -)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def loader_modules(spec: Spec, name: str) -> dict[str, str]:
    """What the built-in adapter ``name``'s data loader needs in its worker's interpreter beside the framework
    (its declaration's ``loader_modules``, module -> distribution) when a trial of ``spec`` uses ``input: loader``
    (the spec's ``input`` or one of its variants'); {} otherwise, and for an adapter of ``HARNESS_ADAPTERS``."""
    import adapters  # the registry imports no framework

    inputs = {spec.input, *((spec.variants.input or []) if spec.variants is not None else [])}
    record = adapters.declaration(name)
    return dict(record.loader_modules) if record is not None and "loader" in inputs else {}


# ------------------------------------------------------------------------------------------------- envs create

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
           packages: tuple[str, ...] = (), installer: installers.Installer | None = None) -> tuple[Path, bool]:
    """Makes (or keeps, when it was made from the same requirements, packages and Python) ``envs_dir/<name>`` (default
    name: the framework's): a virtual environment with the framework's requirements, ``-gpu.txt`` (CUDA builds) when
    ``gpu`` else ``-cpu.txt``, then ``packages`` (pip requirements a spec entry needs beside its framework, installed
    after them, so that they may replace a pinned version: torchvision needs its own torch), installed by
    ``installer`` (default ``installers.choose()``: uv told pip's sources where it is found, else pip); its
    ``.harness-stamp`` says what it was made from, so a switch of requirements remakes it (a switch of installer does
    not: both install the same). Returns (its python, whether it was made now). Raises ValueError for a framework
    without a requirements file and subprocess.CalledProcessError (its ``output`` the command's) when an install
    fails; a failed or interrupted one leaves no half-made environment behind."""
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
    try:
        for command in chosen.commands(python, requirements, packages):
            installers.run(command, env)
        # First line: the digest that decides; second: which build, for people (a switch of --gpu/--cpu remakes it).
        added = f" + {' '.join(packages)}" if packages else ""
        stamp.write_text(f"{_stamp(requirements, packages)}\n{requirements.relative_to(ROOT)}{added} "
                         f"({'CUDA' if gpu else 'CPU'} builds, installed with {chosen.version or chosen.kind})\n")
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


#: What ``create_each`` yields per environment: (folder, framework, (python, made now) or the exception that stopped
#: it: subprocess.CalledProcessError, ValueError or OSError).
Outcome = tuple[str, str, tuple[Path, bool] | Exception]


def create_each(wanted: list[tuple[str, str, tuple[str, ...]]], envs_dir: Path, gpu: bool = False,
                installer: installers.Installer | None = None, jobs: int = 1) -> Iterator[Outcome]:
    """``create`` for each (folder, framework, packages) of ``wanted``, ``jobs`` at a time (threads, each waiting
    on its installer's processes), yielding each outcome as it ends. After a failure no further one starts; those
    under way finish (each made whole, or removed). Interrupted (KeyboardInterrupt, SystemExit), it ends the
    install commands under way, waits until their half-made environments are removed, and raises again."""
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
                                                installer=chosen)
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
                running[pool.submit(create, framework, envs_dir, gpu, folder, packages, chosen)] = (folder, framework)
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

    return [record.name for record in adapters.records()]
