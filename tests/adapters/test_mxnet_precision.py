"""MXNet's execution modes and precisions: the eager mode (Gluon blocks run imperatively, never hybridized) trains
exactly like the default hybridized one in fp32, for the digits CNN and the residual and transformer block models;
the plan refuses bf16 with the reason MXNet 1.9.1 gives on this CPU (no bfloat16 kernels it can run: the failures are
reproduced here), as it does fp16 on the CPU, tf32 and synchronised batchnorm in fp16 (the declaration's limit); and
fp16's AMP plumbing (``amp.init``, ``amp.init_trainer``,
``amp.scale_loss``) is wired in, checked in a separate process as far as a CPU lets it run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import adapters
from adapters.mxnet.adapter import MXNetAdapter
from adapters.mxnet.runtime import amp, mx, nd
from harness.neutral import datasets, models
from harness.plan.support import Conditions, unsupported
from tests.adapters import kit, scenarios

ROOT = Path(__file__).resolve().parents[2]
STEPS = (1, 10)


def configured(precision: str = "fp32", compile: str = "compiled") -> type[MXNetAdapter]:
    """The adapter class made with the worker's options (``RunOptions(precision=..., compile=...)``)."""
    return kit.configured(MXNetAdapter, precision=precision, compile=compile)


def _run(name: str, mode: str) -> tuple[np.ndarray, list[float], dict[int, dict[str, np.ndarray]], MXNetAdapter]:
    """One model in one mode: its test logits (digits CNN: canonical weights; block models: ``perturbed`` ones, every
    parameter and buffer away from its trivial start), then 10 SGD-momentum steps from there, the state kept before
    and after 1 and 10 steps."""
    if name == "digits":
        adapter, data, _ = kit.make(configured(compile=mode), optimizer=scenarios.SGD)
        batch = scenarios.BATCH
    else:
        model, cfg = scenarios.BLOCK_MODELS[name]
        info = models.analyze(model, *datasets.describe_input(cfg))
        adapter, data, _ = scenarios.make_on(configured(compile=mode), model, cfg,
                                             scenarios.BLOCK_OPTIMIZERS["sgd-momentum"], scenarios.perturbed(info))
        batch = 16
    logits = adapter.predict(data.x_test)
    losses, kept = kit.train_on(adapter, kit.batches(len(data.y_train), batch, max(STEPS)), keep=(0, *STEPS))
    return logits, losses, kept, adapter


@pytest.mark.parametrize("name", ["digits", *scenarios.BLOCK_MODELS])
def test_eager_trains_exactly_like_hybridized_in_fp32(name):
    """Logits, losses and every parameter and buffer after 1 and 10 steps within |a - b| <= 1e-5 + 1e-4 |b| (the
    equivalence tests' fp32 tolerance; observed on this CPU: the digits CNN and the decoder bit for bit, the ResNet
    within 2.4e-7 after 10 steps, as both modes run the same kernels), after training that moved the weights (by 0.5
    to 1.1); and the eager net really ran imperatively."""
    eager, hybrid = _run(name, "eager"), _run(name, "compiled")
    np.testing.assert_allclose(eager[0], hybrid[0], rtol=1e-4, atol=1e-5, err_msg="logits")
    np.testing.assert_allclose(eager[1], hybrid[1], rtol=1e-4, atol=1e-5, err_msg="losses")
    for step in STEPS:
        assert sorted(eager[2][step]) == sorted(hybrid[2][step])
        for key, value in hybrid[2][step].items():
            np.testing.assert_allclose(eager[2][step][key], value, rtol=1e-4, atol=1e-5, err_msg=f"{key} @ {step}")
    moved = max(float(np.abs(hybrid[2][10][k] - v).max()) for k, v in hybrid[2][0].items())
    assert moved > 1e-2, moved  # it trained: agreeing is not agreeing on the starting point
    eager_net, hybrid_net = eager[3].training.net, hybrid[3].training.net
    # Gluon's HybridBlock: hybridize() sets _active on the block and its children; the first forward pass of an
    # active block traces its cached symbolic graph (_cached_graph, () until then)
    assert not eager_net._active and eager_net._cached_graph == () and eager_net._cached_op is None
    assert not any(block._active for block in _blocks(eager_net))
    assert hybrid_net._active and hybrid_net._cached_graph != () and hybrid_net._cached_op is not None
    assert eager[3].settings().record()["hybridized"] is False and eager[3].settings().record()["hybridize"] == {}
    assert hybrid[3].settings().record()["hybridize"] == {"static_alloc": True, "static_shape": True}


