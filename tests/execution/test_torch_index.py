"""PyTorch's CPU index (issue 59): ``harness envs create`` adds it, where it answers, to the sources of an environment
that installs torch, torchvision or torchaudio, so that a CPU machine gets torch's CPU build (2.13.0+cpu) rather than
PyPI's CUDA build of the same pin; ``--torch-index URL|none`` (or HARNESS_TORCH_INDEX) names another or none, and an
index that does not answer leaves the pins as they are, in one line. Each environment's line says which build it
got, read from its files, and its size.

The indexes here are made by the tests from tiny wheels: "PyPI" (a file: index, as pip's configured index) holds a
``torch`` 2.13.0 whose torch/version.py names CUDA, as PyPI's Linux x86_64 wheel does; the "torch index" (served over
HTTP on 127.0.0.1 by the test) holds ``torch`` 2.13.0+cpu; a configured extra index holds the dependency both need.
Nothing large is installed, and uv's cache is the test's own."""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import os
import re
import socket
import threading
import time
import zipfile
from pathlib import Path

import pytest

from harness.execution import environments, installers


def _wheel(folder: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of ``files`` (path in the wheel: text), made here."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" +
             "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip('=')}"
              f",{len(text.encode())}" for path, text in files.items()]
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
        zf.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def _fake_torch(folder: Path, version: str, cuda: str | None) -> Path:
    """A tiny ``torch`` whose torch/version.py says what a real one's does (``cuda = None`` in a CPU build)."""
    return _wheel(folder, "torch", version, {
        "torch/__init__.py": f"__version__ = {version!r}\n",
        "torch/version.py": f"from typing import Optional\n__version__ = {version!r}\n"
                            f"cuda: Optional[str] = {cuda!r}\n"},
        requires=("harnessdep>=1",))


def _index(root: Path, wheels: list[Path], relative: bool = False) -> Path:
    """A PEP 503 index at ``root`` of ``wheels`` (links relative to it where ``relative``: served over HTTP)."""
    for wheel in wheels:
        project = root / wheel.name.split("-")[0]
        project.mkdir(parents=True, exist_ok=True)
        href = f"../../files/{wheel.name}" if relative else wheel.as_uri()
        with (project / "index.html").open("a") as page:
            page.write(f'<a href="{href}">{wheel.name}</a>\n')
    return root


@pytest.fixture
def torch_index(tmp_path):
    """The torch index, served over HTTP on 127.0.0.1: (its URL, the paths asked for)."""
    served = tmp_path / "served"
    _index(served / "simple", [_fake_torch(served / "files", "2.13.0+cpu", None)], relative=True)
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # quiet; what was asked is kept instead
            asked.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def pips_sources(tmp_path, monkeypatch):
    """pip configured with "PyPI" (torch 2.13.0, a CUDA build) and an extra index (harnessdep), nothing else; a
    requirements file ``tiny-cpu.txt`` pinning torch as requirements/pytorch-cpu.txt does."""
    files = tmp_path / "files"
    pypi = _index(tmp_path / "pypi", [_fake_torch(files / "pypi", "2.13.0", "13.0")])
    extra = _index(tmp_path / "extra", [_wheel(files / "extra", "harnessdep", "1.0", {"harnessdep.py": ""})])
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "tiny-cpu.txt").write_text("# as requirements/pytorch-cpu.txt\ntorch==2.13.0\n")
    for variable in [v for v in os.environ if v.startswith("PIP_")] + [installers.TORCH_INDEX_VARIABLE]:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", pypi.as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", extra.as_uri())
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")  # pip's cache keeps no fake torch
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setattr(environments, "ROOT", tmp_path)
    return tmp_path


def _versions(python: Path) -> dict[str, str]:
    site = environments.site_packages(python)
    assert site is not None
    return {info.name.split("-")[0].lower(): info.name.removesuffix(".dist-info").split("-")[1]
            for info in site.glob("*.dist-info")}


def _installers():
    return ["pip", *(["uv"] if installers.find_uv() else [])]


