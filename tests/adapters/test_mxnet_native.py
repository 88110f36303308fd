"""MXNet with a model of your own (``MXNetAdapter.native_model``): a Gluon ``HybridBlock`` from a factory
(``specs/models.py:gluon_cnn``, the digits CNN of torch_cnn and keras_cnn) adopted, initialised by Gluon's rules from
the trial's seed, trained by the same mechanics as the neutral model, in both modes, on two CPU contexts, a token
model's tuple output taken as its logits, its batchnorm as MXNet's own kernel updates it (no running-variance
correction), and AMP's fp16 reaching its operators; what is refused (another object than a HybridBlock; synchronised
batchnorm) and why; the entry's probe. All on the CPU, training for real. Gluon's API relied on:
https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/gluon/block.html (``initialize``, ``hybridize``) and
.../gluon/parameter.html (``Parameter.initialize``, ``reset_ctx``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import adapters
from adapters.base import DataParallel, RunOptions
from adapters.mxnet.adapter import NO_FLOP_COUNTER, MXNetAdapter
from adapters.mxnet.runtime import mx, nd, nn
from harness.execution import native_probe
from harness.neutral import datasets, native
from harness.neutral.info import Input
from harness.plan.support import Conditions, NativeTask, unsupported
from harness.spec import DigitsData, NativeModel
from tests.adapters import kit

ROOT = Path(__file__).resolve().parents[2]
GLUON_CNN = f"{ROOT / 'specs' / 'models.py'}:gluon_cnn"
DIGITS = DigitsData(name="digits")
FEED, CLASSES = datasets.describe_input(DIGITS)  # (8, 8, 1) NHWC images, 10 classes
#: gluon_cnn's parameters: conv 1 -> 16 (3x3), conv 16 -> 32 (3x3), batchnorm (32), dense 512 -> 64, dense 64 -> 10
CNN_PARAMETERS = (16 * 9 + 16) + (32 * 16 * 9 + 32) + 2 * 32 + (512 * 64 + 64) + (64 * 10 + 10)


@pytest.fixture(scope="module")
def data():
    return datasets.load(DIGITS)


def _adopt(block=None, seed: int = 0, options: RunOptions | None = None):
    """A prepared adapter (2 threads, ``seed``) and the block it adopted: ``block()`` (called after ``prepare``, as
    the worker calls the factory after seeding), or gluon_cnn through its factory; not yet built."""
    adapter = MXNetAdapter(options)
    adapter.prepare("cpu", 2, seed)
    made = native.make(NativeModel(factory=GLUON_CNN)) if block is None else block()
    return adapter, adapter.native_model(made, native.NativeSource(GLUON_CNN, FEED, CLASSES, seed))


def _built(data, block=None, seed: int = 0, options: RunOptions | None = None, optimizer=kit.SGD):
    adapter, net = _adopt(block, seed, options)
    adapter.build(net, "image_classification", optimizer)
    adapter.load(data)
    return adapter


def test_a_gluon_cnn_of_your_own_learns_digits(data):
    """gluon_cnn through its factory, hybridized (the default mode): its shapes inferred from the digits input, its
    parameters named as ``save_parameters`` names them, it starts at chance and reaches >= 90 % test accuracy in 3
    epochs of batch 32 (observed 95 %) with the spec's SGD; the settings say how it was initialised and that its
    batchnorm is MXNet's own; no FLOP counter."""
    adapter = _built(data)
    weights = adapter.get_weights()
    assert {name: w.shape for name, w in weights.items()} == {
        "0.weight": (16, 1, 3, 3), "0.bias": (16,), "2.weight": (32, 16, 3, 3), "2.bias": (32,), "3.gamma": (32,),
        "3.beta": (32,), "6.weight": (64, 512), "6.bias": (64,), "7.weight": (10, 64), "7.bias": (10,)}
    assert sum(w.size for w in weights.values()) == CNN_PARAMETERS
    assert set(adapter.get_buffers()) == {"3.running_mean", "3.running_var"}
    assert adapter.training.net._active  # hybridized
    start = adapter.evaluate(256)
    losses = kit.train_epochs(adapter, data, epochs=3, batch_size=32)
    loss, accuracy = adapter.evaluate(256)
    assert start[1] < 0.2 and start[0] == pytest.approx(np.log(10), rel=0.01)  # small uniform weights: chance
    assert accuracy >= 0.9 and loss < 0.5 * start[0] and losses[-1] < losses[0], (start, loss, accuracy, losses)
    assert adapter.predict(data.x_test[:3]).shape == (3, CLASSES)
    settings = adapter.settings().record()
    assert settings["running_variance"].startswith("MXNet's own (biased on the CPU")
    assert settings["gluon_parameters"] == 12 and settings["parameters_kept_from_factory"] == 0  # 10 + 2 running stats
    assert adapter.train_flops_per_sample() == (None, NO_FLOP_COUNTER)
    assert "no FLOP counter" in NO_FLOP_COUNTER
    assert adapters.BUILTIN["mxnet"].capabilities.native_model == "mxnet.gluon.HybridBlock"