def _blocks(block) -> list:
    """Every block under ``block`` (children, recursively)."""
    return [b for child in block._children.values() for b in (child, *_blocks(child))]


def test_settings_record_precision_amp_and_mode():
    for mode in ("eager", "compiled"):
        settings = kit.make(configured(compile=mode))[0].settings().record()
        assert {k: settings[k] for k in ("precision", "amp_target_dtype", "compile", "hybridized")} == {
            "precision": "fp32", "amp_target_dtype": "", "compile": mode, "hybridized": mode == "compiled"}
        assert "loss_scale" not in settings  # fp16 only
    plain = kit.make(MXNetAdapter)[0]  # options left empty: fp32, hybridized (the declaration's default mode)
    assert plain.settings().precision == "fp32" and plain.training.net._active


def test_what_it_cannot_run_is_refused_with_a_reason():
    """The plan's rule (``harness.plan.support.unsupported``, from the declaration) refuses fp16 on the CPU, tf32 and
    bf16 with the reasons MXNet 1.9.1 gives, and synchronised batchnorm in fp16 (the declaration's ``Limit``: MXNet's
    SyncBatchNorm "does not support FP16 training"); the adapter itself does not re-check."""
    assert MXNetAdapter().mode == "compiled"
    kit.check_execution_declared("mxnet", [("fp32", "eager", "cpu"), ("fp16", "default", "cuda:0")], {
        ("fp16", "default", "cpu"): "the mxnet adapter does not train in fp16 on cpu (only on cuda): fp16 with "
                                    "dynamic loss scaling is declared for CUDA GPUs only",
        ("tf32", "default", "cuda"): "the mxnet adapter does not train in tf32 on cuda: MXNet 1.9.1 has no TF32 "
                                     "switch; its fp32 on a GPU runs with NVIDIA_TF32_OVERRIDE=0",
        ("bf16", "default", "cpu"): "the mxnet adapter does not train in bf16 on cpu: MXNet 1.9.1 has bfloat16 "
                                    "convolution and dense kernels only in oneDNN, which creates them on AVX-512 CPUs "
                                    "only"})
    record, info = adapters.BUILTIN["mxnet"], kit.digits()[1]
    why = unsupported(record, info, Conditions("bf16", "default", "cpu"))
    assert "'could not create a primitive descriptor iterator'" in why
    assert "'dot only supports float32/float64 for CPU'" in why
    with_norm = kit.digits(kit.NORM_CNN)[1]
    fp16_sync = unsupported(record, with_norm,
                            Conditions("fp16", "default", "cuda:0", data_parallel=2, sync_batchnorm=True))
    assert fp16_sync == ("the mxnet adapter has no synchronised batchnorm in fp16: MXNet 1.9.1's SyncBatchNorm "
                         "'does not support FP16 training'")
    assert unsupported(record, with_norm,
                       Conditions("fp32", "default", "cuda:0", data_parallel=2, sync_batchnorm=True)) is None
    assert unsupported(record, with_norm,
                       Conditions("fp16", "default", "cuda:0", data_parallel=2)) is None  # per device: fine
    assert unsupported(record, info,
                       Conditions("fp16", "default", "cuda:0", data_parallel=2, sync_batchnorm=True)) is None


def _avx512() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512" in flags