@pytest.mark.parametrize("kind", _installers())
def test_a_pytorch_environment_takes_torchs_cpu_build_from_the_torch_index(kind, pips_sources, torch_index,
                                                                           monkeypatch, capsys):
    """By default (PyTorch's CPU index, here the test's, which answers) the index is added beside pip's sources:
    torch==2.13.0 resolves to 2.13.0+cpu from it, not to "PyPI"'s CUDA build, and its dependency still comes from
    pip's configured extra index. The lines say which index and which build, and the size."""
    from harness.cli import main

    url, asked = torch_index
    monkeypatch.setattr(installers, "TORCH_CPU_INDEX", url)
    envs_dir = pips_sources / "envs"
    status = main(["envs", "create", "tiny", "--cpu", "--dir", str(envs_dir), "--installer", kind])
    err = capsys.readouterr().err
    assert status == 0, err
    python = envs_dir / "tiny" / "bin" / "python"
    assert _versions(python)["torch"] == "2.13.0+cpu" and _versions(python)["harnessdep"] == "1.0"
    assert "/simple/torch/" in asked and any(p.endswith(".whl") for p in asked)
    lines = err.splitlines()
    assert lines[0] == "harness envs create: requirements/<framework>-cpu.txt, written for CPU builds: --cpu given"
    assert f"harness envs create: torch, torchvision and torchaudio from PyTorch's CPU index {url} too" in err
    (made,) = [line for line in lines if line.startswith("tiny: ")]
    assert re.fullmatch(rf"tiny: {re.escape(str(python))} \(created, \d+ s; torch 2\.13\.0\+cpu CPU build; \d+ MB\)",
                        made), made
    assert f"torch from {url} too" in (envs_dir / "tiny" / ".harness-stamp").read_text()
    assert installers.unreachable(url.replace("/simple", "/elsewhere")) == "it answers HTTP 404"


def test_an_index_that_does_not_answer_leaves_the_pins_as_they_are_in_one_line(pips_sources, capsys):
    """--torch-index naming a port nobody listens on: one line says so, and the environment is made from pip's
    sources as today; its line says it got the CUDA build."""
    from harness.cli import main

    with socket.socket() as sock:  # a free port, closed again: nothing answers there
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/simple"
    envs_dir = pips_sources / "envs"
    kind = _installers()[-1]  # uv where there is one: the quicker
    started = time.monotonic()
    status = main(["envs", "create", "tiny", "--cpu", "--dir", str(envs_dir), "--installer", kind,
                   "--torch-index", closed])
    err = capsys.readouterr().err
    assert status == 0, err
    (said,) = [line for line in err.splitlines() if "torch" in line and line.startswith("harness envs create: ")]
    assert said.startswith(f"harness envs create: --torch-index {closed} cannot be reached (") and \
        "torch from pip's sources alone, as pinned" in said
    python = envs_dir / "tiny" / "bin" / "python"
    assert _versions(python)["torch"] == "2.13.0"
    assert "torch 2.13.0 CUDA 13.0 build;" in err
    assert "torch from" not in (envs_dir / "tiny" / ".harness-stamp").read_text()
    assert time.monotonic() - started < 60


def test_the_index_is_named_by_the_option_the_variable_or_the_default_and_none_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.delenv(installers.TORCH_INDEX_VARIABLE, raising=False)
    asked = []
    monkeypatch.setattr(installers, "unreachable", lambda url, timeout_s=5.0: asked.append(url))
    assert installers.torch_index()[0] == installers.TORCH_CPU_INDEX == "https://download.pytorch.org/whl/cpu"
    assert installers.torch_index(gpu=True)[0] is None and asked == [installers.TORCH_CPU_INDEX]  # not even asked
    monkeypatch.setenv(installers.TORCH_INDEX_VARIABLE, "https://mirror.example/torch-cpu")
    assert installers.torch_index(gpu=True)[0] == "https://mirror.example/torch-cpu"  # named: for any build
    assert installers.torch_index("https://other.example/simple")[0] == "https://other.example/simple"
    url, said = installers.torch_index("none")
    assert url is None and said == "torch from pip's sources alone, as pinned (--torch-index none)"
    monkeypatch.setenv(installers.TORCH_INDEX_VARIABLE, "none")
    assert installers.torch_index() == (None, f"torch from pip's sources alone, as pinned "
                                              f"({installers.TORCH_INDEX_VARIABLE} none)")
    # which environments get it: those whose requirements (with the files they include) or packages name torch
    (tmp_path / "worker.txt").write_text("numpy>=2  # a comment\npydantic\n")
    (tmp_path / "a.txt").write_text("-r worker.txt\nTorch==2.13.0\n")
    (tmp_path / "b.txt").write_text("-r worker.txt\njax==0.10.2\n")
    assert installers.requirement_names(tmp_path / "a.txt") == {"numpy", "pydantic", "torch"}
    assert installers.uses_torch(tmp_path / "a.txt") and not installers.uses_torch(tmp_path / "b.txt")
    assert installers.uses_torch(tmp_path / "b.txt", ["torchvision==0.29.1"])
    assert not installers.uses_torch(tmp_path / "b.txt", ["torchmetrics", "/w/timm-1.0-py3-none-any.whl"])
    python, requirements = tmp_path / "e" / "bin" / "python", tmp_path / "a.txt"
    for chosen in (installers.Installer("pip", "x"), installers.Installer("uv", "x", uv="/bin/uv")):
        commands = chosen.commands(python, requirements, ["torchvision"], extra_index="https://i.example/cpu")
        installs = [c for c in commands if "-r" in c or "torchvision" in c]
        assert len(installs) == 2 and all(" ".join(c).count("--extra-index-url https://i.example/cpu") == 1
                                          for c in installs), commands
        assert "--extra-index-url" not in " ".join(str(w) for c in chosen.commands(python, requirements) for w in c)


