"""The memory breakdown of a training step, by data structure, against numbers computed by hand."""

from __future__ import annotations

import pytest

from harness.neutral import memory, models
from harness.neutral.models import Input
from harness.spec import ModelSpec, OptimizerSpec
from tests.adapters.kit import CNN

SGD_MOMENTUM = OptimizerSpec(name="sgd", learning_rate=0.1, momentum=0.9)
FLOAT = 4  # bytes of a float32
INT64 = 8  # bytes of an int64

# The kit's CNN on 8x8x1 digits: conv 3x3 same 32 relu -> maxpool 2 -> flatten -> dense 128 relu -> dense 10.
# Parameters: conv 32 x 9 + 32 = 320; dense 512 x 128 + 128 = 65,664; dense 128 x 10 + 10 = 1,290: 67,274.
CNN_PARAMS = 67_274
# Saved per sample: the input image 64 floats (kept by the conv); the conv's relu output 32 x 8 x 8 = 2,048 floats
# (kept by the relu, and by the max pool as its input: once); the pool's argmax 32 x 4 x 4 = 512 int64; the pool's
# output 512 floats (flatten is a view; kept by dense 1 as its input); dense 1's relu output 128 floats (kept once,
# also dense 2's input); the log-softmax of the 10 logits; the int64 label.
CNN_PER_SAMPLE = 64 * FLOAT + 2048 * FLOAT + 512 * INT64 + 512 * FLOAT + 128 * FLOAT + 10 * FLOAT + 1 * INT64


def test_the_kit_cnn_by_hand():
    info = models.analyze(CNN, (8, 8, 1), 10)
    assert info.parameter_count == CNN_PARAMS
    m = memory.predict(info, 32, SGD_MOMENTUM)
    assert CNN_PER_SAMPLE == 15_152
    assert (m.parameters, m.gradients, m.optimizer_state) == (CNN_PARAMS * FLOAT,) * 3  # momentum: one buffer
    assert (m.buffers, m.accumulator) == (0, 0)
    assert m.activations_per_sample == CNN_PER_SAMPLE and m.activations == 32 * CNN_PER_SAMPLE
    assert m.total == 3 * CNN_PARAMS * FLOAT + 32 * CNN_PER_SAMPLE == 1_292_152
    assert sum(t.bytes_per_sample for t in m.saved) == CNN_PER_SAMPLE
    assert [(t.layer, t.what) for t in m.saved][:3] == [("0", "input"), ("0", "relu output"),
                                                         ("1", "argmax indices (int64)")]


def test_optimizers_accumulation_and_dtype():
    info = models.analyze(CNN, (8, 8, 1), 10)
    assert memory.predict(info, 8, OptimizerSpec(name="adam")).optimizer_state == 2 * CNN_PARAMS * FLOAT
    assert memory.predict(info, 8, OptimizerSpec(name="sgd")).optimizer_state == 0  # no momentum, no state
    one, four = memory.predict(info, 16, SGD_MOMENTUM), memory.predict(info, 16, SGD_MOMENTUM, accumulation_steps=4)
    # one micro-batch of 16 alive at a time: the same activations; an accumulator the size of the gradients
    assert four.activations == one.activations and four.accumulator == CNN_PARAMS * FLOAT
    assert four.total == one.total + CNN_PARAMS * FLOAT
    half = memory.predict(info, 1, SGD_MOMENTUM, dtype_bytes=2)
    assert half.parameters == CNN_PARAMS * 2
    # float tensors halve, the int64 argmax and label do not
    assert half.activations_per_sample == (64 + 2048 + 512 + 128 + 10) * 2 + (512 + 1) * INT64
    with pytest.raises(ValueError):
        memory.predict(info, 0, SGD_MOMENTUM)


def test_batchnorm_dropout_and_a_projection_block_by_hand():
    spec = ModelSpec.model_validate({"layers": [
        {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1, "use_bias": False},
        {"type": "batchnorm"}, {"type": "relu"},
        {"type": "residual", "activation": "relu", "body": [
            {"type": "conv2d", "filters": 8, "kernel_size": 3, "stride": 2, "padding": 1, "use_bias": False},
            {"type": "batchnorm"}]},
        {"type": "global_avgpool2d"}, {"type": "dropout", "rate": 0.5}, {"type": "dense", "units": 10}]})
    info = models.analyze(spec, (8, 8, 1), 10)
    # conv 4 x 9; bn 8; body conv 8 x 4 x 9 = 288; bn 16; projection 8 x 4 = 32; its bn 16; dense 90
    assert info.parameter_count == 36 + 8 + 288 + 16 + 32 + 16 + 90
    m = memory.predict(info, 10, OptimizerSpec(name="adam"))
    assert m.buffers == 2 * (4 + 8 + 8) * FLOAT  # the running mean and variance of three batchnorms
    # Saved per sample (floats): the image 64 (conv); the conv's output 4 x 8 x 8 = 256 (batchnorm's input); the
    # relu's output 256 (kept by the relu, the body's conv and the projection: once); the body conv's output
    # 8 x 4 x 4 = 128 (its batchnorm's input); the projection's output 128 (its batchnorm's input); the relu after
    # the addition 128; the pooled 8 values are not kept (dropout keeps its mask, 8 bytes), dropout's output 8
    # (the dense layer's input); the log-softmax 10; and the int64 label.
    floats = 64 + 256 + 256 + 128 + 128 + 128 + 8 + 10
    assert m.activations_per_sample == floats * FLOAT + 8 * 1 + INT64
    assert m.total == info.parameter_count * FLOAT * 4 + m.buffers + 10 * m.activations_per_sample  # adam: 2 states


