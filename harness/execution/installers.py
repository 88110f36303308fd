"""How ``harness envs create`` installs an environment's requirements: with uv where it is found (its shared cache,
parallel downloads and unpacking: environments made again or side by side share every wheel), else with pip; the
same requirements files, the same sources and so the same distributions either way.

pip on a machine may be configured to look beyond PyPI (``pip config list``: find-links, extra indexes, a constraint
file). This project's CPU machines take torch 2.13.0's CPU wheel from a folder that way; on PyPI ``torch==2.13.0`` is
a CUDA build of several GB. uv reads none of pip's configuration, so ``choose`` translates it into uv's options
(``uv_options``) and answers pip, with the reason, when a setting has no translation or uv is not found. uv then
also takes the best match over all of those sources, as pip does (``--index-strategy unsafe-best-match``), and
compiles the installed modules to bytecode, as pip does (a worker's imports would otherwise compile them at every
trial where PYTHONDONTWRITEBYTECODE is set).

An environment that installs torch, torchvision or torchaudio for CPU builds takes them from PyTorch's CPU index too
(``torch_index``: ``--extra-index-url``, the best match with pip's sources, so ``torch==2.13.0`` resolves to
2.13.0+cpu rather than PyPI's CUDA build), where that index answers; offline, or with ``--torch-index none``, the
pins resolve as they always did (here, to the CPU wheel in the find-links folder).

Only the standard library: nothing here needs the harness's dependencies.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: pip settings that change only what pip prints, logs or caches, or nothing in a fresh environment: no translation
#: needed.
_HARMLESS = frozenset({
    "disable-pip-version-check", "cache-dir", "no-cache-dir", "progress-bar", "quiet", "verbose", "no-color",
    "no-input", "log", "log-file", "local-log", "root-user-action", "require-virtualenv", "require-venv",
    "no-warn-script-location", "no-warn-conflicts", "retries", "exists-action", "no-python-version-warning",
    "break-system-packages", "python",
    "config-file",  # PIP_CONFIG_FILE: the settings of that file are listed themselves
})
#: pip settings that say where pip looks, or what it accepts, and uv's option for each value.
_REPEATED = {"extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint",
             "trusted-host": "--allow-insecure-host"}
_SINGLE = {"index-url": "--index-url", "only-binary": "--only-binary", "no-binary": "--no-binary"}
_FLAGS = {"no-index": ("--no-index",), "pre": ("--prerelease", "allow"),
          "no-build-isolation": ("--no-build-isolation",)}
#: pip settings that uv takes from its environment.
_ENVIRONMENT = {"cert": ("SSL_CERT_FILE",), "client-cert": ("SSL_CLIENT_CERT",),
                "timeout": ("UV_HTTP_TIMEOUT",), "default-timeout": ("UV_HTTP_TIMEOUT",),
                "proxy": ("HTTP_PROXY", "HTTPS_PROXY")}
#: uv's own variables that change nothing about what is installed; every other UV_* (an index, a constraint, a
#: resolution strategy of the caller's) is left out of uv's environment, as ``--no-config`` leaves out uv.toml.
_UV_KEPT = frozenset({"UV_CACHE_DIR", "UV_NO_CACHE", "UV_LINK_MODE", "UV_CONCURRENT_DOWNLOADS",
                      "UV_CONCURRENT_BUILDS", "UV_CONCURRENT_INSTALLS", "UV_HTTP_TIMEOUT", "UV_NATIVE_TLS",
                      "UV_NO_PROGRESS", "UV_OFFLINE"})


#: PyTorch's own index (PEP 503) of the CPU builds of torch, torchvision and torchaudio, what CPU machines install
#: them from: PyPI's Linux x86_64 torch is a CUDA build of several GB (with torchvision, 5.7 GB), whatever the machine.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: The distributions PyTorch's indexes hold builds of: an environment whose requirements name one gets the index.
TORCH_PACKAGES = frozenset({"torch", "torchvision", "torchaudio"})
#: The variable that names another index for them (``harness envs create --torch-index`` over it), or "none".
TORCH_INDEX_VARIABLE = "HARNESS_TORCH_INDEX"


class Untranslatable(ValueError):
    """A pip setting that uv cannot be told: pip installs instead."""


@dataclass(frozen=True)
class Installer:
    """What installs an environment's requirements: ``kind`` "uv" (at ``uv``, with ``options`` and ``env``
    translating pip's configuration) or "pip"; ``why``, in words, is the reason for the choice."""

    kind: str
    why: str
    uv: str | None = None
    version: str = ""
    options: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: which installer, and why."""
        if self.kind == "uv":
            return f"installing with {self.version or 'uv'} ({self.uv}): {self.why}"
        return f"installing with pip: {self.why}"

    def commands(self, python: Path, requirements: Path, packages: Sequence[str] = (),
                 extra_index: str | None = None) -> list[list[str]]:
        """The commands that make the virtual environment whose interpreter is ``python`` (``ENV/bin/python``)
        with the base interpreter of this process and install ``requirements`` (a file) then ``packages`` there,
        from the configured sources and ``extra_index`` (a PEP 503 index: ``--extra-index-url``, which pip and uv
        both take beside the configured ones, the best match over all of them). pip's environment starts with what
        ``python -m venv`` puts there (pip and setuptools from the interpreter's ensurepip); uv's with the same
        wheels, installed by uv (seconds faster)."""
        target = python.parent.parent
        extra = ["--extra-index-url", extra_index] if extra_index else []
        if self.kind != "uv" or self.uv is None:
            pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *extra]
            return [[sys.executable, "-m", "venv", str(target)], [*pip, "-r", str(requirements)],
                    *([[*pip, *packages]] if packages else [])]
        uv = [self.uv, "pip", "install", "--quiet", "--no-config", "--python", str(python)]
        seed = ensurepip_wheels()
        out = ([[sys.executable, "-m", "venv", "--without-pip", str(target)], [*uv, "--no-deps", "--offline", *seed]]
               if seed else [[sys.executable, "-m", "venv", str(target)]])
        return [*out, [*uv, *self.options, *extra, "-r", str(requirements)],
                *([[*uv, *self.options, *extra, *packages]] if packages else [])]

    def environment(self) -> dict[str, str]:
        """The environment its commands run in."""
        base = dict(os.environ)
        if self.kind == "uv":
            base = {k: v for k, v in base.items() if not k.startswith("UV_") or k in _UV_KEPT}
            base.update(self.env)
        return base


def ensurepip_wheels() -> list[str]:
    """The pip and setuptools wheels this interpreter's ``python -m venv`` installs (ensurepip's bundled ones);
    [] where it has none (a distribution's Python that takes them from elsewhere)."""
    import ensurepip

    bundled = Path(ensurepip.__file__).parent / "_bundled"
    wheels = sorted(str(p) for p in bundled.glob("*.whl")) if bundled.is_dir() else []
    return wheels if any(Path(w).name.startswith("pip-") for w in wheels) else []


def find_uv() -> str | None:
    """uv beside the running interpreter (``.venv/bin/uv`` when the harness runs as ``.venv/bin/python`` without
    the environment activated: the development environment's pinned release), else on PATH; None where neither."""
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("uv")


def pip_settings(python: str | None = None) -> dict[str, str]:
    """pip's configuration as ``pip install`` would apply it (``python -m pip config list``, default: this
    interpreter's pip): the ``global`` section, overridden by the ``install`` section, overridden by PIP_*
    variables. Raises OSError or subprocess.SubprocessError when pip cannot tell."""
    proc = subprocess.run([python or sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, check=True)
    return parse_pip_config(proc.stdout)


def parse_pip_config(listing: str) -> dict[str, str]:
    """``pip config list``'s lines (``section.key='value'``) as one setting per key, in pip's order of precedence
    (global < install < environment); other commands' sections do not apply to ``pip install``."""
    rank = {"global": 0, "install": 1, ":env:": 2}
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.strip().rpartition(".")
        if not sep or not dot or section not in rank:
            continue
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        if key not in found or rank[section] >= found[key][0]:
            found[key] = (rank[section], str(value))
    return {key: value for key, (_, value) in found.items()}


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on", "y", "t")


def uv_options(settings: Mapping[str, str]) -> tuple[list[str], dict[str, str], list[str]]:
    """uv's options and environment variables that tell uv what ``settings`` (``pip_settings``) tell pip, and the
    settings in words, for people. Raises Untranslatable naming a setting that uv cannot be told."""
    options = ["--index-strategy", "unsafe-best-match"]  # pip takes the best match over every source
    env: dict[str, str] = {}
    said: list[str] = []
    compile_bytecode = True
    for key, value in sorted(settings.items()):
        if key in _HARMLESS:
            continue
        if key in _REPEATED:
            values = value.split()
            for item in values:
                options += [_REPEATED[key], item]
            said.append(f"{key} {' '.join(values)}")
        elif key in _SINGLE:
            options += [_SINGLE[key], value.strip()]
            said.append(f"{key} {value.strip()}")
        elif key in _FLAGS:
            if _truthy(value):
                options += list(_FLAGS[key])
                said.append(key)
        elif key in _ENVIRONMENT:
            for variable in _ENVIRONMENT[key]:
                env[variable] = value.strip()
        elif key in ("no-compile", "compile"):
            compile_bytecode = _truthy(value) == (key == "compile")
        elif key == "upgrade-strategy" and value.strip() == "only-if-needed":
            continue  # pip's default, and uv's
        else:
            raise Untranslatable(f"pip's configuration sets {key} = {value!r}, which uv cannot be told")
    if compile_bytecode:
        options.append("--compile-bytecode")
    return options, env, said


def choose(preference: str | None = None, python: str | None = None) -> Installer:
    """The installer for ``harness envs create``: uv (``find_uv``) told pip's configuration (``pip_settings`` of
    ``python``, default this interpreter), else pip, with the reason. ``preference`` "pip" or "uv" asks for one;
    None (or "auto") takes uv where it can reproduce pip's sources. Raises ValueError when "uv" is asked for and
    cannot be used."""
    if preference == "pip":
        return Installer("pip", "asked for")
    uv = find_uv()
    problem = None
    if uv is None:
        problem = "uv is not installed (pip install uv, or make install, which puts it in .venv)"
    else:
        try:
            version = " ".join(subprocess.run([uv, "--version"], capture_output=True, text=True, timeout=60,
                                              stdin=subprocess.DEVNULL, check=True).stdout.split()[:2])
            options, env, said = uv_options(pip_settings(python))
        except Untranslatable as err:
            problem = str(err)
        except (OSError, subprocess.SubprocessError) as err:
            problem = f"cannot read pip's configuration or uv's version ({type(err).__name__})"
    if problem is not None:
        if preference == "uv":
            raise ValueError(f"cannot install with uv: {problem}")
        return Installer("pip", problem)
    where = f"pip's sources ({'; '.join(said)})" if said else "pip's sources (PyPI alone)"
    return Installer("uv", where, uv=uv, version=version, options=tuple(options), env=env)


# ------------------------------------------------------------------------------------- PyTorch's CPU index


def requirement_names(requirements: Path, packages: Sequence[str] = ()) -> set[str]:
    """The distributions (normalized names) that a requirements file, with the files it includes (``-r``), and
    ``packages`` (requirement strings or wheel files) name."""
    names: set[str] = set()
    seen: set[Path] = set()

    def name_of(line: str) -> str:
        base = Path(line).name
        raw = base.split("-")[0] if base.endswith(".whl") else re.split(r"[<>=!~\[;@ ]", line, maxsplit=1)[0]
        return re.sub(r"[-_.]+", "-", raw).lower()

    def read(path: Path) -> None:
        if path in seen or not path.is_file():
            return
        seen.add(path)
        for raw in path.read_text(encoding="utf-8").splitlines():
            line = raw.split(" #", 1)[0].strip()
            if line.startswith(("-r ", "--requirement ")):
                read(path.parent / line.split(None, 1)[1].strip())
            elif line and not line.startswith(("#", "-")):
                names.add(name_of(line))

    read(requirements)
    names.update(name_of(p.strip()) for p in packages if p.strip())
    return names


def uses_torch(requirements: Path, packages: Sequence[str] = ()) -> bool:
    """Whether an environment of ``requirements`` and ``packages`` installs torch, torchvision or torchaudio."""
    return not TORCH_PACKAGES.isdisjoint(requirement_names(requirements, packages))


def unreachable(url: str, timeout_s: float = 5.0) -> str | None:
    """Why the index at ``url`` cannot be reached, in words, or None when it answers: a file: URL's folder exists;
    an http(s) one answers a HEAD request for its torch page (``URL/torch/``, which pip and uv ask for; an index's
    root need not be listed) within ``timeout_s`` with a status below 400 (or 405, a server that takes GET alone)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        folder = Path(urllib.request.url2pathname(parsed.path))
        return None if folder.is_dir() else f"no folder {folder}"
    if parsed.scheme not in ("http", "https"):
        return f"not an http(s) or file URL: {url}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + "/torch/", method="HEAD"),
                                    timeout=timeout_s):
            return None
    except urllib.error.HTTPError as err:
        return None if err.code == 405 else f"it answers HTTP {err.code}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return f"{type(reason).__name__ if isinstance(reason, BaseException) else type(err).__name__}: {reason}"


def torch_index(choice: str | None = None, gpu: bool = False, timeout_s: float = 5.0) -> tuple[str | None, str]:
    """The index ``harness envs create`` adds for environments that install torch, torchvision or torchaudio
    (``uses_torch``), and one line saying which and why. ``choice`` (``--torch-index``), else the variable
    HARNESS_TORCH_INDEX, names one, or "none"; else, for CPU builds, PyTorch's CPU index ``TORCH_CPU_INDEX`` (for CUDA
    builds none: requirements/<framework>-gpu.txt take PyPI's). None, where "none" is named or the index does not
    answer (``unreachable``: offline), means the configured sources alone, the pins as they are."""
    named = choice if choice is not None else os.environ.get(TORCH_INDEX_VARIABLE) or None
    where = ("--torch-index" if choice is not None else TORCH_INDEX_VARIABLE) if named is not None else ""
    if named is None and gpu:
        return None, "torch from pip's sources (CUDA builds; --torch-index URL adds an index)"
    if named is not None and named.strip().lower() in ("none", ""):
        return None, f"torch from pip's sources alone, as pinned ({where} none)"
    url = named.strip() if named is not None else TORCH_CPU_INDEX
    said = f"{where} {url}" if named is not None else f"PyTorch's CPU index {url}"
    problem = unreachable(url, timeout_s)
    if problem is not None:
        return None, (f"{said} cannot be reached ({problem}); torch from pip's sources alone, as pinned (each "
                      "environment's line says which build it got)")
    other = "" if named is not None else f"; --torch-index URL|none (or {TORCH_INDEX_VARIABLE}) names another or none"
    return url, f"torch, torchvision and torchaudio from {said} too, the best match with pip's sources{other}"


# ------------------------------------------------------------------------------------------------ running them

_RUNNING: set[subprocess.Popen[str]] = set()
_LOCK = threading.Lock()


def run(command: Sequence[str], env: Mapping[str, str]) -> str:
    """Runs one install command, its output (standard output and error together) kept; returns that output.
    Raises subprocess.CalledProcessError (with the output) when it fails. ``stop_all`` ends the commands running
    in other threads."""
    proc = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(env))
    with _LOCK:
        _RUNNING.add(proc)
    try:
        output, _ = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        with _LOCK:
            _RUNNING.discard(proc)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, list(command), output=output)
    return output


def stop_all() -> None:
    """Ends every install command still running (an interrupted ``harness envs create`` whose environments are made
    in threads: each thread then removes its half-made environment)."""
    with _LOCK:
        running = list(_RUNNING)
    for proc in running:
        if proc.poll() is None:
            proc.terminate()


def last_words(output: str | None) -> str:
    """The line of a failed install's output that says why (its last error line, else its last line), shortened."""
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith(("error", "×", "╰─▶", "caused by"))]
    picked = errors[-1] if errors else (lines[-1] if lines else "")
    return picked.lstrip("×╰─▶ ")[:300]


def install(python: str, arguments: Sequence[str], installer: Installer | None = None) -> int:
    """``pip install ARGUMENTS`` into the environment of ``python``, by ``installer`` (default ``choose()``): uv
    with pip's sources where it can, else that environment's pip. Returns the exit status; the output is shown."""
    chosen = installer or choose(python=python)
    if chosen.kind == "uv" and chosen.uv is not None:
        command = [chosen.uv, "pip", "install", "--quiet", "--no-config", "--python", python, *chosen.options,
                   *arguments]
    else:
        command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *arguments]
    print(f"harness.execution.installers: {chosen.describe()}", file=sys.stderr)
    return subprocess.run(command, env=chosen.environment(), check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.execution.installers [--pip] PIP-INSTALL-ARGUMENTS...``: installs into this interpreter's
    environment as ``harness envs create`` installs into a framework's (the Makefile's development environment):
    with uv where it is found and can be told pip's sources, else with pip; ``--pip`` asks for pip. A requirements
    file (``-r``) that names torch, torchvision or torchaudio takes them from PyTorch's CPU index too where it
    answers (``torch_index``: the CPU builds the development environment holds; HARNESS_TORCH_INDEX names another,
    or none)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    preference = "pip" if arguments[:1] == ["--pip"] else None
    arguments = arguments[1:] if preference else arguments
    files = [Path(arguments[i + 1]) for i, word in enumerate(arguments[:-1]) if word in ("-r", "--requirement")]
    if any(uses_torch(path) for path in files):
        index, said = torch_index()
        print(f"harness.execution.installers: {said}", file=sys.stderr)
        arguments = [*arguments, "--extra-index-url", index] if index else arguments
    return install(sys.executable, arguments, choose(preference))


if __name__ == "__main__":
    sys.exit(main())
