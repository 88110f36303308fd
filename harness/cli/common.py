"""What several commands share: argument types, the exit statuses and the terminal summary of a run."""

from __future__ import annotations

import os
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
    """The spec of a command that runs trials, with its data ready before the first one: ``harness.spec.load``
    (read, override, field rules), then ``harness.studies.prepare.ready``. Raises SpecError (one line; the CLI exits
    2)."""
    from harness import spec as spec_module
    from harness.studies.prepare import ready

    return ready(spec_module.load(path, overrides), path, offline=offline, progress=progress)


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
