"""PyTorch's input: the dataset resident on the device (each step gathered by its indices), or a
``torch.utils.data.DataLoader`` reading each step through the harness's source; images NCHW, tokens int64.

Both give a step's micro-batches as (x, y) pairs on the device (``Inputs.arrays``), which the training mechanics
(``adapters.pytorch.training``) train on whatever their origin.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from adapters.base import DataParallel, RunOptions, micro_batch_size, shard
from adapters.pytorch.training import Parts
from harness.neutral.datasets import Data
from harness.neutral.inputs import InputSource
from harness.neutral.steps import read_step, steps, to_layout


class Inputs:
    """The trial's data on ``device``: the test set always; the training set resident, or a loader over the
    training samples (``options.input``). tokens: the model takes int64 token ids, not NCHW float32 images."""

    def __init__(self, options: RunOptions, device: torch.device, tokens: bool, ranks: DataParallel | None):
        self.options, self.device, self.tokens, self.ranks = options, device, tokens, ranks
        self._loader: torch.utils.data.DataLoader[Any] | None = None
        self._sampler = _EpochBatches()
        self.loader_settings: dict[str, Any] | None = None

    def tensor(self, inputs: npt.NDArray[Any]) -> torch.Tensor:
        """NHWC float32 images as NCHW (``harness.neutral.steps.to_layout``), or (N, L) int64 token ids as they are,
        on the device: always a copy (``torch.tensor``), never sharing the harness's array, which
        ``set_train_images`` would otherwise write into."""
        if self.tokens:
            return torch.tensor(inputs, dtype=torch.int64, device=self.device)
        return torch.tensor(to_layout(inputs, "NCHW"), dtype=torch.float32, device=self.device)

    def load(self, data: Data) -> None:
        """The test set, and in resident mode the training set, on the device."""
        if self.options.input == "resident":  # a loader brings the training batches itself (open_loader)
            self.x_train = self.tensor(data.train_images)
            self.y_train = torch.from_numpy(data.y_train).to(self.device)
        self.x_test = self.tensor(data.x_test)
        self.y_test = torch.from_numpy(data.y_test).to(self.device)

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        """Copies ``images`` (float32 NHWC) over the resident training images (NCHW) in place."""
        self.x_train.copy_(torch.from_numpy(to_layout(images, "NCHW")))

    def open_loader(self, source: InputSource) -> None:
        """A ``torch.utils.data.DataLoader`` over ``source`` (https://pytorch.org/docs/stable/data.html): a map-style
        dataset whose ``__getitems__`` reads a whole step (``read_step``: NCHW float32 or int64 tokens), a
        batch sampler yielding each step's samples of the epoch's order, ``num_workers`` = ``options.loader.workers``
        worker processes (persistent across epochs), ``prefetch_factor`` = ``options.loader.prefetch`` batches per
        worker, and ``pin_memory`` on CUDA so that the copy to the device can overlap (``non_blocking``)."""
        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch
        pin = self.device.type == "cuda"
        self._loader = torch.utils.data.DataLoader(
            _Samples(source, self.tokens), batch_sampler=self._sampler, collate_fn=_as_is, num_workers=workers,
            pin_memory=pin, persistent_workers=workers > 0, prefetch_factor=prefetch if workers > 0 else None)
        self.loader_settings = {"loader": "torch.utils.data.DataLoader", "num_workers": workers,
                                "prefetch_factor": prefetch if workers > 0 else None,
                                "persistent_workers": workers > 0, "pin_memory": pin,
                                "source": "files" if source.from_files else "memory"}

    def batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Any]:
        """Resident: each step's indices, int64 (B,) rows of one (steps, B) tensor on the device, copied there once
        for the epoch, now; on CUDA from pinned memory with ``non_blocking``, so that the copy neither waits for the
        queued steps nor holds up the host (a copy from pageable memory may synchronize with the stream first:
        https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html; on an H200 a pageable copy per step cost
        a hand-written loop 3 to 13 % of its throughput at batch 512 on digits, the epoch's pinned copy 23 us of host
        time). Loader: the loader's (x, y) on the device (copies started with ``non_blocking``)."""
        if self._loader is None:
            whole = steps(order, samples_per_step)
            if not whole:
                return iter(())
            table = torch.from_numpy(np.stack(whole))
            if self.device.type == "cuda":
                table = table.pin_memory()
            return iter(table.to(self.device, non_blocking=True).unbind(0))
        return self._loaded(order, samples_per_step, epoch)

    def _loaded(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Any]:
        assert self._loader is not None
        self._sampler.order, self._sampler.size, self._sampler.epoch = order, samples_per_step, epoch
        for x, y in self._loader:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def arrays(self, batch: Any, micro_batches: int) -> Parts:
        """The step's ``micro_batches`` consecutive micro-batches as (x, y) on the device. Resident: gathered from
        the training set as each is trained on (only one micro-batch's inputs exist at a time); data-parallel this
        rank's shard of the step (``shard``). Loader: the batch's chunks. Raises ValueError when ``micro_batches``
        does not divide the batch."""
        if self._loader is not None:
            x, y = batch
            micro_batch_size(len(x), micro_batches)  # raises ValueError for an uneven split
            return zip(x.chunk(micro_batches), y.chunk(micro_batches))
        # the epoch table's row (batches); shard slices it as it slices numpy: a tensor in, a tensor out
        idx = cast(torch.Tensor, batch if self.ranks is None else shard(batch, self.ranks.size, self.ranks.rank))
        micro_batch_size(len(idx), micro_batches)
        return ((self.x_train.index_select(0, part), self.y_train.index_select(0, part))
                for part in idx.chunk(micro_batches))


class _Samples(torch.utils.data.Dataset[Any]):
    """The loader's map-style dataset: ``__getitems__`` reads a whole step (the batch sampler's one key, (epoch, the
    step's int64 indices)) with ``harness.neutral.steps.read_step`` (NCHW float32 images, or int64 tokens; int64
    labels), so that the DataLoader's workers do the conversion (collate: ``_as_is``)."""

    def __init__(self, source: InputSource, tokens: bool):
        self.source, self.tokens = source, tokens

    def __len__(self) -> int:
        return len(self.source)

    def __getitems__(self, keys: list[tuple[int, npt.NDArray[np.int64]]]) -> tuple[torch.Tensor, torch.Tensor]:
        ((epoch, indices),) = keys
        x, y = read_step(self.source, indices, epoch, tokens=self.tokens, layout="NCHW")
        return torch.from_numpy(x), torch.from_numpy(y)


def _as_is(batch: Any) -> Any:
    """The DataLoader's collate_fn: ``_Samples.__getitems__`` made the batch already."""
    return batch


class _EpochBatches:
    """The DataLoader's batch sampler: the epoch's ``order`` cut into steps of ``size`` samples
    (``harness.neutral.steps.steps``), each one key (epoch, the step's int64 indices) (the epoch draws the
    augmentation); set before each epoch's iterator (in the training process, where a batch sampler runs)."""

    def __init__(self) -> None:
        self.order: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self.size, self.epoch = 1, 0

    def __len__(self) -> int:
        return len(self.order) // self.size

    def __iter__(self) -> Iterator[list[tuple[int, npt.NDArray[np.int64]]]]:
        for indices in steps(self.order, self.size):
            yield [(self.epoch, indices)]
