"""CIFAR-10 fetched on first use (``harness.neutral.download``): from a local HTTP server on 127.0.0.1 serving a small
archive in the CIFAR-10 python layout, made here; resumed transfers, a server that ignores Range, a wrong checksum,
offline refusal, an unreachable server, and the commands that call it. Nothing reaches outside this machine."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import pickle
import re
import socket
import subprocess
import sys
import tarfile
import threading

import numpy as np
import pytest

from harness.cli import main
from harness.cli.common import load_spec
from harness.neutral import datasets, download
from harness.neutral.datasets import DatasetError
from harness.spec import Cifar10Data, SpecError
from tests.helpers import ROOT, TINY_CNN, base_spec


def small_archive(n_per_batch=3):
    """bytes of a tar.gz in the layout of cifar-10-python.tar.gz (pickled batches of generated images)."""
    rng = np.random.default_rng(7)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            blob = pickle.dumps({b"data": rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8),
                                 b"labels": rng.integers(0, 10, size=n_per_batch).tolist()})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return buffer.getvalue()


ARCHIVE = small_archive()
MD5 = hashlib.md5(ARCHIVE).hexdigest()


class Handler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.payload`` at any path; honours ``Range: bytes=N-`` unless ``server.honour_range`` is False;
    cuts the body in half, then closes, while ``server.truncate`` > 0; answers 404 for paths under /missing."""

    def do_GET(self):
        server = self.server
        server.requests.append(self.headers.get("Range"))
        if self.path.startswith("/missing"):
            self.send_error(404)
            return
        data, start = server.payload, 0
        asked = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if asked and server.honour_range:
            start = int(asked.group(1))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if server.truncate > 0:
            server.truncate -= 1
            body = body[: len(body) // 2]
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.payload, httpd.honour_range, httpd.truncate, httpd.requests = ARCHIVE, True, 0, []
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/cifar-10-python.tar.gz"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def closed_port_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/cifar-10-python.tar.gz"  # nothing listens there now


@pytest.fixture(autouse=True)
def no_environment(monkeypatch):
    for name in ("HARNESS_OFFLINE", "HARNESS_CIFAR10_URL", "HARNESS_DATA"):
        monkeypatch.delenv(name, raising=False)


def cifar(tmp_path):
    return Cifar10Data(name="cifar10", cache_dir=tmp_path / "cache")


def test_a_missing_archive_is_downloaded_once_verified_and_readable(server, tmp_path):
    lines = []
    path = download.fetch_cifar10(cifar(tmp_path), md5=MD5, url=server.url, log=lines.append, progress=False)
    assert path == tmp_path / "cache" / "cifar-10-python.tar.gz" and path.read_bytes() == ARCHIVE
    assert not path.with_name(path.name + ".part").exists()
    assert lines[0] == f"downloading CIFAR-10 from {server.url} to {path} (once; later runs use that file)"
    assert re.fullmatch(rf"downloaded {len(ARCHIVE) / 1e6:.1f} MB in [0-9.]+ s; md5 verified: {re.escape(str(path))}",
                        lines[-1])
    data = datasets.load_cifar10_archive(path, expected_md5=MD5)
    assert data.x_train.shape == (15, 32, 32, 3) and data.x_test.shape == (3, 32, 32, 3)
    assert download.fetch_cifar10(cifar(tmp_path), md5=MD5, url=server.url, log=lines.append) == path
    assert server.requests == [None] and len(lines) == 2  # the second call found the file


def test_a_cut_transfer_keeps_the_part_file_and_the_next_call_resumes_it(server, tmp_path):
    dest = tmp_path / "cache" / "cifar-10-python.tar.gz"
    part = dest.with_name(dest.name + ".part")
    server.truncate = 1
    with pytest.raises(DatasetError) as info:
        download.download(server.url, dest, MD5, attempts=1, log=lambda line: None, progress=False)
    message = str(info.value)
    assert f"the connection closed after {len(ARCHIVE) // 2} of {len(ARCHIVE)} bytes" in message
    assert f"the partial file {part} is kept: run again to resume" in message and "\n" not in message
    assert part.read_bytes() == ARCHIVE[: len(ARCHIVE) // 2] and not dest.exists()
    assert download.download(server.url, dest, MD5, log=lambda line: None, progress=False) == dest
    assert server.requests == [None, f"bytes={len(ARCHIVE) // 2}-"]
    assert dest.read_bytes() == ARCHIVE and not part.exists()


def test_one_call_resumes_by_itself_within_its_attempts(server, tmp_path):
    dest = tmp_path / "c" / "a.tar.gz"
    server.truncate = 2
    download.download(server.url, dest, MD5, attempts=3, log=lambda line: None, progress=True)  # rich's bar too
    half = len(ARCHIVE) // 2
    assert server.requests == [None, f"bytes={half}-", f"bytes={half + (len(ARCHIVE) - half) // 2}-"]
    assert dest.read_bytes() == ARCHIVE


def test_a_server_that_ignores_range_restarts_the_file(server, tmp_path):
    dest = tmp_path / "c" / "a.tar.gz"
    dest.parent.mkdir()
    dest.with_name(dest.name + ".part").write_bytes(b"left over from another file" * 10)
    server.honour_range = False
    download.download(server.url, dest, MD5, log=lambda line: None, progress=False)
    assert server.requests == ["bytes=270-"]  # asked for the rest, got the whole file, wrote it from byte 0
    assert dest.read_bytes() == ARCHIVE


def test_a_complete_part_file_is_verified_without_a_transfer(server, tmp_path):
    dest = tmp_path / "c" / "a.tar.gz"
    dest.parent.mkdir()
    dest.with_name(dest.name + ".part").write_bytes(ARCHIVE)  # e.g. stopped before the rename
    download.download(server.url, dest, MD5, log=lambda line: None, progress=False)
    assert server.requests == [f"bytes={len(ARCHIVE)}-"] and dest.read_bytes() == ARCHIVE  # 416: nothing after it


def test_a_wrong_checksum_removes_the_file_with_one_line(server, tmp_path):
    server.payload = ARCHIVE[:-1] + bytes([ARCHIVE[-1] ^ 0xFF])  # damaged in transit, or another file
    with pytest.raises(DatasetError) as info:
        download.fetch_cifar10(cifar(tmp_path), md5=MD5, url=server.url, log=lambda line: None, progress=False)
    message = str(info.value)
    actual = hashlib.md5(server.payload).hexdigest()
    assert message == (f"the download of {server.url} has md5 {actual}, not the expected {MD5}; removed it (run "
                       "again to download afresh, or check the address)")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["cifar-10-python.tar.gz.lock"]
    # CIFAR-10's own checksum is the default: the generated archive is not CIFAR-10
    server.payload = ARCHIVE
    with pytest.raises(DatasetError, match=f"has md5 {MD5}, not the expected {datasets.CIFAR10_MD5}"):
        download.fetch_cifar10(cifar(tmp_path), url=server.url, log=lambda line: None, progress=False)


@pytest.mark.parametrize("how", ["flag", "1", "true", "YES"])
def test_offline_refuses_with_the_message_that_says_where_to_put_the_file(server, tmp_path, monkeypatch, how):
    if how != "flag":
        monkeypatch.setenv("HARNESS_OFFLINE", how)
    with pytest.raises(DatasetError) as info:
        download.fetch_cifar10(cifar(tmp_path), offline=how == "flag", md5=MD5, url=server.url)
    dest = tmp_path / "cache" / "cifar-10-python.tar.gz"
    assert str(info.value) == datasets.missing_cifar10_message(dest)
    assert str(info.value).startswith(f"no CIFAR-10 archive at {dest}; download {datasets.CIFAR10_URL} and put it "
                                      "there (or set dataset.path)") and "never downloads" in str(info.value)
    assert server.requests == [] and not (tmp_path / "cache").exists()


def test_offline_is_off_for_other_values(monkeypatch):
    for value in ("", "0", "no", "false"):
        monkeypatch.setenv("HARNESS_OFFLINE", value)
        assert not download.offline_requested()
    assert download.offline_requested(True)


def test_an_unreachable_server_is_one_line_saying_where_to_put_the_file(closed_port_url, server, tmp_path):
    dest = tmp_path / "cache" / "cifar-10-python.tar.gz"
    with pytest.raises(DatasetError) as info:
        download.fetch_cifar10(cifar(tmp_path), md5=MD5, url=closed_port_url, log=lambda line: None)
    message = str(info.value)
    assert message.startswith(f"no CIFAR-10 archive at {dest} and cannot reach {closed_port_url} (")
    assert message.endswith(f"; download {datasets.CIFAR10_URL} yourself and put it there (or set dataset.path)")
    assert "refused" in message.lower() and "\n" not in message and info.value.field == "path"
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()
    missing = server.url.replace("/cifar-10-python", "/missing/cifar-10-python")
    with pytest.raises(DatasetError, match=rf"and {re.escape(missing)} answered HTTP 404 "):
        download.fetch_cifar10(cifar(tmp_path), md5=MD5, url=missing, log=lambda line: None)


def test_the_address_can_be_replaced_and_an_explicit_path_is_never_downloaded(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CIFAR10_URL", server.url)
    assert download.cifar10_url() == server.url
    path = download.fetch_cifar10(cifar(tmp_path), md5=MD5, log=lambda line: None)
    assert path.read_bytes() == ARCHIVE and server.requests == [None]
    explicit = Cifar10Data(name="cifar10", path=tmp_path / "mine.tar.gz")
    with pytest.raises(DatasetError, match=r"mine\.tar\.gz \(dataset\.path, which is never downloaded\)"):
        download.fetch_cifar10(explicit, md5=MD5)
    assert download.fetch_dataset(explicit) is None and server.requests == [None]  # nothing to fetch


def test_the_commands_download_before_the_plan_checks(server, write_spec, tmp_path, monkeypatch, capsys):
    """``harness run`` in-process: the archive is fetched into $HARNESS_DATA before the spec's other checks (here a
    model that does not fit the 10 classes stops the run with exit 2 afterwards, before any trial)."""
    monkeypatch.setenv("HARNESS_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("HARNESS_CIFAR10_URL", server.url)
    monkeypatch.setattr(datasets, "CIFAR10_MD5", MD5)  # the small archive stands for CIFAR-10
    layers = TINY_CNN[:-1] + [{"type": "dense", "units": 7}]
    bad = write_spec(base_spec(dataset={"name": "cifar10"}, model={"layers": layers}), name="bad.yaml")
    assert main(["run", str(bad), "--out", str(tmp_path / "results"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    archive = tmp_path / "data" / "cifar-10-python.tar.gz"
    assert f"downloading CIFAR-10 from {server.url} to {archive}" in err
    assert err.strip().splitlines()[-1].startswith(f"{bad}: model.layers.3: ")
    assert archive.read_bytes() == ARCHIVE and not (tmp_path / "results").exists()
    good = write_spec(base_spec(dataset={"name": "cifar10"}), name="good.yaml")
    assert load_spec(good).dataset.name == "cifar10" and server.requests == [None]  # found in the cache now


def test_the_commands_refuse_offline_and_unreachable_with_exit_2(write_spec, tmp_path, closed_port_url, monkeypatch,
                                                                  capsys):
    monkeypatch.setenv("HARNESS_DATA", str(tmp_path / "data"))
    spec = write_spec(base_spec(dataset={"name": "cifar10"}))
    archive = tmp_path / "data" / "cifar-10-python.tar.gz"
    for argv in (["run", str(spec), "--offline"], ["max-batch", str(spec), "--framework", "pytorch", "--offline"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"{spec}: dataset.path: {datasets.missing_cifar10_message(archive)}\n"
    with pytest.raises(SpecError, match="never downloads"):
        load_spec(spec, offline=True)
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "HARNESS_DATA": str(tmp_path / "data")}
    for extra in ({"HARNESS_OFFLINE": "1"}, {"HARNESS_CIFAR10_URL": closed_port_url}):
        proc = subprocess.run([sys.executable, "-m", "harness", "run", str(spec), "--out", str(tmp_path / "r")],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**env, **extra})
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if not line.startswith("downloading CIFAR-10 from")]
        assert len(lines) == 1 and lines[0].startswith(f"{spec}: dataset.path: no CIFAR-10 archive at {archive}")
        assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()
    assert "cannot reach" in lines[0] and "refused" in lines[0].lower()