def test_each_environment_says_which_builds_it_holds_and_its_size(tmp_path):
    """Read from the environment's files, nothing imported: torch's local version or its torch/version.py, JAX's
    CUDA plugin, TensorFlow's CPU package or NVIDIA's libraries, MXNet's CUDA package; the size counts a file with
    two links once."""

    def env(name, dists, files=None):
        site = tmp_path / name / "lib" / "python3.11" / "site-packages"
        site.mkdir(parents=True)
        for dist in dists:
            (site / f"{dist}.dist-info").mkdir()
        for path, text in (files or {}).items():
            (site / path).parent.mkdir(parents=True, exist_ok=True)
            (site / path).write_text(text)
        return tmp_path / name / "bin" / "python"

    version_py = "from typing import Optional\ncuda: Optional[str] = {}\n"
    cases = {
        env("a", ["torch-2.13.0+cpu"]): ["torch 2.13.0+cpu CPU build"],
        env("b", ["torch-2.14.1"], {"torch/version.py": version_py.format("'13.0'")}): ["torch 2.14.1 CUDA 13.0 build"],
        env("c", ["torch-2.14.1"], {"torch/version.py": version_py.format("None")}): ["torch 2.14.1 CPU build"],
        env("d", ["torch-2.7.0+cu128"]): ["torch 2.7.0+cu128 CUDA 12.8 build"],
        env("e", ["jax-0.10.2", "jaxlib-0.10.2", "jax_cuda12_plugin-0.10.2"]): ["jax 0.10.2 CUDA 12 build"],
        env("f", ["jax-0.10.2", "jaxlib-0.10.2", "tensorflow_cpu-2.21.0"]): ["jax 0.10.2 CPU build",
                                                                           "tensorflow-cpu 2.21.0 CPU build"],
        env("g", ["tensorflow-2.21.0", "nvidia_cublas_cu12-12.5"]): ["tensorflow 2.21.0 CUDA build"],
        env("h", ["mxnet_cu112-1.9.1"]): ["mxnet-cu112 1.9.1 CUDA 11.2 build"],
        env("i", ["mxnet-1.9.1"]): ["mxnet 1.9.1 CPU build"],
        env("j", ["six-1.16.0"]): [],
    }
    for python, expected in cases.items():
        assert environments.builds(python) == expected, python
    big = tmp_path / "a" / "big.bin"
    big.write_bytes(b"x" * 3_000_000)
    os.link(big, tmp_path / "a" / "again.bin")
    size = environments.disk_size(tmp_path / "a")
    assert 3_000_000 <= size < 3_200_000  # once, not twice
    assert environments.what_it_got(tmp_path / "a" / "bin" / "python") == "torch 2.13.0+cpu CPU build; 3 MB"
    assert environments.what_it_got(tmp_path / "j" / "bin" / "python").startswith("no framework build found; ")
    assert (environments.shown_size(850_000_000), environments.shown_size(5_712_000_000)) == ("850 MB", "5.7 GB")


def test_the_development_environments_requirements_take_the_index_too(tmp_path, monkeypatch, capsys):
    """``python -m harness.execution.installers -r requirements/cpu.txt`` (the Makefile's .venv, with CPU builds of
    torch for the in-process tests): the index is added where a requirements file names torch, and only there."""
    installed = []
    monkeypatch.setattr(installers, "install", lambda python, arguments, chosen=None: installed.append(arguments))
    monkeypatch.setattr(installers, "choose", lambda preference=None, python=None: installers.Installer("pip", "x"))
    monkeypatch.setattr(installers, "torch_index", lambda choice=None, gpu=False: ("https://i.example/cpu", "said"))
    (tmp_path / "cpu.txt").write_text("torch==2.13.0\n")
    installers.main(["-r", str(tmp_path / "cpu.txt")])
    installers.main(["--pip", "-e", ".[gpu]", "-c", str(tmp_path / "cpu.txt")])
    assert installed == [["-r", str(tmp_path / "cpu.txt"), "--extra-index-url", "https://i.example/cpu"],
                         ["-e", ".[gpu]", "-c", str(tmp_path / "cpu.txt")]]
    assert capsys.readouterr().err == "harness.execution.installers: said\n"