def test_the_seed_draws_the_initial_weights_by_gluons_rules(data):
    """The same seed gives the same initial weights twice, another seed others; Gluon's default initializer,
    U(-0.07, 0.07), where a parameter carries none (the weights; Xavier's would exceed 0.07 for the first conv),
    the layers' own zeros and ones (biases, batchnorm); a parameter's own initializer is kept, and so is what the
    factory initialised itself, deferred shape or not (``force_reinit=False``)."""
    first, again, other = (_built(data, seed=seed).get_weights() for seed in (3, 3, 4))
    for name, value in first.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
        if name.endswith("weight"):
            assert not np.allclose(other[name], value), name
            assert np.abs(value).max() <= 0.07 and value.std() == pytest.approx(0.07 / np.sqrt(3), rel=0.2), name
    assert all(not first[name].any() for name in ("0.bias", "2.bias", "3.beta", "6.bias", "7.bias"))
    assert (first["3.gamma"] == 1).all()

    def own():
        net = nn.HybridSequential()
        net.add(nn.Dense(8, in_units=64, weight_initializer=mx.init.Constant(0.5)),  # its own initializer
                nn.Dense(6, in_units=8), nn.Dense(CLASSES))  # the factory initialises these two
        net[1].initialize(mx.init.Constant(0.25))  # shape known: initialised now, on mx.cpu()
        net[2].initialize(mx.init.Constant(0.125))  # shape deferred: its initializer kept for the first forward
        return net

    adapter = _built(data, own)
    weights = adapter.get_weights()
    assert (weights["0.weight"] == 0.5).all() and (weights["1.weight"] == 0.25).all()
    assert weights["2.weight"].shape == (CLASSES, 6) and (weights["2.weight"] == 0.125).all()
    assert not weights["2.bias"].any()  # a bias's own initializer, zeros, wins over the factory's global one
    assert adapter.settings().record()["parameters_kept_from_factory"] == 4


