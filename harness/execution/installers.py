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

Only the standard library: nothing here needs the harness's dependencies.
"""

from __future__ import annotations

import ast
import os
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

    def commands(self, python: Path, requirements: Path, packages: Sequence[str] = ()) -> list[list[str]]:
        """The commands that make the virtual environment whose interpreter is ``python`` (``ENV/bin/python``)
        with the base interpreter of this process and install ``requirements`` (a file) then ``packages`` there.
        pip's environment starts with what ``python -m venv`` puts there (pip and setuptools from the interpreter's
        ensurepip); uv's with the same wheels, installed by uv (seconds faster)."""
        target = python.parent.parent
        if self.kind != "uv" or self.uv is None:
            pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
            return [[sys.executable, "-m", "venv", str(target)], [*pip, "-r", str(requirements)],
                    *([[*pip, *packages]] if packages else [])]
        uv = [self.uv, "pip", "install", "--quiet", "--no-config", "--python", str(python)]
        seed = ensurepip_wheels()
        out = ([[sys.executable, "-m", "venv", "--without-pip", str(target)], [*uv, "--no-deps", "--offline", *seed]]
               if seed else [[sys.executable, "-m", "venv", str(target)]])
        return [*out, [*uv, *self.options, "-r", str(requirements)],
                *([[*uv, *self.options, *packages]] if packages else [])]

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
    with uv where it is found and can be told pip's sources, else with pip; ``--pip`` asks for pip."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    preference = "pip" if arguments[:1] == ["--pip"] else None
    return install(sys.executable, arguments[1:] if preference else arguments, choose(preference))


if __name__ == "__main__":
    sys.exit(main())
