"""JAX's input: the dataset resident on the device (each step gathered by its indices inside the jitted step), or a
Grain pipeline reading each step through the harness's source, its batches put on the device ahead of the step;
images NHWC float32, tokens and labels int32.

Both give a step's arrays as the training mechanics (``adapters.jax.training.Training.step``) take them
(``Inputs.arrays``), whatever their origin.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from adapters.base import RunOptions
from adapters.jax.runtime import jax, jnp
from harness.neutral.datasets import Data
from harness.neutral.inputs import InputSource
from harness.neutral.steps import EpochSteps, steps

#: The name of the loader, as ``settings().loader`` records it (the declaration's ``loader``).
LOADER = "grain.MapDataset"


class Inputs:
    """The trial's data: the test set on ``device`` always; the training set resident on ``placement`` (the device,
    or replicated over a data-parallel mesh: each device gathers its shard of a step from its copy), or a loader over
    the training samples (``options.input``). tokens: the model takes int32 token ids, not NHWC float32 images."""

    def __init__(self, options: RunOptions, device: Any, placement: Any, tokens: bool):
        self.options, self.device, self.placement, self.tokens = options, device, placement, tokens
        self._source: InputSource | None = None  # input: loader: open_loader's source, read through grain
        self._read_options: Any = None
        self.loader_settings: dict[str, Any] | None = None
        self.x_train: Any = None
        self.y_train: Any = None
        #: resident mode on one device: each epoch's step indices put on the device when ``batches`` is called
        #: (before the window that runs into the epoch: ``harness.execution.loop._Loop.stage_ahead``, the device
        #: idle), as a hand-written loop keeps them there, rather than given to every jitted step as numpy (a copy
        #: to the device at each dispatch, waiting behind the queued steps: 511 against 287 us a step at batch 512
        #: on digits on an H200). Not over a mesh, whose steps take them as numpy, sharded by jit.
        self.stage_indices = placement is device

    def tensor(self, x: npt.NDArray[Any], placement: Any = None) -> Any:
        """Images as float32 NHWC, or token ids as int32, on the device (or ``placement``)."""
        return jax.device_put(jnp.asarray(x, jnp.int32 if self.tokens else jnp.float32),
                              self.device if placement is None else placement)

    def load(self, data: Data) -> None:
        """The test set on the device and, in resident mode, the training set on the placement (``input: loader``:
        the training batches come through ``open_loader``'s pipeline)."""
        if self.options.input == "resident":
            self.x_train = self.tensor(data.train_images, self.placement)
            self.y_train = jax.device_put(jnp.asarray(data.y_train, jnp.int32), self.placement)
        self.x_test = self.tensor(data.x_test)
        self.y_test = jax.device_put(jnp.asarray(data.y_test, jnp.int32), self.device)

    def set_train_images(self, images: npt.NDArray[np.float32]) -> None:
        """A new device array of the same shape and dtype (JAX arrays are immutable; the old one is freed): the train
        step takes the dataset as an argument, so nothing is retraced. Raises ValueError for another shape."""
        if images.shape != self.x_train.shape:
            raise ValueError(f"images of shape {images.shape}, not {self.x_train.shape}")
        self.x_train = jax.device_put(jnp.asarray(images, jnp.float32), self.placement)

    def open_loader(self, source: InputSource) -> None:
        """Grain (https://google-grain.readthedocs.io, Google's data loader for JAX), its dataset API: in ``batches``
        a ``grain.MapDataset`` whose element p is step p's batch of the epoch's order (``harness.neutral.steps
        .EpochSteps``: one ``source.read`` of the step's samples, the whole batch at once, as PyTorch's
        ``__getitems__`` reads it), made an iterator by ``to_iter_dataset(grain.ReadOptions(num_threads=workers,
        prefetch_buffer_size=workers x prefetch))``: ``options.loader.workers`` threads read elements ahead, returned
        in the dataset's order (0: each is read in the training thread when asked for). The buffer is grain's elements
        in flight, so it must be at least the threads (grain 0.2.18 warns that fewer would run otherwise); ``workers x
        prefetch`` batches read ahead is PyTorch's ``num_workers x prefetch_factor``. Then ``_device_prefetch``:
        ``options.loader.prefetch`` batches already given to ``jax.device_put`` ahead of the step.

        Why a MapDataset of steps and not per-sample elements with ``.batch(B)``, or ``grain.DataLoader`` with a
        sampler: the trial's order is given per epoch (``harness.neutral.datasets.epoch_order``), and an element per
        step follows it exactly; reading 32 digits one by one and stacking them took 1.2 ms a batch against 0.17 ms
        for one read (grain 0.2.18, one CPU thread). Why not ``grain.experimental.device_put``: it is experimental,
        and its stages are threads, which would read in the background even with 0 workers; the device queue needs
        no thread, as ``jax.device_put`` only starts the transfer (https://docs.jax.dev/en/latest/async_dispatch.html).
        Records the settings (``loader_settings``)."""
        import grain  # here, not at the top: resident mode neither needs grain nor pays for its import

        workers, prefetch = self.options.loader.workers, self.options.loader.prefetch
        self._source = source
        self._read_options = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=workers * prefetch)
        self.loader_settings = {
            "loader": LOADER, "num_threads": workers, "prefetch_buffer_size": workers * prefetch,
            "device_put_prefetch": prefetch, "source": "files" if source.from_files else "memory"}

    def batches(self, order: npt.NDArray[np.int64], samples_per_step: int, epoch: int) -> Iterator[Any]:
        """Resident: each whole step's indices as int32 (B,) arrays, made now, before the epoch's first step: on one
        device put on it now (``stage_indices``: ``jax.device_put`` only starts the transfers), over a mesh numpy
        that the jitted step shards (``Training.step``). Loader: step p's (x, y), ``source.read`` of the step's
        samples as float32 (B, H, W, C) images or int32 (B, L) tokens and int32 labels (the dtypes resident mode
        trains on), committed to the device by ``jax.device_put`` (the transfer started, maybe not finished); nothing
        is read before the first ``next``, as a ``for`` loop over a loader starts it, and the pipeline's threads end
        with the epoch (``_device_prefetch``)."""
        if self._source is None:
            whole = [np.asarray(indices, dtype=np.int32) for indices in steps(order, samples_per_step)]
            return iter(jax.device_put(whole, self.device) if self.stage_indices else whole)
        import grain

        epoch_steps = EpochSteps(self._source, order, samples_per_step, epoch, tokens=self.tokens,
                                 token_dtype=np.int32, label_dtype=np.int32)
        dataset = grain.MapDataset.source(epoch_steps)
        return _device_prefetch(dataset.to_iter_dataset(self._read_options), self.device,
                                self.options.loader.prefetch)

    def arrays(self, batch: Any, micro_batches: int) -> tuple[Any, Any, npt.NDArray[np.int32] | None]:
        """What ``Training.step`` takes for a batch of ``batches`` (which splits it into ``micro_batches``): (the
        training set's x, y, the step's indices) in resident mode, (x, y, None) for a loader's batch."""
        if self._source is None:
            return self.x_train, self.y_train, batch
        x, y = batch
        return x, y, None


def _device_prefetch(batches: Iterable[Any], device: Any, size: int) -> Iterator[Any]:
    """The elements of ``batches`` (an iterable of host arrays or tuples of them), each ``jax.device_put`` on
    ``device`` ``size`` elements before it is yielded: flax's ``jax_utils.prefetch_to_device`` pattern
    (https://flax.readthedocs.io/en/latest/api_reference/flax.jax_utils.html), a queue filled in the consuming thread,
    where ``device_put`` only starts each transfer (https://docs.jax.dev/en/latest/async_dispatch.html). The iterator
    of ``batches`` is made at the first ``next`` and closed (grain's ends its threads) when this one ends or is
    dropped."""
    iterator = iter(batches)
    queue: collections.deque[Any] = collections.deque()

    def enqueue(count: int) -> None:
        for batch in itertools.islice(iterator, count):
            queue.append(jax.device_put(batch, device))
    try:
        enqueue(size)
        while queue:
            yield queue.popleft()
            enqueue(1)
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
