"""Spec validation: every bad spec is one SpecError naming the file and the field (what the command line prints
in one line before exiting 2: tests/cli/test_run.py)."""

from __future__ import annotations

import pytest

from harness import plan as spec_module
from harness.spec import SpecError
from tests.helpers import ROOT, base_spec


def error_of(write_spec, data):
    path = write_spec(data)
    with pytest.raises(SpecError) as info:
        spec_module.load(path)
    return path, str(info.value)


def test_shipped_specs_are_valid(tmp_path, monkeypatch):
    quick = spec_module.load(ROOT / "specs" / "quick.yaml")
    assert [e.name for e in quick.entries] == ["pytorch", "tensorflow", "mxnet", "jax"]
    assert quick.batch_sizes == [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    # cnn.yaml needs the CIFAR-10 archive: with one in the cache folder it validates.
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"placeholder")
    monkeypatch.setenv("HARNESS_DATA", str(tmp_path))
    cnn = spec_module.load(ROOT / "specs" / "cnn.yaml")
    assert cnn.dataset.name == "cifar10" and cnn.epochs == 10
    resnet18 = spec_module.load(ROOT / "specs" / "resnet18.yaml")
    assert spec_module.model_info(resnet18).parameter_count == 11_173_962  # by hand in tests/test_blocks.py
    small = spec_module.load(ROOT / "specs" / "resnet_small.yaml")
    assert small.dataset.name == "synthetic" and spec_module.model_info(small).layers[5].shortcut
    for name in ("transformer_small.yaml", "transformer.yaml", "advise_copy.yaml"):
        decoder = spec_module.load(ROOT / "specs" / name)
        assert decoder.dataset.name == "synthetic_tokens" and spec_module.model_info(decoder).task == "next_token"
    # advise_copy.yaml is transformer_small.yaml's decoder under a learning-rate rule and a target
    copy, small = (spec_module.load(ROOT / "specs" / f) for f in ("advise_copy.yaml", "transformer_small.yaml"))
    assert copy.model == small.model and copy.dataset == small.dataset
    assert (copy.learning_rate_scaling, copy.base_batch_size, copy.target_accuracy) == ("sqrt", 64, 0.55)


