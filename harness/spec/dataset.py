"""The ``dataset`` field of a spec: which data a trial trains and evaluates on, one pydantic model per kind,
told apart by ``name`` (``Dataset``, a tagged union). Field rules only: loading, describing and caching the data is
``harness.neutral.datasets``'s (image folders: ``harness.neutral.image_folder``); a relative ``path`` or
``cache_dir`` is resolved against the spec file by ``harness.spec.load``. Imports nothing else of the harness but
``harness.spec.base``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from harness.spec.base import _Strict


class DigitsData(_Strict):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes): real data, offline."""

    name: Literal["digits"]
    test_fraction: float = Field(default=0.2, gt=0, lt=1)


class SyntheticData(_Strict):
    """Random images and labels drawn from the trial seed: for throughput and memory, not accuracy."""

    name: Literal["synthetic"]
    shape: tuple[int, int, int] = (32, 32, 3)
    classes: int = Field(default=10, ge=2)
    size: int = Field(default=1024, gt=0)
    test_size: int = Field(default=256, gt=0)

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        if min(shape) <= 0:
            raise ValueError("every dimension of shape (height, width, channels) must be positive")
        return shape


class SyntheticTokens(_Strict):
    """Token sequences with a learnable structure, drawn from the trial seed (``harness.neutral.datasets``).

    ``vocab`` token ids 0..vocab-1, sequences of ``length`` tokens, ``size`` training and ``test_size`` test
    sequences. ``task``: ``copy``, a next-token task (a random first half of length / 2 tokens, then its copy; the
    label at each position is the next token; ``length`` must be even), or ``sorted``, sequence classification
    (label 1 when the sequence is sorted ascending; half of the sequences are).
    """

    name: Literal["synthetic_tokens"]
    vocab: int = Field(default=16, ge=2)
    length: int = Field(default=16, ge=2)
    size: int = Field(default=2048, gt=0)
    test_size: int = Field(default=256, gt=0)
    task: Literal["copy", "sorted"] = "copy"

    @model_validator(mode="after")
    def _copy_needs_an_even_length(self) -> SyntheticTokens:
        if self.task == "copy" and self.length % 2:
            raise ValueError(f"the copy task needs an even length (a half and its copy), not {self.length}")
        return self


class Cifar10Data(_Strict):
    """CIFAR-10 from the standard python tarball ``cifar-10-python.tar.gz``, md5-verified before it is read.

    ``path``: the tarball; a relative path is taken relative to the spec file. A file named here is never
    downloaded. ``cache_dir``: the folder that holds the archive when ``path`` is not given (default
    ``$HARNESS_DATA``, else ``~/.cache/harness``). When the archive is not there, ``harness run`` and ``harness
    max-batch`` download it there once, before any trial starts (``harness.neutral.download``; from
    ``$HARNESS_CIFAR10_URL`` when set), unless ``--offline`` or ``HARNESS_OFFLINE=1`` asks for no network.
    ``limit_train``: use only the first N training images. ``limit_test``: only the first N test images.
    """

    name: Literal["cifar10"]
    path: Path | None = None
    cache_dir: Path | None = None
    limit_train: int | None = Field(default=None, gt=0)
    limit_test: int | None = Field(default=None, gt=0)


class GeneratedImages(_Strict):
    """A synthetic image folder written where ``ImageFolderData.path`` points when nothing is there yet
    (``harness.neutral.image_folder.make_image_folder``: real JPEG files, each class its own colour and stripe
    angle plus noise, drawn from ``seed``): ``classes`` folders of ``per_class`` images of ``size`` [height, width]
    pixels."""

    classes: int = Field(default=4, ge=2)
    per_class: int = Field(default=128, ge=1)
    size: tuple[PositiveInt, PositiveInt] = (64, 64)
    seed: int = Field(default=0, ge=0)


class ImageFolderData(_Strict):
    """Images in a folder with one sub-folder per class (``harness.neutral.image_folder``).

    ``path``: the folder; a relative path is taken relative to the spec file. Its sub-folders are the classes, class
    index = position in the sorted sub-folder names; their ``.jpg``, ``.jpeg`` and ``.png`` files are the images
    (other files and hidden names are ignored). When ``path`` holds ``train/`` and ``test/``, each with class
    sub-folders, they are the split (every test class must be a training class). ``test_fraction``: otherwise,
    this fraction of each class's images (rounded, at least one kept for training) is the test set, chosen from the
    file names and a fixed seed: the same split in every trial and framework.
    ``size``: [height, width] in pixels that every image is resized to (bilinear, Pillow's ``Image.resize``); without
    it every image must have the size of the first one. ``channels``: 3 (RGB) or 1 (grayscale); every image is
    converted to it. ``on_bad_file``: ``error`` stops at the first file that cannot be decoded, naming it; ``skip``
    leaves such files out and counts them (``metrics.data_skipped_files`` of the trial). ``cache_dir``: where the
    decoded arrays are cached (default ``$HARNESS_DATA``, else ``~/.cache/harness``); a relative path is taken
    relative to the spec file. ``generate``: ``GeneratedImages`` written to ``path`` first when it does not exist
    (a spec that brings its own data, e.g. specs/loader.yaml).
    """

    name: Literal["image_folder"]
    path: Path
    generate: GeneratedImages | None = None
    size: tuple[PositiveInt, PositiveInt] | None = None
    channels: Literal[1, 3] = 3
    test_fraction: float = Field(default=0.2, gt=0, lt=1)
    on_bad_file: Literal["error", "skip"] = "error"
    cache_dir: Path | None = None

    @field_validator("size", mode="before")
    @classmethod
    def _height_and_width(cls, size: Any) -> Any:
        if isinstance(size, (list, tuple)) and len(size) != 2:
            raise ValueError(f"size is [height, width] in pixels, two numbers, not {len(size)}")
        return size


Dataset = Annotated[DigitsData | SyntheticData | SyntheticTokens | Cifar10Data | ImageFolderData,
                    Field(discriminator="name")]