def test_bf16_fails_in_mxnet_itself_as_the_reason_says():
    """The evidence behind the bf16 reason, without AMP's process-wide patching: the operators AMP would run in
    bfloat16, given bfloat16 inputs (``amp_cast``, https://mxnet.apache.org/versions/1.9.1/api/python/docs/api/
    ndarray/ndarray.html#mxnet.ndarray.amp_cast). A convolution and a dense layer fail in oneDNN on a CPU without
    AVX-512 (this machine's kind; asserted only there), ``batch_dot`` on every CPU."""
    bf16 = amp.amp.bfloat16
    x = nd.amp_cast(nd.ones((2, 3, 8, 8)), dtype=bf16)
    w = nd.amp_cast(nd.ones((4, 3, 3, 3)), dtype=bf16)
    assert x.dtype == bf16  # the cast itself works: the kernels are what is missing
    if not _avx512():
        with pytest.raises(mx.base.MXNetError, match="could not create a primitive descriptor iterator"):
            nd.Convolution(x, w, no_bias=True, kernel=(3, 3), num_filter=4).wait_to_read()
        with pytest.raises(mx.base.MXNetError, match="could not create a primitive descriptor iterator"):
            nd.FullyConnected(nd.amp_cast(nd.ones((2, 12)), dtype=bf16), nd.amp_cast(nd.ones((5, 12)), dtype=bf16),
                              no_bias=True, num_hidden=5).wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="dot only supports float32/float64 for CPU"):
        nd.batch_dot(nd.amp_cast(nd.ones((2, 3, 4)), dtype=bf16), nd.amp_cast(nd.ones((2, 4, 5)), dtype=bf16),
                     ).wait_to_read()


# amp.init rewrites mx.nd's and mx.sym's operators for the rest of the process, so this runs in its own process. fp16
# is declared on CUDA only: the plan refuses it on the CPU, and the adapter, which does not re-check, runs it here.
_FP16_PLUMBING = """
import json
from adapters.mxnet.adapter import MXNetAdapter  # adapters.mxnet first: it makes mxnet importable on this numpy
from adapters.mxnet.runtime import mx
from tests.adapters import kit
out = {}
for mode in ("eager", "compiled"):
    adapter, data, _ = kit.make(kit.configured(MXNetAdapter, precision="fp16", compile=mode))
    settings = adapter.settings().record()
    grads = [p.grad().dtype.__name__ for p in adapter.training.params.values() if p.grad_req != "null"]
    weights = sorted({w.dtype.name for w in adapter.get_weights().values()})
    try:
        kit.step(adapter, kit.batches(len(data.y_train), 32, 1)[0])
        adapter.read_loss()
        error = ""
    except mx.base.MXNetError as exc:
        error = str(exc)
    out[mode] = {"settings": {k: settings.get(k) for k in ("amp_target_dtype", "loss_scale", "loss_scaling")},
                 "scaled": adapter.training.trainer._scale, "grads": sorted(set(grads)), "weights": weights,
                 "error": error}
try:
    kit.make(MXNetAdapter)
    out["fp32_after"] = ""
except RuntimeError as exc:
    out["fp32_after"] = str(exc)
print("RESULT" + json.dumps(out))
"""


def test_fp16_amp_is_wired_in_as_far_as_a_cpu_runs_it():
    """fp16 in both modes, forced onto the CPU in a child process: AMP is initialised (float16 target, the loss scale
    2^16 recorded), parameters and their gradients stay float32, ``amp.scale_loss`` set the Trainer's rescaling to
    1 / 2^16, and the float16 casts really are in the net: MXNet then stops in its float16 CPU kernels, which it does
    not have (the reason fp16 is declared on CUDA only). An fp32 trial afterwards in the same process is refused."""
    proc = subprocess.run([sys.executable, "-c", _FP16_PLUMBING], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    for mode in ("eager", "compiled"):
        got = out[mode]
        assert got["settings"]["amp_target_dtype"] == "float16" and got["settings"]["loss_scale"] == 2.0 ** 16
        assert got["settings"]["loss_scaling"].startswith("dynamic")
        assert got["grads"] == ["float32"] and got["weights"] == ["float32"], got
        assert got["scaled"] == pytest.approx(2.0 ** -16), got  # amp.scale_loss ran in train_step
        assert "FP16 gemm on cpu not implemented" in got["error"], got["error"][-500:]
    assert "AMP was initialised for float16 in this process" in out["fp32_after"]