@pytest.mark.parametrize("change, field, words", [
    ({"epochs": "ten"}, "epochs", "valid integer"),
    ({"batch_sizes": []}, "batch_sizes", "at least 1"),
    ({"batch_sizes": [32, -4]}, "batch_sizes.1", "greater than 0"),
    ({"batch_sizes": [32, 32]}, "batch_sizes", "listed twice"),
    ({"frameworks": ["pytorch", "caffe"]}, "frameworks", "unknown framework 'caffe'"),
    ({"frameworks": []}, "frameworks", "at least 1"),
    ({"frameworks": [{"name": "keras", "backend": "mxnet"}]}, "frameworks.0.backend",
     "keras has no backend 'mxnet'; expected one of jax, torch, tensorflow"),
    ({"frameworks": ["keras"]}, "frameworks.0", "keras runs on a backend: write {name: keras, backend: jax}"),
    ({"frameworks": [{"name": "pytorch", "backend": "jax"}]}, "frameworks.0.backend",
     "pytorch takes no backend (only keras does); remove it"),
    ({"frameworks": [{"name": "keras", "backend": "JAX!"}]}, "frameworks.0.backend", "should match pattern"),
    ({"epoch": 3}, "epoch", "unknown field"),
    ({"device": "gpu"}, "device", "'auto', 'cpu' or 'cuda:N'"),
    ({"optimizer": {"name": "rmsprop"}}, "optimizer.name", "'sgd' or 'adam'"),
    ({"optimizer": {"name": "sgd", "lr": 0.1}}, "optimizer.lr", "unknown field"),
    ({"model": {"layers": [{"type": "dense", "units": 10}]}}, "model.layers.0", "add a flatten layer"),
    ({"model": {"layers": [{"type": "conv2d", "filters": 0, "kernel_size": 3}]}},
     "model.layers.0.conv2d.filters", "greater than 0"),
    ({"model": {"layers": [{"type": "flatten"}, {"type": "dense", "units": 7}]}}, "model.layers.1", "10 classes"),
    ({"dataset": {"name": "imagenet"}}, "dataset", "digits"),
    ({"model": {"layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "stride": 2, "padding": "same"}]}},
     "model.layers.0.conv2d", "give an integer padding instead, e.g. padding: 1"),
    ({"model": {"layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": -1}]}},
     "model.layers.0.conv2d.padding", "a non-negative integer"),
    ({"model": {"layers": [{"type": "residual", "body": [{"type": "residual", "body": [{"type": "relu"}]}]}]}},
     "model.layers.0.residual.body.0", "does not match any of the expected tags"),
    ({"model": {"layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3}, {"type": "residual", "body": [
        {"type": "conv2d", "filters": 8, "kernel_size": 3, "stride": 2, "padding": 1}], "shortcut": "identity"},
        {"type": "flatten"}, {"type": "dense", "units": 10}]}},
     "model.layers.1.body", "the body changes (4, 6, 6) to (8, 3, 3) and shortcut is identity"),
    ({"dataset": {"name": "synthetic_tokens", "length": 9}}, "dataset.synthetic_tokens", "even length"),
    ({"precision": "fp8"}, "precision", "'fp32', 'tf32', 'bf16' or 'fp16'"),
    ({"compile": "maybe"}, "compile", "'default', 'eager' or 'compiled'"),
    ({"variants": {"precision": ["fp32", "int8"]}}, "variants.precision.1", "'fp32', 'tf32', 'bf16' or 'fp16'"),
    ({"dataset": {"name": "synthetic_tokens", "vocab": 10, "length": 4}, "augmentation": True,
      "model": {"layers": [{"type": "embedding", "vocab": 10, "dim": 4}, {"type": "dense", "units": 10}]}},
     "augmentation", "needs an image dataset"),
])
def test_invalid_field_is_one_line_naming_file_and_field(write_spec, change, field, words):
    path, message = error_of(write_spec, base_spec(**change))
    assert message.startswith(f"{path}: {field}: "), message
    assert words in message
    assert "\n" not in message


def test_missing_cifar10_archive_says_where_to_put_it(write_spec, tmp_path):
    path, message = error_of(write_spec, base_spec(dataset={"name": "cifar10", "cache_dir": str(tmp_path / "none")}))
    assert message.startswith(f"{path}: dataset.path: no CIFAR-10 archive at {tmp_path / 'none'}")
    assert "cifar-10-python.tar.gz" in message and "never downloads" in message


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(SpecError, match=r"missing\.yaml: cannot read the spec"):
        spec_module.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match=r"bad\.yaml: invalid YAML at line 2"):
        spec_module.load(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(SpecError, match="must be a YAML mapping"):
        spec_module.load(scalar)


def test_overrides_are_validated_like_the_file(write_spec):
    path = write_spec(base_spec())
    spec = spec_module.load(path, {"batch_sizes": [8, 16], "frameworks": None})
    assert spec.batch_sizes == [8, 16] and spec.frameworks == ["pytorch"]
    with pytest.raises(SpecError, match=r": batch_sizes\.0: Input should be greater than 0"):
        spec_module.load(path, {"batch_sizes": [0]})


def test_a_keras_entry_names_its_backend_adapter(write_spec):
    """``{name: keras, backend: jax}`` is the adapter keras-jax (its label the user's, else that name), and says
    the same as ``{name: keras-jax}``; the trial's framework is that adapter."""
    from harness import plan

    spec = plan.load(write_spec(base_spec(frameworks=[
        {"name": "keras", "backend": "jax"}, {"name": "keras", "backend": "torch", "label": "kt"},
        "keras-tensorflow"])))
    assert [(e.name, e.row) for e in spec.entries] == [("keras-jax", "keras-jax"), ("keras-torch", "kt"),
                                                        ("keras-tensorflow", "keras-tensorflow")]
    assert {t.framework for t in plan.plan(spec, "cpu")} == {"keras-jax", "keras-torch", "keras-tensorflow"}