def test_the_eager_mode_trains_imperatively_like_the_compiled_mode(data):
    """A block the factory hybridized runs imperatively in the eager mode (``hybridize(False)``, every block under
    it too) and hybridized in the compiled one; 10 steps of SGD train both alike (|a - b| <= 1e-6 + 1e-5 |b|,
    observed bit for bit: the same kernels), after the weights moved by more than 1e-4."""
    def hybridized():
        net = native.make(NativeModel(factory=GLUON_CNN))
        net.hybridize()
        return net

    steps = kit.batches(len(data.y_train), 32, 10)
    runs = {}
    for mode in ("eager", "compiled"):
        adapter = _built(data, hybridized, options=RunOptions(compile=mode))
        blocks = [adapter.training.net, *adapter.training.net.block._children.values()]
        assert {block._active for block in blocks} == {mode == "compiled"}, mode
        start = adapter.get_weights()
        losses, kept = kit.train_on(adapter, steps, keep=(10,))
        runs[mode] = losses, adapter.get_weights(), start
    np.testing.assert_allclose(runs["eager"][0], runs["compiled"][0], rtol=1e-5)
    for name, value in runs["compiled"][1].items():
        if name != "2.bias":  # the bias of the conv before the batchnorm: the mean it adds is normalised away
            assert np.abs(value - runs["compiled"][2][name]).max() > 1e-4, name
        np.testing.assert_allclose(runs["eager"][1][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_batchnorm_trains_as_mxnets_own_kernel_without_the_correction(data):
    """The neutral model's running variance is corrected to the unbiased update; a model of your own's is not: after
    one training step of a batchnorm with momentum 0 on the CPU its running variance is the biased variance of the
    batch (over the 2 samples x 6 x 6 positions: the unbiased one is 72/71 of it, 1.4 % more)."""
    def with_batchnorm():
        net = nn.HybridSequential()
        net.add(nn.Conv2D(4, 3, in_channels=1), nn.BatchNorm(momentum=0.0, in_channels=4), nn.Flatten(),
                nn.Dense(CLASSES, in_units=4 * 6 * 6))
        return net

    adapter = _built(data, with_batchnorm)
    batch = kit.batches(len(data.y_train), 2, 1)[0]
    conv = adapter.training.net.block[0]
    x = nd.array(data.x_train[batch].transpose(0, 3, 1, 2))
    before = conv(x).asnumpy().astype(np.float64)  # the batchnorm's input in the step, at the initial weights
    kit.step(adapter, batch)
    adapter.read_loss()
    adapter.wait()
    running = adapter.get_buffers()["1.running_var"].astype(np.float64)
    biased = before.var(axis=(0, 2, 3))
    assert biased.min() > 1e-6  # a real spread, so the two variances are far apart
    np.testing.assert_allclose(running, biased, rtol=1e-4)
    assert not np.allclose(running, biased * 72 / 71, rtol=1e-3)
    assert adapter.settings().record()["running_variance"].endswith("a model of your own gets no correction")


def test_a_token_model_returning_a_tuple_gives_its_first_element_as_the_logits():
    """A next-token block fed int64 token ids (B, L), shapes deferred (completed on (2, L) zero ids), returning
    (logits, something else): the first element is what is trained and predicted, hybridized, (B, L, vocab)."""
    class Decoder(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Embedding(50, 8), nn.Dense(50, flatten=False)

        def hybrid_forward(self, F, ids):
            return self.out(self.embed(ids)), ids

    feed = Input("tokens", (12,), 50, True)
    adapter = MXNetAdapter()
    adapter.prepare("cpu", 2, 0)
    net = adapter.native_model(Decoder(), native.NativeSource("m.py:decoder", feed, 50, 0))
    adapter.build(net, native.task(feed), kit.SGD)
    ids = np.arange(24, dtype=np.int64).reshape(2, 12) % 50
    logits = adapter.predict(ids)
    assert logits.shape == (2, 12, 50) and adapter.training.net._active
    weights = adapter.get_weights()
    expected = weights["embed.weight"][ids] @ weights["out.weight"].T + weights["out.bias"]
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)

def test_a_non_gluon_object_is_refused():
    """Anything but a HybridBlock, a plain (imperative) Gluon block included, is refused with the field ``model`` and
    the type it is; the entry's probe reports it as one line, and accepts gluon_cnn with its parameter count."""
    adapter = MXNetAdapter()
    adapter.prepare("cpu", 2, 0)
    for made, kind in ((["not", "a", "model"], "builtins.list"), (nn.Sequential(), "mxnet.gluon.nn.basic_layers"
                                                                                    ".Sequential")):
        with pytest.raises(native.NativeModelError) as err:
            adapter.native_model(made, native.NativeSource("m.py:make", FEED, CLASSES, 0))
        assert err.value.field == "model"
        assert str(err.value) == f"m.py:make returned a {kind}, not a mxnet.gluon.HybridBlock"
    request = {"classes": CLASSES, "seeds": [0], "input": {"kind": FEED.kind, "shape": list(FEED.shape),
                                                            "vocab": FEED.vocab, "per_position": FEED.per_position}}
    good = native_probe.check("mxnet", {**request, "model": {"factory": GLUON_CNN, "kwargs": {}}})
    assert good == {"ok": True, "model_type": "mxnet.gluon.nn.basic_layers.HybridSequential",
                    "parameter_count": CNN_PARAMETERS, "output_shape": [CLASSES]}
    bad = native_probe.check("mxnet", {**request, "model": {"factory": "json:loads", "kwargs": {"s": "[1]"}}})
    assert bad == {"ok": False, "field": "model",
                   "error": "json:loads returned a builtins.list, not a mxnet.gluon.HybridBlock"}


def test_two_cpu_contexts_train_a_native_block_like_two_micro_batches(data):
    """Data-parallel over mx.cpu(0) and mx.cpu(1): the block's parameters on both contexts (the deferred shapes
    completed on both; what the factory initialised elsewhere moved there), the same there after 10 steps of 32, and
    equal to one context accumulating two micro-batches of 16 (each device's batchnorm normalises its own 16, as each
    micro-batch does) within |a - b| <= 1e-6 + 1e-5 |b|. The plan refuses synchronised batchnorm for a model of your
    own, with the reason."""
    two = RunOptions(data_parallel=DataParallel(devices=("cpu:0", "cpu:1")))
    parallel = _built(data, options=two)
    assert [p.list_ctx() for p in parallel.training.params.values()] == [[mx.cpu(0), mx.cpu(1)]] * 12

    def initialised():  # by the factory, on mx.cpu() alone
        net = nn.HybridSequential()
        net.add(nn.Dense(CLASSES, in_units=64))
        net.initialize(mx.init.Constant(0.25))
        return net

    moved = _adopt(initialised, options=two)[1].block[0].weight
    assert moved.list_ctx() == [mx.cpu(0), mx.cpu(1)]  # moved to the trial's contexts, its values kept
    assert all((moved.data(ctx).asnumpy() == 0.25).all() for ctx in (mx.cpu(0), mx.cpu(1)))
    single = _built(data)
    steps = kit.batches(len(data.y_train), 32, 10)
    parallel_losses = kit.train_on(parallel, steps)[0]
    single_losses = kit.train_on(single, steps, micro_batches=2)[0]
    np.testing.assert_allclose(parallel_losses, single_losses, rtol=1e-5)
    expected = single.get_weights()
    for name, param in parallel._own_params().items():
        if param.grad_req != "null":
            mine, theirs = (param.data(ctx).asnumpy() for ctx in parallel.contexts)
            np.testing.assert_array_equal(mine, theirs, err_msg=name)
            np.testing.assert_allclose(mine, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.mean(parallel_losses[-3:]) < np.mean(parallel_losses[:3]) - 0.1, parallel_losses  # it learns
    assert parallel.settings().data_parallel["batchnorm"].startswith("the model's own (per device")
    record, own = adapters.BUILTIN["mxnet"], NativeTask("image_classification")
    assert unsupported(record, own, Conditions("fp32", "default", "cpu", data_parallel=2)) is None
    assert unsupported(record, own, Conditions("fp32", "default", "cuda:0", data_parallel=2)) is None
    refused = unsupported(record, own, Conditions("fp32", "default", "cuda:0", data_parallel=2, sync_batchnorm=True))
    assert refused is not None and refused.startswith("the mxnet adapter cannot make a model of your own normalise "
                                                      "over the global batch")
    # the neutral model's batchnorm is made SyncBatchNorm
    synced = Conditions("fp32", "default", "cuda:0", data_parallel=2, sync_batchnorm=True)
    assert unsupported(record, kit.digits(kit.NORM_CNN)[1], synced) is None


# amp.init rewrites mx.nd's and mx.sym's operators for the rest of the process, so this runs in its own process. fp16
# is declared on CUDA only: the plan refuses it on the CPU, and the adapter, which does not re-check, runs it here.
_FP16 = """
import json
from adapters.mxnet.adapter import MXNetAdapter
from adapters.mxnet.runtime import mx, nn
from harness.neutral import datasets, native
from harness.neutral.info import Input
from harness.spec import DigitsData, NativeModel
from tests.adapters import kit
data = datasets.load(DigitsData(name="digits"))
feed, classes = datasets.describe_input(DigitsData(name="digits"))

def shaped():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, in_channels=1), nn.BatchNorm(in_channels=4), nn.Flatten(), nn.Dense(10, in_units=144))
    return net

out = {}
for name in ("eager", "compiled", "deferred"):
    adapter = kit.configured(MXNetAdapter, precision="fp16", compile="compiled" if name == "deferred" else name)()
    adapter.prepare("cpu", 2, 0)
    made = native.make(NativeModel(factory=GLUON_CNN)) if name == "deferred" else shaped()
    got = {"stage": "native_model"}
    try:
        net = adapter.native_model(made, native.NativeSource(GLUON_CNN, feed, classes, 0))
        got["stage"] = "build"
        adapter.build(net, "image_classification", kit.SGD)
        adapter.load(data)
        got["grads"] = sorted({p.grad().dtype.__name__ for p in adapter.training.params.values()
                               if p.grad_req != "null"})
        got["weights"] = sorted({w.dtype.name for w in adapter.get_weights().values()})
        got["stage"] = "step"
        kit.step(adapter, kit.batches(len(data.y_train), 32, 1)[0])
        adapter.read_loss()
        got["stage"] = "done"
    except mx.base.MXNetError as exc:
        got["error"] = str(exc)
    if got["stage"] == "step":
        got["scaled"] = adapter.training.trainer._scale
        got["loss_scale"] = adapter.settings().record()["loss_scale"]
    out[name] = got
print("RESULT" + json.dumps(out))
"""


def test_fp16_amp_reaches_a_native_blocks_operators_as_far_as_a_cpu_runs_it():
    """fp16 (AMP, ``amp.init`` in ``prepare`` before the factory runs) forced onto the CPU in a child process: a
    native block's parameters and gradients stay float32, ``amp.scale_loss`` set the Trainer's rescaling to 1 / 2^16,
    and AMP's float16 casts reach the block's operators, imperatively and hybridized: MXNet then stops in its float16
    CPU gemm, which it does not have (the reason fp16 is declared on CUDA only). gluon_cnn's deferred shapes are
    completed by a forward pass in ``native_model``, where it stops the same way."""
    code = _FP16.replace("GLUON_CNN", repr(GLUON_CNN))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name in ("eager", "compiled"):
        got = out[name]
        assert got["stage"] == "step" and got["grads"] == ["float32"] and got["weights"] == ["float32"], got
        assert got["scaled"] == pytest.approx(2.0 ** -16) and got["loss_scale"] == 2.0 ** 16, got
        assert "FP16 gemm on cpu not implemented" in got["error"], got["error"][-500:]
    assert out["deferred"]["stage"] == "native_model", out["deferred"]
    assert "FP16 gemm on cpu not implemented" in out["deferred"]["error"]