def test_a_decoder_by_hand():
    length, width, heads, vocab = 8, 16, 2, 10
    spec = ModelSpec.model_validate({"layers": [
        {"type": "embedding", "vocab": vocab, "dim": width},
        {"type": "residual", "body": [{"type": "layernorm"}, {"type": "attention", "heads": heads, "causal": True}]},
        {"type": "layernorm"}, {"type": "dense", "units": vocab}]})
    info = models.analyze(spec, Input.tokens(length, vocab, per_position=True), vocab)
    seq = length * width  # one (L, D) activation: 128 values
    per_sample = (length * INT64  # the token ids (the embedding's backward)
                  + seq * FLOAT + 2 * length * FLOAT  # layernorm: its input (the embedding's output), row mean, rstd
                  + seq * FLOAT  # attention's input (the layernorm's output)
                  + 3 * seq * FLOAT  # q, k, v
                  + heads * length * length * FLOAT  # the softmax probabilities
                  + seq * FLOAT  # the context
                  + seq * FLOAT + 2 * length * FLOAT  # the final layernorm: the residual sum and its row statistics
                  + seq * FLOAT  # the dense head's input
                  + length * vocab * FLOAT  # the log-softmax of (L, vocab) logits
                  + length * INT64)  # one int64 label per position
    assert per_sample == 5_184
    m = memory.predict(info, 3, OptimizerSpec(name="sgd", momentum=0.5))
    assert m.activations_per_sample == per_sample and m.activations == 3 * per_sample
    whats = [t.what for t in m.saved]
    assert "softmax probabilities" in whats and "token ids" in whats and "labels (int64)" in whats
    # a fused kernel keeps one float32 log-sum-exp per head and query instead of the probabilities
    fused = memory.predict(info, 3, OptimizerSpec(name="sgd"), attention="fused")
    assert fused.attention == "fused" and m.attention == "unfused"
    assert fused.activations_per_sample == per_sample - heads * length * length * FLOAT + heads * length * FLOAT
    assert "log-sum-exp per head and query (float32)" in [t.what for t in fused.saved]
    with pytest.raises(ValueError):
        memory.predict(info, 3, OptimizerSpec(name="sgd"), attention="flash")


def test_the_prediction_against_a_measured_peak_on_the_cpu(tmp_path):
    """PyTorch on the CPU trains the small ResNet at batch 16 and 128 in real workers; the resident memory's growth
    between the two (the interpreter and the libraries cancel out) is compared with the predicted growth, which is
    the activations' alone. Observed on the development machine (2-core VM, torch 2.13 CPU, one run): predicted
    +73 MB (11.4 -> 84.3 MB), measured +188 MB of RSS (418 -> 606 MB), 2.6 x: PyTorch also holds the backward
    pass's temporaries (the gradients flowing back, about the size of the largest activations) and the blocks its
    CPU allocator keeps, on top of what the model keeps; the test allows 1 to 4 x."""
    import yaml

    from harness.plan import checked_spec
    from harness.results import store
    from harness.spec import ROOT
    from harness.studies.sweep import run_spec

    data = yaml.safe_load((ROOT / "specs" / "resnet_small.yaml").read_text())
    data.update({"frameworks": ["pytorch"], "batch_sizes": [16, 128], "epochs": 1, "cpu_threads": 1})
    run_dir = run_spec(checked_spec(data, tmp_path / "resnet_small.yaml"), tmp_path / "runs")
    records = {r.batch_size: r for r in store.read_trials(run_dir)}
    assert {r.status for r in records.values()} == {"ok"}
    predicted = {bs: r.metrics.memory_predicted for bs, r in records.items()}
    from harness.results import derived

    # the report's memory figure on the CPU: the peak anonymous resident memory (heap, not mapped library code)
    rss = {bs: derived.peak_memory_bytes(r) for bs, r in records.items()}
    assert all(r.sampler.stat("rss_anon_bytes", "max") == rss[bs] for bs, r in records.items())
    grown_predicted = predicted[128].total_bytes - predicted[16].total_bytes
    assert grown_predicted == predicted[16].activations_per_sample_bytes * 112  # only the activations grow
    grown_measured = rss[128] - rss[16]
    assert grown_predicted <= grown_measured <= 4 * grown_predicted, (grown_predicted / 1e6, grown_measured / 1e6)
    # the report's section: the predicted parts, the measured peak and the growth ratio that cancels the runtime
    from tests.helpers import report_text

    text = report_text(run_dir)
    section = text[text.index("## Memory by data structure (MB)"):]
    section = section[:section.index("\n## ", 5)]
    totals = [predicted[bs].total_bytes / 1e6 for bs in (16, 128)]
    assert f"| total predicted | {totals[0]:.2f} | {totals[1]:.2f} |" in section
    assert f"| PyTorch measured | {rss[16] / 1e6:.2f} | {rss[128] / 1e6:.2f} |" in section
    ratio = grown_measured / grown_predicted
    assert f"| PyTorch growth from batch 16, measured / predicted |  | {ratio:.2f} x |" in section, section
