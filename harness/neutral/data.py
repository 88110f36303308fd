"""What every dataset reader shares (``harness.neutral.datasets``, ``harness.neutral.image_folder``): a loaded
dataset's arrays (``Data``), the error of a dataset that cannot be loaded (``DatasetError``) and the folder that caches
downloaded and decoded datasets (``cache_folder``). ``harness.neutral.datasets`` re-exports all three, the names the
rest of the harness and the adapters use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DatasetError(Exception):
    """A dataset that cannot be loaded (missing file, wrong checksum, unreadable image). ``str(err)`` is one line
    that says what to do; ``field`` names the dataset field it concerns (``path``, ``size``), or None."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Data:
    """A loaded dataset.

    x_train: float32 (N, H, W, C) in [0, 1], or int64 (N, L) token ids; None when a data loader reads the training
    images from their files (``load(..., train_images=False)``); y_train: int64 (N,), or (N, L) for a next-token
    task; x_test, y_test likewise; num_classes: int (the vocabulary for a next-token task); skipped_files: for a
    dataset read from image files, the files left out as unreadable (paths relative to its folder; empty when none
    were), None for the others.
    """

    x_train: np.ndarray | None
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    skipped_files: tuple[str, ...] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held (what an adapter places on the device): all four, or without ``x_train`` when
        the training images stay in their files."""
        held = self.x_train.nbytes if self.x_train is not None else 0
        return int(held + self.y_train.nbytes + self.x_test.nbytes + self.y_test.nbytes)

    @property
    def train_images(self) -> np.ndarray:
        """``x_train``; ValueError when the training images were left in their files (``train_images=False``)."""
        if self.x_train is None:
            raise ValueError("the training images were left in their files (a data loader reads them)")
        return self.x_train




def cache_folder(cache_dir: Path | None = None) -> Path:
    """The folder that holds downloaded and decoded datasets: ``cache_dir`` when given, else ``$HARNESS_DATA``, else
    ``~/.cache/harness`` (``~`` expanded). It may not exist yet."""
    return Path(cache_dir or os.environ.get("HARNESS_DATA") or Path.home() / ".cache" / "harness").expanduser()
