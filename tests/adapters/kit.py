"""What the adapter tests build on: the models, a made adapter (``make``), steps through the one step API (``step``,
``train_on``), batches in the harness's order, and a numpy reference forward pass. The tests every adapter passes are
``tests.adapters.conformance``."""

from __future__ import annotations

import numpy as np

from harness.neutral import datasets, models
from harness.spec import DigitsData, ModelSpec, OptimizerSpec

# The seed-002 CNN, sized for 8x8 digits: conv 3x3 same (32) -> maxpool 2 -> flatten -> dense 128 -> dense 10.
CNN = ModelSpec.model_validate({"layers": [
    {"type": "conv2d", "filters": 32, "kernel_size": 3, "padding": "same", "activation": "relu",
     "kernel_init": "he_uniform"},
    {"type": "maxpool2d", "pool_size": 2},
    {"type": "flatten"},
    {"type": "dense", "units": 128, "activation": "relu", "kernel_init": "he_uniform"},
    {"type": "dense", "units": 10},
]})
SGD = OptimizerSpec(name="sgd", learning_rate=0.05, momentum=0.9)

# Parameters after 1 and 10 steps: |a - b| <= PARAM_ATOL + PARAM_RTOL * |b| for every element of every parameter,
# every pair of frameworks. Observed maximum |a - b| (torch 2.13, TF 2.21, MXNet 1.9.1 on x86-64, 2 threads): SGD
# 7.8e-8 after 1 step and 1.6e-6 after 10; Adam 4.5e-7 after 1 and 6.3e-7 after 10. Each parameter moves by more
# than 100 * PARAM_ATOL in these steps (asserted). Breaking an adapter fails them: a wrong Adam epsilon placement
# (above), or no weight decay in MXNet (4e-5 off after the first SGD step).
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5


def digits(model: ModelSpec = CNN):
    data = datasets.load(DigitsData(name="digits"))
    info = models.analyze(model, data.x_train.shape[1:], data.num_classes)
    return data, info


def make(adapter_cls, seed: int = 0, optimizer: OptimizerSpec = SGD, threads: int = 2,
         weights: dict[str, np.ndarray] | None = None, model: ModelSpec = CNN, options=None, data=None):
    """A prepared, built and loaded adapter on the CPU, made with ``options`` (``RunOptions``, default an fp32 run in
    its own mode), with the digits data (or ``data``) and ``model`` (default the CNN), holding ``weights`` (default:
    the canonical ``models.initial_weights(info, seed)``; it may hold buffers too)."""
    loaded, info = digits(model)
    data = loaded if data is None else data
    adapter = adapter_cls(options)
    adapter.prepare("cpu", threads, seed)
    adapter.build_neutral(info, models.initial_weights(info, seed) if weights is None else weights, optimizer)
    adapter.load(data)
    return adapter, data, info


def configured(adapter_cls, **options):
    """``adapter_cls`` made with ``RunOptions(**options)`` when it is given none (what the worker passes it), for the
    tests and scenarios that take an adapter class: ``kit.make(configured(PyTorchAdapter, precision="bf16"))``."""
    from adapters.base import RunOptions

    preset = RunOptions(**options)

    class Configured(adapter_cls):
        def __init__(self, given=None):
            super().__init__(preset if given is None else given)

    Configured.__name__ = f"Configured{adapter_cls.__name__}"
    return Configured


def step(adapter, indices: np.ndarray, micro_batches: int = 1, epoch: int = 0) -> None:
    """One ``train_step`` on the training samples ``indices`` (int64 (B,)): the one batch of ``adapter.batches`` over
    them as an epoch's order of one step."""
    (batch,) = adapter.batches(np.asarray(indices, dtype=np.int64), len(indices), epoch)
    adapter.train_step(batch, micro_batches=micro_batches)


def epoch_steps(adapter, steps: list[np.ndarray], epoch: int = 0):
    """The batches of ``steps`` (index arrays of one size) as the loop gets them: one ``adapter.batches`` over their
    concatenation, a step each."""
    sizes = {len(s) for s in steps}
    assert len(sizes) == 1, f"steps of different sizes: {sorted(sizes)}"
    return adapter.batches(np.concatenate(steps).astype(np.int64), sizes.pop(), epoch)


