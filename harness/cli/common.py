"""What several commands share: argument types, the exit statuses and the terminal summary of a run."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.results.tables import ReportData
    from harness.spec import Spec

EXIT_USAGE = 2
EXIT_NOTHING_RAN = 3

OFFLINE_HELP = ("never download a dataset (also HARNESS_OFFLINE=1): a CIFAR-10 archive missing from the cache is then "
                "an error saying where to put it")


def load_spec(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None, offline: bool = False,
              progress: bool | None = None) -> Spec:
    """The spec of a command that runs trials, with its data ready before the first one.

    ``harness.spec.load`` (read, override, field rules); then, in this process and once, what the dataset needs
    from the network (``harness.neutral.download.fetch_dataset``: CIFAR-10 downloaded into the cache when it is
    missing there, unless ``offline`` or ``HARNESS_OFFLINE=1``); ``harness.plan.check``; then an image folder decoded
    into its cache (``harness.neutral.image_folder.prepare``), so that the workers only read arrays. Progress lines
    go to standard error; ``progress``: the download's bar (default: when standard error is a terminal). Raises
    SpecError (one line; the CLI exits 2), a dataset failure as ``FILE: dataset.FIELD: what is wrong``."""
    from harness import plan
    from harness import spec as spec_module
    from harness.neutral import download, image_folder
    from harness.neutral.datasets import DatasetError
    from harness.spec import ImageFolderData, SpecError

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    spec = spec_module.load(path, overrides)
    try:
        download.fetch_dataset(spec.dataset, offline=offline, log=log, progress=progress)
        if isinstance(spec.dataset, ImageFolderData) and spec.dataset.generate and not spec.dataset.path.exists():
            made = spec.dataset.generate
            log(f"writing {made.classes} x {made.per_class} generated images to {spec.dataset.path} (dataset.generate)")
            image_folder.make_image_folder(spec.dataset.path, made.classes, made.per_class, made.size, made.seed)
        plan.check(spec, path)
        if isinstance(spec.dataset, ImageFolderData):
            prepared = image_folder.prepare(spec.dataset, log=log)
            if prepared.decoded:
                log(f"decoded {prepared.train} training and {prepared.test} test images in {prepared.seconds:.1f} s")
            if prepared.skipped:
                shown = ", ".join(prepared.skipped[:3]) + (", ..." if len(prepared.skipped) > 3 else "")
                log(f"{path}: dataset.on_bad_file: skipped {len(prepared.skipped)} unreadable file(s) of "
                    f"{spec.dataset.path}: {shown}")
    except DatasetError as err:
        raise SpecError(path, f"dataset.{err.field or 'path'}", str(err)) from None
    return spec


def int_list(text: str) -> list[int | str]:
    """``8,64,512`` -> [8, 64, 512]; values are validated by the spec (so errors name the spec file and field), here
    they are only split."""
    out: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        out.append(int(part) if part.lstrip("-").isdigit() else part)
    return out


def str_list(text: str) -> list[str]:
    """``pytorch, mxnet`` -> ["pytorch", "mxnet"]."""
    return [part.strip() for part in text.split(",") if part.strip()]


def summary_console() -> Any:
    """A rich console for the summary tables; piped output gets 120 columns instead of rich's 80."""
    from rich.console import Console

    console = Console()
    # Piped output (CI logs, `| tee`) gets rich's 80-column default, which truncates the headers: widen it.
    return console if console.is_terminal else Console(width=120)


def print_summary(data: ReportData, console: Any) -> None:
    """The run's summary table (``harness.results.tables.summary_rows``) on ``console``."""
    from rich.table import Table

    from harness.results.tables import summary_rows

    util = "GPU use %" if data.backend == "nvml" else "CPU use %"
    memory = "GPU mem MB" if data.backend == "nvml" else "RSS MB"
    table = Table(title=f"{data.run.name} on {data.run.device}")
    for title in ("framework", "batch", "status", "samples/s", "s/epoch", util, memory, "accuracy %"):
        table.add_column(title, justify="left" if title in ("framework", "status") else "right")
    for row in summary_rows(data):
        table.add_row(*row)
    console.print(table)
