"""MXNet's input: the dataset resident on every context (each step gathered by its indices, ``nd.take``), or
``mxnet.gluon.data.DataLoader`` reading each step through the harness's source; images NCHW float32, tokens int64.

Both give a step as each context's part (``Inputs.arrays``: a ``Take`` per context), which the training mechanics
(``adapters.mxnet.training``) train on whatever its origin.

Every array made from the host here goes in through ``nd.from_numpy`` (zero-copy DLPack, https://mxnet.apache.org/
versions/1.9.1/api/python/docs/api/ndarray/ndarray.html#mxnet.ndarray.from_numpy), not ``nd.array``: on the CPU,
``nd.array`` copies synchronously after waiting for every operator already queued on the CPU (``NDArray::WaitToWrite``
pushes an empty write to the CPU queue and waits for it), which would make every step wait for the previous one.
``from_numpy`` only wraps the memory, so it is given a private copy (or a loader's fresh array), which MXNet keeps
alive until the last operator that reads it is done; the caller's array is never frozen by it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from adapters.base import RunOptions, shard
from adapters.mxnet.runtime import gluon, nd
from adapters.mxnet.training import Step, Take
from harness.neutral.datasets import Data
from harness.neutral.inputs import InputSource
from harness.neutral.steps import read_step, steps, to_layout


class Inputs:
    """The trial's data on ``contexts`` (one, or one per device of a data-parallel trial): the test set on the first;
    the training set resident on every one, or a loader over the training samples (``options.input``). tokens: the
    model takes int64 token ids, not NCHW float32 images."""

    def __init__(self, options: RunOptions, contexts: list[Any], tokens: bool):
        self.options, self.contexts, self.ctx, self.tokens = options, contexts, contexts[0], tokens
        self.train: list[tuple[Any, Any]] = []  # the resident training set (x, y) on each context (load)
        self._loader: Any = None
        self._sampler = _EpochBatches()
        self.loader_settings: dict[str, Any] | None = None

    def tensor(self, inputs: npt.NDArray[Any], ctx: Any = None) -> Any:
        """NHWC float32 images as NCHW (``harness.neutral.steps.to_layout``), or (N, L) token ids as int64, on ``ctx``
        (default the first context): ``nd.array``, a copy that never shares the harness's array."""
        ctx = self.ctx if ctx is None else ctx
        if self.tokens:
            return nd.array(inputs, ctx=ctx, dtype=np.int64)
        return nd.array(to_layout(inputs, "NCHW"), ctx=ctx, dtype=np.float32)

    def load(self, data: Data) -> None:
        """Images (NCHW float32) or token ids (N, L) int64, and int64 labels ((N,), or (N, L) for a next-token
        model), resident. Data-parallel: the training set resident on every context (each gathers its shard of a step
        from its own copy, as a Gluon user's ``split_and_load`` would place each device's slice), the test set on the
        first (evaluation). In loader mode the test set only (the training batches come from ``open_loader``'s
        DataLoader)."""
        if self.options.input == "resident":
            self.train = [(self.tensor(data.train_images, ctx), nd.array(data.y_train, ctx=ctx, dtype=np.int64))
                          for ctx in self.contexts]
        self.x_test = self.tensor(data.x_test)
        self.y_test = nd.array(data.y_test, ctx=self.ctx, dtype=np.int64)
        nd.waitall()

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        """Copies ``images`` (float32 NHWC) over the resident training images (NCHW) in place (``x[:] = ...``), on
        every context."""
        nchw = to_layout(np.asarray(images, dtype=np.float32), "NCHW")
        for x, _ in self.train:
            x[:] = nchw

    def open_loader(self, source: InputSource) -> None:
        """A ``gluon.data.DataLoader`` over ``source`` (https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/
        gluon/data/index.html#mxnet.gluon.data.DataLoader): a Dataset (``_Samples``) whose item of key (epoch, indices)
        is a whole step read with ``harness.neutral.steps.read_step`` (NCHW float32, or int64 tokens) in the reading
        worker, as the other frameworks' loaders read a step; a ``batch_sampler`` (``_EpochBatches``) yielding each
        step of the epoch's order as one such key, and ``batchify_fn`` (``_one``) passing that item on. The keys carry
        the epoch because Gluon hands the Dataset to its worker processes once, when it forks them: a Dataset per
        epoch (``harness.neutral.steps.EpochSteps``) would need a new pool every epoch. ``num_workers`` =
        ``options.loader.workers`` worker processes (Gluon's multiprocessing pool, forked here once and kept for every
        epoch; 0: read in this process at each ``next``), ``prefetch`` = ``options.loader.prefetch`` batches asked of
        the workers ahead of the step (Gluon's ``prefetch`` works only with workers), ``thread_pool`` False: processes,
        as Gluon's default. The pool forks this process after the model and the test set exist; MXNet stops its engine
        around a fork and restarts it in the parent (``pthread_atfork`` handlers, ``LibraryInitializer`` in
        src/initialize.cc of 1.9.1), and the workers run no MXNet operator: the items come back as numpy arrays (pickled
        through the pool's pipe), not as NDArrays in shared memory (Gluon's ``default_mp_batchify_fn``), and
        ``batches`` wraps them without a copy. (Checked with the worker's settings, ``MXNET_CPU_WORKER_NTHREADS=1`` and
        ``OMP_NUM_THREADS=1``: no hang, the same batches as in this process, so ``thread_pool`` is not needed.)
        ``auto_reload`` False (1.9.1's default): an epoch's iterator, and its prefetching, starts when ``batches`` is
        asked for the epoch's first batch, after the sampler holds the epoch's order."""
        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch
        self._sampler = _EpochBatches()
        self._loader = gluon.data.DataLoader(_Samples(source, self.tokens), batch_sampler=self._sampler,
                                             batchify_fn=_one, num_workers=workers, prefetch=prefetch,
                                             thread_pool=False)
        self.loader_settings = {"loader": "mxnet.gluon.data.DataLoader", "num_workers": workers,
                                "prefetch": prefetch if workers > 0 else None, "thread_pool": False,
                                "source": "files" if source.from_files else "memory"}

    def batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Any]:
        """The epoch's batches (``Adapter.batches``).

        Resident: the epoch is staged now, when called (outside the first epoch's timed windows): its order's whole
        steps on every context as one int64 NDArray, ``nd.from_numpy`` of a private copy, then ``as_in_context`` (on
        a GPU or another CPU context one asynchronous copy an epoch; on cpu(0) the array itself); each batch is, per
        context, its step's slice (a view, no copy), data-parallel that context's shard of the step
        (``adapters.base.shard``: ValueError unless the contexts divide the step). One ``from_numpy`` an epoch rather
        than one a step (why, measured: docs/findings/2026-11-23-harness-vs-loop.md).

        Loader: lazily (nothing read before the first ``next``), the sampler set to the epoch's order, then the
        DataLoader's (x, y), NCHW float32 images or int64 (B, L) tokens and int64 labels ((B,) or (B, L)), wrapped by
        ``nd.from_numpy`` (the loader's fresh arrays) and moved to the context with ``as_in_context`` (on a GPU an
        asynchronous copy operator; on the CPU the array itself)."""
        if self._loader is not None:
            return self._loaded(order, samples_per_step, epoch)
        whole = steps(order, samples_per_step)
        if not whole:
            return iter([])
        wrapped = nd.from_numpy(np.array(order[:len(whole) * samples_per_step], dtype=np.int64), zero_copy=True)
        staged = [wrapped.as_in_context(ctx) for ctx in self.contexts]
        n, size = len(self.contexts), samples_per_step
        per = len(shard(whole[0], n, 0))  # raises ValueError unless the contexts divide the step
        return iter([[staged[d][p * size + d * per:p * size + (d + 1) * per] for d in range(n)]
                     for p in range(len(whole))])

    def _loaded(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Any]:
        self._sampler.order, self._sampler.size, self._sampler.epoch = order, samples_per_step, epoch
        for x, y in self._loader:
            yield (nd.from_numpy(x, zero_copy=True).as_in_context(self.ctx),
                   nd.from_numpy(y, zero_copy=True).as_in_context(self.ctx))

    def arrays(self, batch: Any, micro_batches: int) -> Step:
        """A batch of ``batches`` as each context's ``Take`` and the step's samples B (``Training.step`` splits them
        into ``micro_batches``). Resident: context d gathers (``nd.take``) its indices, or a slice of them, from its
        own copy of the training set; loader: the batch's (x, y), or a slice of them (a view)."""
        if self._loader is not None:
            x, y = batch

            def sliced(part: slice | None) -> tuple[Any, Any]:
                return (x, y) if part is None else (x[part], y[part])

            return [sliced], int(x.shape[0])
        return [_gather(x, y, idx) for (x, y), idx in zip(self.train, batch)], sum(int(i.shape[0]) for i in batch)