def epoch_batches(n: int, batch_size: int, epoch: int, seed: int = 0) -> list[np.ndarray]:
    """The full batches of epoch ``epoch`` in the harness's order (``datasets.epoch_order``); a last partial batch is
    dropped, as the harness's loop does."""
    order = datasets.epoch_order(n, seed, epoch)
    return [order[start:start + batch_size] for start in range(0, n - batch_size + 1, batch_size)]


def batches(n: int, batch_size: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """The first ``steps`` batches of a run, epoch after epoch: what every framework is fed in the same order."""
    out: list[np.ndarray] = []
    epoch = 0
    while len(out) < steps:
        out.extend(epoch_batches(n, batch_size, epoch, seed))
        epoch += 1
    return out[:steps]


def train_epochs(adapter, data, epochs: int, batch_size: int, seed: int = 0) -> list[float]:
    """Trains for real; returns the mean of the synced losses of each epoch."""
    means = []
    for epoch in range(epochs):
        losses = train_on(adapter, epoch_batches(len(data.y_train), batch_size, epoch, seed))[0]
        means.append(float(np.mean(losses)))
    return means


def train_on(adapter, steps: list[np.ndarray], keep: tuple[int, ...] = (), micro_batches: int = 1,
             epoch: int = 0) -> tuple[list[float], dict[int, dict[str, np.ndarray]]]:
    """One train_step per index array in ``steps`` (of ``micro_batches`` micro-batches each; ``epoch_steps``: one
    ``batches`` call for all), the loss read after each. Returns the loss of every step and the canonical state
    after each step count in ``keep`` (0: before the first step): the weights (``get_weights``) and the buffers
    (``get_buffers``, batchnorm's running statistics) in one dict."""
    losses: list[float] = []
    kept: dict[int, dict[str, np.ndarray]] = {}
    if 0 in keep:
        kept[0] = {**adapter.get_weights(), **adapter.get_buffers()}
    for count, batch in enumerate(epoch_steps(adapter, steps, epoch), start=1):
        adapter.train_step(batch, micro_batches=micro_batches)
        losses.append(adapter.read_loss()[0])
        if count in keep:
            kept[count] = {**adapter.get_weights(), **adapter.get_buffers()}
    return losses, kept


def max_differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float]:
    """The largest absolute difference between same-named arrays of ``a`` and ``b``, and the largest relative one
    (|a - b| / |b| over the elements where |b| > 1e-3, so that near-zero entries do not dominate). For reporting how
    close two frameworks came; the assertions use ``np.testing.assert_allclose``."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    abs_max = rel_max = 0.0
    for name, ref in b.items():
        diff = np.abs(np.asarray(a[name], np.float64) - np.asarray(ref, np.float64))
        abs_max = max(abs_max, float(diff.max(initial=0.0)))
        big = np.abs(ref) > 1e-3
        rel_max = max(rel_max, float((diff[big] / np.abs(ref[big])).max(initial=0.0)))
    return abs_max, rel_max


def numpy_forward(info, weights, images: np.ndarray, training: bool = False,
                  batch_stats: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
    """A float64 reference forward pass in the canonical layout, written independently of every framework.

    Inference mode (default): batchnorm normalises with the running statistics, ``weights``' "<i>.running_mean" /
    "<i>.running_var" if it has them, else 0 and 1; dropout is the identity. ``training``: batchnorm normalises with
    the batch's mean and biased variance, and ``batch_stats`` (if given) receives each batchnorm's (mean, biased
    variance) by layer index; dropout is still the identity (its masks are the frameworks' own)."""
    x = images.astype(np.float64).transpose(0, 3, 1, 2)  # NCHW
    for layer in info.layers:
        spec = layer.spec
        if layer.kind == "conv2d":
            w, b = weights[f"{layer.index}.weight"].astype(np.float64), weights[f"{layer.index}.bias"]
            k = spec.kernel_size
            if spec.padding == "same":
                x = np.pad(x, ((0, 0), (0, 0), (k // 2, k // 2), (k // 2, k // 2)))
            n, c, h, wd = x.shape
            ho, wo = h - k + 1, wd - k + 1
            patches = np.stack([x[:, :, i:i + ho, j:j + wo] for i in range(k) for j in range(k)], axis=-1)
            # patches: (N, C, Ho, Wo, k*k); weights (O, C, k, k)
            x = np.einsum("nchwk,ock->nohw", patches, w.reshape(w.shape[0], c, k * k)) + b[None, :, None, None]
            if spec.activation == "relu":
                x = np.maximum(x, 0)
        elif layer.kind == "maxpool2d":
            p, s = spec.pool_size, spec.stride or spec.pool_size
            ho, wo = layer.output_shape[1:]
            x = np.max(np.stack([x[:, :, i:i + s * ho:s, j:j + s * wo:s] for i in range(p) for j in range(p)]), axis=0)
        elif layer.kind == "avgpool2d":
            p, s = spec.pool_size, spec.stride or spec.pool_size
            ho, wo = layer.output_shape[1:]
            x = np.mean(np.stack([x[:, :, i:i + s * ho:s, j:j + s * wo:s] for i in range(p) for j in range(p)]), axis=0)
        elif layer.kind == "global_avgpool2d":
            x = x.mean(axis=(2, 3))
        elif layer.kind == "batchnorm":
            axes = (0, 2, 3) if x.ndim == 4 else (0,)
            shape = (1, -1, 1, 1) if x.ndim == 4 else (1, -1)
            if training:
                mean, var = x.mean(axis=axes), x.var(axis=axes)  # the biased batch variance
                if batch_stats is not None:
                    batch_stats[layer.index] = (mean, var)
            else:
                mean = weights.get(f"{layer.index}.running_mean", np.zeros(x.shape[1])).astype(np.float64)
                var = weights.get(f"{layer.index}.running_var", np.ones(x.shape[1])).astype(np.float64)
            gamma, beta = weights[f"{layer.index}.weight"], weights[f"{layer.index}.bias"]
            x = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + spec.epsilon) * gamma.reshape(shape) \
                + beta.reshape(shape)
        elif layer.kind == "flatten":
            x = x.reshape(x.shape[0], -1)
        elif layer.kind == "dense":
            x = x @ weights[f"{layer.index}.weight"].astype(np.float64).T + weights[f"{layer.index}.bias"]
            if spec.activation == "relu":
                x = np.maximum(x, 0)
        elif layer.kind == "relu":
            x = np.maximum(x, 0)
    return x


# A small model with every layer kind that has a training and an inference mode, or buffers.
NORM_CNN = ModelSpec.model_validate({"layers": [
    {"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": "same", "kernel_init": "he_uniform"},
    {"type": "batchnorm"}, {"type": "relu"}, {"type": "avgpool2d", "pool_size": 2},
    {"type": "flatten"}, {"type": "batchnorm", "momentum": 0.5}, {"type": "dropout", "rate": 0.2},
    {"type": "dense", "units": 10},
]})


def check_allocation_failure_is_oom(adapter, allocate, what: str) -> None:
    """``allocate()`` (an allocation the CPU allocator must refuse, of ``what``) raises, and ``adapter`` classifies
    whatever it raised as its OOM."""
    try:
        allocate()
    except BaseException as exc:  # noqa: BLE001 - the point is to classify whatever it raised
        assert adapter.is_oom(exc), repr(exc)
    else:
        raise AssertionError(f"an allocation of {what} succeeded")


def check_execution_declared(name: str, runs: list[tuple[str, str, str]],
                             refuses: dict[tuple[str, str, str], str]) -> None:
    """The plan's rule (``harness.plan.support.unsupported``, from the adapter ``name``'s declaration) accepts each
    (precision, compile, device) of ``runs`` and refuses each of ``refuses`` with a reason that starts with the given
    text: the only place that decides, for the plan, the worker and max-batch alike."""
    import adapters
    from harness.plan.support import Conditions, unsupported

    record, info = adapters.BUILTIN[name], digits()[1]
    for precision, compile, device in runs:
        assert unsupported(record, info, Conditions(precision, compile, device)) is None, (precision, compile, device)
    for (precision, compile, device), start in refuses.items():
        why = unsupported(record, info, Conditions(precision, compile, device))
        assert why is not None and why.startswith(start), (precision, compile, device, why)
