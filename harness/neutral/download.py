"""Downloading a dataset file once, into the harness cache: CIFAR-10 on first use.

``harness run`` and ``harness max-batch`` call ``fetch_dataset`` in the orchestrating process after the spec is read
and before the plan's checks, so that a missing ``cifar-10-python.tar.gz`` is fetched once, never by a worker.
``download`` is the transfer: standard library only (``urllib.request``), one line saying what it downloads and
where, a progress bar on a terminal (rich; a line at the start and one at the end otherwise), resumable (the bytes go
to ``<file>.part``; a later call asks for the rest with ``Range: bytes=N-``, and starts again from zero when the
server answers the whole file instead), verified against the published md5 before the file takes its final name;
a file with another md5 is removed. Concurrent downloads of one file in several processes wait for each other (an
advisory lock on ``<file>.lock``, where ``fcntl`` exists).

Environment: ``HARNESS_CIFAR10_URL`` replaces the address (a mirror; the md5 stays CIFAR-10's, so a mirror must
serve the same file); ``HARNESS_OFFLINE=1`` (or ``--offline``) forbids the download: a missing archive is then the
plan-time error saying where to put the file. Every failure is a one-line DatasetError.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness.neutral import datasets
from harness.neutral.datasets import DatasetError
from harness.spec import Cifar10Data

URL_VARIABLE = "HARNESS_CIFAR10_URL"
OFFLINE_VARIABLE = "HARNESS_OFFLINE"
CHUNK_BYTES = 1 << 16


class UnreachableError(DatasetError):
    """No answer with the file: the server could not be reached (no network, a closed port, a timeout) or refused the
    request (an HTTP error status). The message names the address and the reason."""


class _Interrupted(Exception):
    """The transfer stopped part-way: what is in the .part file stays there for the next attempt."""


def offline_requested(flag: bool = False) -> bool:
    """True when ``flag`` (``--offline``) is set or ``$HARNESS_OFFLINE`` is 1, true, yes or on."""
    return flag or os.environ.get(OFFLINE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def cifar10_url() -> str:
    """The CIFAR-10 address: ``$HARNESS_CIFAR10_URL`` when set, else ``datasets.CIFAR10_URL``."""
    return os.environ.get(URL_VARIABLE) or datasets.CIFAR10_URL


def fetch_dataset(cfg: datasets.DatasetSpec, offline: bool = False, log: Callable[[str], None] | None = None,
                  progress: bool | None = None) -> Path | None:
    """What a dataset needs from the network before a run, done once: for CIFAR-10 without ``path``, the archive
    downloaded into the cache when missing (``fetch_cifar10``; ``log`` and ``progress`` as ``download``'s). Returns
    the file, or None for a dataset that needs nothing. Raises DatasetError."""
    if isinstance(cfg, Cifar10Data) and cfg.path is None:
        return fetch_cifar10(cfg, offline=offline, log=log, progress=progress)
    return None


def fetch_cifar10(cfg: Cifar10Data, offline: bool = False, md5: str | None = None, url: str | None = None,
                  log: Callable[[str], None] | None = None, progress: bool | None = None) -> Path:
    """The CIFAR-10 archive in the cache (``datasets.cifar10_cache_path``), downloaded there when missing.

    ``md5``: the expected checksum (default ``datasets.CIFAR10_MD5``); ``url``: default ``cifar10_url()``. An explicit
    ``cfg.path`` is never downloaded. Raises DatasetError: offline (``offline_requested(offline)``) with the archive
    missing (``datasets.missing_cifar10_message``), the server unreachable, or the download's md5 wrong."""
    if cfg.path is not None:
        return datasets.resolve_cifar10_path(cfg)
    dest = datasets.cifar10_cache_path(cfg)
    if dest.is_file():
        return dest
    if offline_requested(offline):
        raise DatasetError(datasets.missing_cifar10_message(dest), field="path")
    try:
        return download(url or cifar10_url(), dest, md5 or datasets.CIFAR10_MD5, what="CIFAR-10", log=log,
                        progress=progress)
    except UnreachableError as err:
        raise DatasetError(f"no CIFAR-10 archive at {dest} and {err}; download {datasets.CIFAR10_URL} yourself and "
                           "put it there (or set dataset.path)", field="path") from None


def download(url: str, dest: Path, md5: str, *, what: str = "", attempts: int = 3, timeout: float = 30.0,
             log: Callable[[str], None] | None = None, progress: bool | None = None) -> Path:
    """Downloads ``url`` to ``dest`` through ``<dest>.part`` and returns ``dest``.

    md5: the expected hex digest. attempts: transfers tried (each resuming the last) before giving up, >= 1.
    timeout: seconds to connect and between bytes. log: gets the line that says what is downloaded and where
    (default: standard error). progress: a bar (default: when standard error is a terminal). Raises
    UnreachableError when no connection or no answer with the file could be had; DatasetError when the transfer
    stopped ``attempts`` times (the .part file is kept for the next call), the file's md5 is not ``md5`` (the file is
    removed) or the folder cannot be written."""
    try:
        return _download(url, dest, md5, what, attempts, timeout, log, progress)
    except UnreachableError:
        raise
    except OSError as err:  # the cache folder: not writable, disk full
        raise DatasetError(f"cannot write {dest} ({err.strerror or err}); set dataset.cache_dir or HARNESS_DATA to a "
                           "writable folder with room for the file", field="cache_dir") from None


def _download(url: str, dest: Path, md5: str, what: str, attempts: int, timeout: float,
              log: Callable[[str], None] | None, progress: bool | None) -> Path:
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with _locked(dest.with_name(dest.name + ".lock")):
        if dest.is_file():  # another process finished it while this one waited
            return dest
        say(f"downloading {what + ' from ' if what else ''}{url} to {dest} (once; later runs use that file)")
        start = time.monotonic()
        with _Bar(progress, what or dest.name) as bar:
            for attempt in range(1, max(1, attempts) + 1):
                try:
                    _transfer(url, part, timeout, bar)
                    break
                except _Interrupted as err:
                    if attempt >= attempts:
                        raise DatasetError(f"downloading {url} stopped {attempts} time(s), last: {err}; the partial "
                                           f"file {part} is kept: run again to resume") from None
        actual = datasets.file_md5(part)
        if actual != md5:
            part.unlink(missing_ok=True)
            raise DatasetError(f"the download of {url} has md5 {actual}, not the expected {md5}; removed it (run "
                               "again to download afresh, or check the address)")
        os.replace(part, dest)
        size = dest.stat().st_size
        say(f"downloaded {size / 1e6:.1f} MB in {time.monotonic() - start:.1f} s; md5 verified: {dest}")
    return dest


def _transfer(url: str, part: Path, timeout: float, bar: _Bar) -> None:
    """One request: the rest of the file after what ``part`` holds (or all of it when the server ignores Range),
    appended to ``part``. Raises _Interrupted when the body stops short, UnreachableError when there is no answer."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "harness (python urllib)"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and offset:  # nothing after offset: the .part already holds the whole file; md5 decides
            return
        raise UnreachableError(f"{url} answered HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise UnreachableError(f"cannot reach {url} ({reason})") from None
    with response:
        total: int | None
        if offset and response.status == 206:
            start, total = _content_range(response.headers.get("Content-Range", ""))
            if start != offset:
                part.unlink()
                raise _Interrupted(f"the server resumed at byte {start}, not {offset}; starting again")
            mode = "ab"
        else:  # 200: the whole file (the server ignored the Range, or none was asked)
            offset, mode = 0, "wb"
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        bar.reset(offset, total)
        with open(part, mode) as f:
            while True:
                try:
                    chunk = response.read(CHUNK_BYTES)
                except (OSError, http.client.HTTPException) as err:
                    raise _Interrupted(f"{type(err).__name__} after {offset} bytes") from None
                if not chunk:
                    break
                f.write(chunk)
                offset += len(chunk)
                bar.update(offset)
    if total is not None and offset < total:
        raise _Interrupted(f"the connection closed after {offset} of {total} bytes")


def _content_range(header: str) -> tuple[int, int | None]:
    """``bytes START-END/TOTAL`` -> (START, TOTAL or None when ``*``). Raises _Interrupted for another form."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", header)
    if match is None:
        raise _Interrupted(f"an unreadable Content-Range {header!r}")
    return int(match.group(1)), None if match.group(3) == "*" else int(match.group(3))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created, never removed) while the block runs; none without fcntl."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _Bar:
    """Download progress: rich's bar on a terminal (``enabled`` None: when standard error is one), else nothing (the
    start and end lines of ``download`` say enough)."""

    def __init__(self, enabled: bool | None, label: str):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.label = label
        self.progress: Any = None
        self.task: Any = None

    def __enter__(self) -> _Bar:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=None)
        return self

    def reset(self, done: int, total: int | None) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=done, total=total)

    def update(self, done: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=done)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
