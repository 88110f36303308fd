"""The training samples as a data loader reads them (``input: loader``): batches of host arrays, read from memory or
decoded from image files, augmented per sample as ``harness.neutral.datasets.augment`` augments the whole set.

Every framework's loader (PyTorch's ``DataLoader``, ``tf.data``, Gluon's ``DataLoader``, JAX's) calls ``read`` in its
workers, so every framework in loader mode trains on the same arrays, in the same order, as resident mode does.
What is measured and how to read it: docs/guide/data.md#input-pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from harness.neutral.datasets import Data, DatasetSpec, augment_offsets, crop_and_flip
from harness.spec import ImageFolderData


@dataclass(frozen=True)
class Decode:
    """How a file of an image folder becomes an image: resized to ``size`` (height, width) or kept, ``channels`` 1
    or 3 (``harness.neutral.image_folder.decode``)."""

    size: tuple[int, int] | None
    channels: int


class InputSource:
    """The training set of a trial, as a loader's workers read it.

    labels: int64 (N,) or (N, L). images: float32 (N, H, W, C) in [0, 1] or int64 (N, L) tokens, the samples held in
    host memory; or files: N image paths decoded on each read (``decode``), into float32 in [0, 1] exactly as the
    image folder's cache holds them. augmentation: random crop and flip per sample, drawn from (seed, epoch) for the
    whole set, so that ``read(i, e)`` equals ``augment(images, seed, e)[i]``. Picklable: loaders send it to worker
    processes.
    """

    def __init__(self, labels: npt.NDArray[np.int64], images: npt.NDArray[np.generic] | None = None,
                 files: tuple[Path, ...] | None = None, decode: Decode | None = None, augmentation: bool = False,
                 seed: int = 0):
        if (images is None) == (files is None):
            raise ValueError("an InputSource reads images or files, one of the two")
        if files is not None and decode is None:
            raise ValueError("files need a Decode")
        self.labels, self.images, self.files, self.decode = labels, images, files, decode
        self.augmentation, self.seed = augmentation, seed
        self._offsets: tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def from_files(self) -> bool:
        """Whether each read decodes image files (an image folder) rather than slicing host memory."""
        return self.files is not None

    def read(self, indices: npt.NDArray[np.int64], epoch: int) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.int64]]:
        """The samples ``indices`` (int64 (B,)) of epoch ``epoch``: images float32 (B, H, W, C) (or int64 (B, L)
        tokens) and labels, new contiguous arrays."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.files is not None:
            assert self.decode is not None
            from harness.neutral.image_folder import decode

            x = np.stack([decode(self.files[i], self.decode.size, self.decode.channels) for i in indices])
            x = x.astype(np.float32) / np.float32(255.0)
        else:
            assert self.images is not None
            x = self.images[indices]
        if self.augmentation:
            x = self._augment(x, indices, epoch)
        return np.ascontiguousarray(x), np.ascontiguousarray(self.labels[indices])

    def _augment(self, x: npt.NDArray[np.generic], indices: npt.NDArray[np.int64],
                 epoch: int) -> npt.NDArray[np.float32]:
        cached = self._offsets  # one read: reader threads (tf.data, Grain) may ask for two epochs at once
        if cached is None or cached[0] != epoch:  # the epoch's draws, for every sample (cheap)
            cached = (epoch, *augment_offsets(len(self), x.shape[1], x.shape[2], self.seed, epoch))
            self._offsets = cached
        _, dy, dx, flip = cached
        return crop_and_flip(np.asarray(x), dy[indices], dx[indices], flip[indices])

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_offsets": None}


def for_dataset(cfg: DatasetSpec | None, data: Data, augmentation: bool = False, seed: int = 0) -> InputSource:
    """The loader's source of a trial's training set: an image folder's files, decoded at each read as its cache
    holds them (``image_folder.decode``, then / 255), whether or not ``data`` holds them too; any other dataset's
    ``data.x_train`` in host memory."""
    if isinstance(cfg, ImageFolderData):
        from harness.neutral import image_folder

        listing = image_folder.scan(cfg)  # once: a large folder takes a while to list
        height, width = image_folder.reference_size(cfg, listing)  # the size the cache's images were decoded to
        files = image_folder.train_files(listing, data.skipped_files or ())
        if len(files) != len(data.y_train):
            raise ValueError(f"{cfg.path}: {len(files)} training files but {len(data.y_train)} cached images")
        return InputSource(data.y_train, files=files, decode=Decode((height, width), cfg.channels),
                           augmentation=augmentation, seed=seed)
    return InputSource(data.y_train, images=data.train_images, augmentation=augmentation, seed=seed)