def _gather(x: Any, y: Any, idx: Any) -> Take:
    def take(part: slice | None) -> tuple[Any, Any]:
        chosen = idx if part is None else idx[part]
        return nd.take(x, chosen), nd.take(y, chosen)

    return take


class _Samples(gluon.data.Dataset):
    """The loader's Dataset: the item of key (epoch, indices), int64 (B,) indices of one step, is that step's batch
    read with ``harness.neutral.steps.read_step``: images as NCHW float32 (B, C, H, W) (what resident mode holds), or
    int64 (B, L) tokens, and int64 labels, numpy arrays. Its length is the source's samples."""

    def __init__(self, source: InputSource, tokens: bool):
        self.source, self.tokens = source, tokens

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, npt.NDArray[np.int64]]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        epoch, indices = key
        return read_step(self.source, indices, epoch, tokens=self.tokens, layout="NCHW")


def _one(items: list[Any]) -> Any:
    """The DataLoader's batchify_fn: a step is one key, whose item (``_Samples``) is the batch already."""
    return items[0]


class _EpochBatches(gluon.data.Sampler):
    """The DataLoader's batch sampler: the epoch's ``order`` cut into steps of ``size`` samples
    (``harness.neutral.steps.steps``), each yielded as a batch of one key (``epoch``, the step's int64 indices) (the
    epoch draws the augmentation); set before each epoch's iterator (in the training process, where Gluon iterates a
    batch sampler)."""

    def __init__(self) -> None:
        self.order: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self.size, self.epoch = 1, 0

    def __len__(self) -> int:
        return len(self.order) // self.size

    def __iter__(self) -> Iterator[list[tuple[int, npt.NDArray[np.int64]]]]:
        for indices in steps(np.asarray(self.order, dtype=np.int64), self.size):
            yield [(self.epoch, indices)]
