"""``Adapter.gradient_norms`` of one framework, in a fresh interpreter of that framework's environment; the
cross-framework test (tests/adapters/test_gradient_norms.py) runs it per framework and compares what it saved.

    python -m tests.adapters.gradient_norms_run FRAMEWORK OUT.json

On digits, one thread, seed 0, the canonical initial weights, for each model of ``MODELS`` (softmax regression, the
CNN of tests/adapters/kit.py, a CNN with batchnorm and one with dropout): after ``STEPS_BEFORE`` SGD steps of 32 (so
that the norms are not taken at the initial weights alone), the norms of the next 64 samples of the epoch order split
into 4 and into 8 micro-batches; then what must not have changed (parameters, buffers, the loss sum: a step after the
norms trains as it would have without them). Saves JSON: model -> {"k4": [[|g_i|^2...], |G|^2], "k8": ...,
"changed": [names of parameters or buffers that differ from before the norms], "loss_after": the next step's
loss, "loss_without": the same step's loss in a second adapter that took no norms, "refusals": {case: message}}.
"""

from __future__ import annotations

import json
import sys

#: name -> the layers of a neutral model on 8x8x1 digits (10 classes).
MODELS = {
    "softmax": [{"type": "flatten"}, {"type": "dense", "units": 10}],
    "cnn": None,  # tests/adapters/kit.py's CNN
    "batchnorm": [{"type": "conv2d", "filters": 8, "kernel_size": 3, "padding": "same"}, {"type": "batchnorm"},
                  {"type": "relu"}, {"type": "maxpool2d", "pool_size": 2}, {"type": "flatten"},
                  {"type": "dense", "units": 10}],
    "dropout": [{"type": "flatten"}, {"type": "dense", "units": 32, "activation": "relu"}, {"type": "dropout",
                                                                                         "rate": 0.5},
                {"type": "dense", "units": 10}],
}
STEPS_BEFORE, STEP, SAMPLES = 3, 32, 64


def _state(adapter):
    return {**adapter.get_weights(), **{f"buffer:{k}": v for k, v in adapter.get_buffers().items()}}


def run(framework: str) -> dict:
    import numpy as np

    import adapters
    from harness.neutral import datasets
    from harness.spec import ModelSpec
    from tests.adapters import kit

    out = {}
    for name, layers in MODELS.items():
        model = kit.CNN if layers is None else ModelSpec.model_validate({"layers": layers})
        made = [kit.make(adapters.get(framework), threads=1, model=model)[0] for _ in range(2)]
        data, _ = kit.digits(model)
        order = datasets.epoch_order(len(data.y_train), 0, 0)
        for adapter in made:
            for batch in adapter.batches(order[:STEPS_BEFORE * STEP], STEP, 0):
                adapter.train_step(batch)
        probe = order[STEPS_BEFORE * STEP:STEPS_BEFORE * STEP + SAMPLES]
        adapter, plain = made
        before = _state(adapter)
        entry: dict = {}
        for k in (4, 8):
            (batch,) = adapter.batches(probe, SAMPLES, 1)
            small, big = adapter.gradient_norms(batch, k)
            entry[f"k{k}"] = [[float(x) for x in small], float(big)]
        after = _state(adapter)
        entry["changed"] = sorted(key for key in before if not np.array_equal(before[key], after[key]))
        nxt = order[STEPS_BEFORE * STEP + SAMPLES:STEPS_BEFORE * STEP + SAMPLES + STEP]
        for each in made:
            kit.step(each, nxt, epoch=1)
        entry["loss_after"], entry["loss_without"] = adapter.read_loss()[0], plain.read_loss()[0]
        refusals = {}
        for case, k in (("one", 1), ("indivisible", 3)):
            (batch,) = adapter.batches(probe, SAMPLES, 1)
            try:
                adapter.gradient_norms(batch, k)
                refusals[case] = None
            except ValueError as err:
                refusals[case] = str(err)
        entry["refusals"] = refusals
        entry["weights"] = {key: value.tolist() for key, value in before.items()} if name == "softmax" else None
        out[name] = entry
    return out


def main(argv: list[str]) -> int:
    framework, path = argv
    with open(path, "w", encoding="utf-8") as f:
        json.dump(run(framework), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
