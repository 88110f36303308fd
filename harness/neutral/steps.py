"""What every framework's input code shares: an epoch's order cut into optimizer steps, a step's samples as one
loader element, and the image layouts.

Resident mode gathers each step's samples from a training set on the device by the indices of ``steps``; loader mode
reads them through the framework's own data loader, whose element ``p`` is ``EpochSteps[p]``: one
``harness.neutral.inputs.InputSource.read`` of step ``p``'s samples, converted to the layout and dtypes resident mode
trains on. Both give the same samples in the same order (tests/execution/test_input_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import numpy as np
import numpy.typing as npt

from harness.neutral.inputs import InputSource

#: How a framework's model takes images: NHWC (the harness's own layout, TensorFlow's and JAX's) or NCHW (PyTorch's,
#: MXNet's).
Layout = Literal["NHWC", "NCHW"]


def steps(order: npt.NDArray[np.int64], samples_per_step: int) -> list[npt.NDArray[np.int64]]:
    """``order`` (int64 (N,), an epoch's sample order) cut into its whole steps: step ``p`` is ``order[p * S:(p + 1) *
    S]`` for S = ``samples_per_step``; a last partial step is dropped, as the training loop drops it. Views, no copy.
    Raises ValueError for S < 1."""
    if samples_per_step < 1:
        raise ValueError(f"samples_per_step must be at least 1, not {samples_per_step}")
    count = len(order) // samples_per_step
    return [order[p * samples_per_step:(p + 1) * samples_per_step] for p in range(count)]


def to_layout(images: npt.NDArray[np.generic], layout: Layout) -> npt.NDArray[np.generic]:
    """``images`` (N, H, W, C) in ``layout``: as they are for NHWC, a C-contiguous (N, C, H, W) copy for NCHW (the
    framework's default memory format: a transposed view would keep channels-last strides, and which convolution
    kernel runs could then depend on how a batch was gathered; benchmarks/harness_vs_loop.py)."""
    if layout == "NHWC":
        return images
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2))


def from_layout(images: npt.NDArray[np.generic], layout: Layout) -> npt.NDArray[np.generic]:
    """The inverse of ``to_layout``: (N, C, H, W) back to (N, H, W, C) for NCHW; as they are for NHWC."""
    if layout == "NHWC":
        return images
    return np.ascontiguousarray(images.transpose(0, 2, 3, 1))


class EpochSteps(Sequence[tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]]):
    """An epoch as a sequence of steps, what a framework's loader iterates over: element ``p`` is ``source.read(
    steps(order, size)[p], epoch)`` (the whole step at once, augmented for the epoch) with the images in ``layout``
    and cast to ``image_dtype``, tokens cast to ``token_dtype`` and labels to ``label_dtype`` (the dtypes the
    framework's resident mode trains on). Picklable: a loader's worker processes read it.

    source: the trial's ``InputSource``. order: int64 (N,). size: samples per step. tokens: the source holds token
    ids (int) rather than images (float32 NHWC).
    """

    def __init__(self, source: InputSource, order: npt.NDArray[np.int64], size: int, epoch: int, *,
                 tokens: bool = False, layout: Layout = "NHWC", image_dtype: npt.DTypeLike = np.float32,
                 token_dtype: npt.DTypeLike = np.int64, label_dtype: npt.DTypeLike = np.int64):
        if size < 1:
            raise ValueError(f"a step of {size} samples")
        self.source, self.order, self.size, self.epoch = source, np.asarray(order, np.int64), size, epoch
        self.tokens, self.layout = tokens, layout
        self.image_dtype, self.token_dtype, self.label_dtype = image_dtype, token_dtype, label_dtype

    def __len__(self) -> int:
        return len(self.order) // self.size

    @overload
    def __getitem__(self, position: int) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]: ...

    @overload
    def __getitem__(self, position: slice) -> Sequence[tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]]: ...

    def __getitem__(self, position: int | slice) -> (
            tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]
            | Sequence[tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]]):
        if isinstance(position, slice):
            return [self[p] for p in range(*position.indices(len(self)))]
        if not 0 <= position < len(self):
            raise IndexError(f"step {position} of {len(self)}")
        return self.read(self.order[position * self.size:(position + 1) * self.size])

    def read(self, indices: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
        """The samples ``indices`` of this epoch, converted: (x, y) as element ``p`` holds them."""
        return read_step(self.source, indices, self.epoch, tokens=self.tokens, layout=self.layout,
                         image_dtype=self.image_dtype, token_dtype=self.token_dtype, label_dtype=self.label_dtype)


def read_step(source: InputSource, indices: npt.NDArray[np.int64], epoch: int, *, tokens: bool = False,
              layout: Layout = "NHWC", image_dtype: npt.DTypeLike = np.float32, token_dtype: npt.DTypeLike = np.int64,
              label_dtype: npt.DTypeLike = np.int64) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
    """One step's samples ``indices`` of epoch ``epoch`` read from ``source`` (augmented for the epoch) and
    converted: images to ``layout`` and ``image_dtype`` (or tokens to ``token_dtype``), labels to ``label_dtype``;
    new C-contiguous arrays."""
    x, y = source.read(indices, epoch)
    if tokens:
        x = np.asarray(x, token_dtype)
    else:
        x = to_layout(np.asarray(x, image_dtype), layout)
    return np.ascontiguousarray(x), np.ascontiguousarray(np.asarray(y, label_dtype))
