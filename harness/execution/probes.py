"""The environment probe: once per run, each framework entry's interpreter is started (or a child of the preloaded
parent its trials fork from, ``harness.execution.workers.Workers.probe_runner``) and reports its Python, numpy,
framework and packages, and whether it has what its worker needs. A worker needs, in its interpreter, only numpy
(1.26 or 2.x), pydantic, PyYAML and its framework: the harness itself is imported from the folder that holds it
(``harness.execution.bootstrap``), never installed there."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.execution.entry import PROBE_PREFIX
from harness.execution.environments import requirements_file
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
        out["fork_safe"] = bool(type(adapter).declaration.start.fork_safe)
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
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # the report is out: the framework's own teardown skipped, as a worker's (bootstrap.exit_with)
"""


# Runs in a new environment's interpreter: ``-c IMPORTS REQUIREMENT...``. Each requirement's distribution (its name
# before any version or extra; a wheel file's, from its file name) and its top-level modules (top_level.txt, else its
# files' top-level packages and modules), imported one by one. One JSON line: the first that failed, or {}.
IMPORTS = r"""
import importlib, importlib.metadata as md, json, os, re, sys
def name_of(requirement):
    base = os.path.basename(requirement)
    if base.endswith(".whl"):
        return base.split("-")[0]
    return re.split(r"[<>=!~\[;@ ]", requirement.strip(), maxsplit=1)[0]
for requirement in sys.argv[1:]:
    name = name_of(requirement)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        print(json.dumps({"package": name, "error": "not installed"})); sys.exit(0)
    tops = (dist.read_text("top_level.txt") or "").split() or sorted({
        f.parts[0].removesuffix(".py") for f in dist.files or []
        if (len(f.parts) == 2 and f.name == "__init__.py") or (len(f.parts) == 1 and f.suffix == ".py")})
    for top in (t for t in tops if not t.startswith("_")):
        try:
            importlib.import_module(top)
        except BaseException as exc:
            text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
            print(json.dumps({"package": name, "module": top, "error": text})); sys.exit(0)
print("{}")
"""


def package_problem(python: str | os.PathLike[str], packages: list[str] | tuple[str, ...],
                    timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why a package of ``packages`` cannot be imported in the interpreter ``python``, in one line, or None.

    Args:
        python: a new environment's interpreter.
        packages: pip requirements as a spec entry's ``packages`` gives them (``timm``, ``torchvision==0.29.1``, a
            wheel file).

    Returns:
        ``"<package> cannot be imported (<module>: <error>)"`` for the first that fails (with a note where the error
        names CUDA: a CUDA build beside CPU ones), ``"<package> is not installed"``, or None when each imports.
    """
    if not packages:
        return None
    done = subprocess.run([str(python), "-c", IMPORTS, *packages], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONNOUSERSITE": "1"})
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("{")), None)
    if line is None:
        last = next((x.strip() for x in reversed(done.stderr.splitlines()) if x.strip()), "no output")
        return f"the import check exited with status {done.returncode}: {last[:300]}"
    found = json.loads(line)
    if not found:
        return None
    if found["error"] == "not installed":
        return f"{found['package']} is not installed"
    cuda = " (a CUDA build beside CPU ones? pin the package's CPU build)" if "cuda" in found["error"].lower() else ""
    return f"{found['package']} cannot be imported ({found['module']}: {found['error']}){cuda}"


def _probe_code() -> str:
    return PROBE.replace("PREFIX", repr(PROBE_PREFIX))


_CACHE: dict[tuple[Any, ...], dict[str, Any]] = {}
#: (interpreter argv, adapter name, HARNESS_ADAPTERS) -> the adapter's ``Start.fork_safe``, as its probe read it
#: from the class: what ``declared_fork_safe`` answers for an adapter of HARNESS_ADAPTERS, whose declaration this
#: process never imports.
_FORK_SAFE: dict[tuple[tuple[str, ...], str, str], bool] = {}
#: ``via(code, args, timeout_s) -> (exit status, standard output, standard error)``: a probe run elsewhere.
ProbeRunner = Callable[[str, list[str], float], "tuple[int, str, str] | None"]


def _declared_environment() -> dict[str, str]:
    import adapters  # the registry imports no framework

    return {key: value for declared in adapters.declarations() for key, value in declared.environment.variables.items()}


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
    preloaded parent the entry's trials will fork from: ``harness.execution.workers.Workers.probe_runner``); when it
    fails or gives no report, the probe starts the interpreter as usual, whose error is the one raised.

    Raises ValueError with a one-line reason when the prefix cannot start, exits without a report, lacks numpy,
    pydantic, PyYAML or a needed or loader module, or cannot import the framework. A framework that cannot use
    ``device`` is not an error here: ``probe_entries`` decides."""
    argv = entry.argv()
    needed, loader = needed or {}, loader or {}
    request = json.dumps(model, sort_keys=True) if model is not None else ""
    key = (*_entry_key(entry), device, tuple(sorted(needed)), tuple(sorted(loader)), request)
    if key in _CACHE:
        return _CACHE[key]
    shown = " ".join(argv)
    # the adapters' declared defaults (log levels; JAX's GPU backend, started by its device query, would otherwise map
    # 75 % of the GPU's memory), a value of the caller's environment first
    env = {**_declared_environment(), **os.environ, "PYTHONUNBUFFERED": "1"}
    args = [str(ROOT), entry.name, key[2], device, request, *LIGHT_DEPENDENCIES, *needed, *loader]
    returncode, stdout, stderr = _answer(argv, args, env, timeout_s, via)
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
    _FORK_SAFE[_entry_key(entry)] = bool(info.get("fork_safe"))
    return info


def _entry_key(entry: FrameworkEntry) -> tuple[tuple[str, ...], str, str]:
    """What identifies an entry's adapter class here: its interpreter's argv, its name, and HARNESS_ADAPTERS."""
    return tuple(entry.argv()), entry.name, os.environ.get("HARNESS_ADAPTERS", "")


def declared_fork_safe(name: str, python: str | None) -> bool | None:
    """Whether adapter ``name`` in the interpreter ``python`` (None: this one) declares its workers safe to fork
    (``Start.fork_safe``), as a probe of this process read it there (``probe``); None when no probe of it has
    run here (a Ray task's process, a worker started without a sweep)."""
    return _FORK_SAFE.get(_entry_key(FrameworkEntry(name=name, python=python)))


def _answer(argv: list[str], args: list[str], env: dict[str, str], timeout_s: float,
            via: ProbeRunner | None) -> tuple[int, str, str]:
    """The probe's exit status, standard output and standard error: from ``via`` where it gives a report, else from
    ``argv`` started with ``env``. Raises ValueError when that cannot start or does not answer in time."""
    if via is not None:  # a child of the preloaded parent the trials fork from
        try:
            answer = via(_probe_code(), args, timeout_s)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            answer = None
        if answer is not None and any(x.startswith(PROBE_PREFIX) for x in answer[1].splitlines()):
            return answer  # without a report, the cold start below says what is wrong, in its own words
    try:
        proc = subprocess.run([*argv, "-c", _probe_code(), *args], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout_s, env=env)
    except (FileNotFoundError, PermissionError) as err:
        raise ValueError(f"cannot start {argv[0]!r}: {err.strerror or err}") from None
    except subprocess.TimeoutExpired:
        raise ValueError(f"`{' '.join(argv)}` did not answer the probe within {timeout_s:g} s") from None
    return proc.returncode, proc.stdout, proc.stderr


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
    declared = adapters.declaration(name)
    return dict(declared.capabilities.loader_modules) if declared is not None and "loader" in inputs else {}
