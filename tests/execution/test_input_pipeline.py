"""Loader mode through the whole harness (``input: loader``): the spec's field and variant, an image folder read from
disk by every framework's own loader against the same folder resident, the input wait the loop times, what cannot run
(before any worker starts, or in the worker for an adapter without a loader), and the report's section."""

from __future__ import annotations

import pytest

from harness.neutral import image_folder
from harness.plan import checked_spec, plan, variants
from harness.results import report, store
from harness.studies import sweep
from tests.helpers import ROOT, base_spec

#: The frameworks whose loader trains on the image folder here (JAX in its own environment, envs/jax).
FRAMEWORKS = [{"name": "pytorch"}, {"name": "tensorflow"}, {"name": "mxnet"},
              {"name": "jax", "python": str(ROOT / "envs" / "jax" / "bin" / "python")}]

LAYERS = [{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "activation": "relu"},
          {"type": "maxpool2d", "pool_size": 2}, {"type": "flatten"}, {"type": "dense", "units": 3}]


def test_the_field_and_the_variant(tmp_path):
    spec = checked_spec(base_spec(variants={"input": ["resident", "loader"]}, loader={"workers": 3, "prefetch": 4}),
                        tmp_path / "s.yaml")
    assert [v.label for v in variants(spec)] == ["resident", "loader"]
    trials = plan(spec, "cpu")
    assert [(t.id, t.input) for t in trials] == [("pytorch-bs32-r0-v0", "resident"), ("pytorch-bs32-r0-v1", "loader")]
    assert trials[1].loader.workers == 3 and trials[1].loader.prefetch == 4
    assert plan(checked_spec(base_spec(), tmp_path / "t.yaml"), "cpu")[0].input == "resident"  # the default


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """An image folder of 3 classes x 30 JPEGs (16 x 20, resized to 12 x 12), augmented, trained 2 epochs at batch 8
    by each of ``FRAMEWORKS`` resident and through its loader (1 worker): the run directory."""
    tmp = tmp_path_factory.mktemp("loader")
    image_folder.make_image_folder(tmp / "images", classes=3, per_class=30, size=(16, 20), seed=1)
    spec = checked_spec(base_spec(
        name="loader", frameworks=FRAMEWORKS, model={"layers": LAYERS}, batch_sizes=[8], epochs=2, warmup_steps=1,
        augmentation=True, loader={"workers": 1, "prefetch": 2}, variants={"input": ["resident", "loader"]},
        dataset={"name": "image_folder", "path": str(tmp / "images"), "size": [12, 12],
                 "cache_dir": str(tmp / "cache")}), tmp / "s.yaml")
    image_folder.prepare(spec.dataset)  # what `harness run` does before the first trial
    run_dir = sweep.run_spec(spec, tmp / "runs")
    report.write(run_dir)
    return run_dir


def test_every_loader_trains_on_the_same_images_as_resident_mode(folder_run):
    records = store.read_trials(folder_run)
    assert all(r.status == "ok" for r in records), [(r.id, r.reason) for r in records]
    losses = {}
    for record in records:
        metrics = record.metrics
        losses[(record.framework, metrics.input)] = [e.train_loss for e in metrics.epochs]
        if metrics.input == "loader":
            assert metrics.input_wait_s > 0 and 0 < metrics.input_wait_share < 1
            loader = record.settings["loader"]
            assert loader["source"] == "files", loader
        else:
            assert metrics.input_wait_s == 0 and record.settings["loader"] is None
    for entry in FRAMEWORKS:
        name = entry["name"]
        resident, loader = losses[(name, "resident")], losses[(name, "loader")]
        assert len(resident) == 2
        for a, b in zip(loader, resident):
            assert abs(a - b) <= 1e-5 * abs(b), (name, loader, resident)
    everyone = [value for (_, mode), values in losses.items() for value in values[-1:]]
    assert max(everyone) - min(everyone) <= 1e-3 * max(everyone), losses


def test_a_loader_worker_holds_no_decoded_training_image(folder_run):
    """Through a loader the training images are read from their files only: the worker holds the test set and the
    labels (``data_bytes``), not a decoded copy of the training set beside them as resident mode does."""
    held = {(r.framework, r.metrics.input): r.metrics.data_bytes for r in store.read_trials(folder_run)}
    image = 12 * 12 * 3 * 4  # float32 12 x 12 RGB
    for entry in FRAMEWORKS:
        resident, loader = held[(entry["name"], "resident")], held[(entry["name"], "loader")]
        train_images, rest = divmod(resident - loader, image)
        assert rest == 0 and 60 <= train_images < 90, (resident, loader)  # the training part of 3 x 30 images


def test_the_report_sets_the_modes_side_by_side(folder_run):
    text = (folder_run / "report.md").read_text()
    section = text[text.index("## Input pipeline"):]
    section = section[:section.index("\n## ", 1)]
    assert "| PyTorch | resident |" in section and "| PyTorch | loader |" in section
    assert "| PyTorch | input wait % (loader) |" in section and "| PyTorch | loader / resident |" in section
    assert "torch.utils.data.DataLoader (num_workers 1, prefetch_factor 2" in section
    for loader in ("tf.data.Dataset", "mxnet.gluon.data.DataLoader", "grain.MapDataset"):
        assert loader in section, loader
    assert "CPU use" in section  # the utilization of both modes
    assert "Input pipeline" in (folder_run / "report.html").read_text()


def test_what_cannot_run_a_loader_is_unsupported_with_the_reason(fault_adapter, monkeypatch, tmp_path):
    """Before any worker: loader mode with data parallelism. In the worker: an adapter without a loader mode (the
    fault adapter, not built in: its worker decides)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    spec = checked_spec(base_spec(frameworks=["pytorch", fault_adapter], batch_sizes=[16], input="loader",
                                  variants={"data_parallel": [1, 2]}), tmp_path / "s.yaml")
    records = {r.id: r for r in store.read_trials(sweep.run_spec(spec, tmp_path / "runs"))}
    assert records["pytorch-bs16-r0-v1-dp2"].status == "unsupported"
    assert records["pytorch-bs16-r0-v1-dp2"].reason == (
        "not run: input: loader is not combined with data parallelism yet (each device would need its own shard)")
    assert records["fault-bs16-r0-v0"].status == "unsupported"
    assert records["fault-bs16-r0-v0"].reason == "the fault adapter has no data loader mode (input: loader)"
    assert records["pytorch-bs16-r0-v0"].status == "ok"
    assert records["pytorch-bs16-r0-v0"].metrics.input == "loader"


def test_a_spec_brings_its_own_image_folder(write_spec, tmp_path):
    """``dataset.generate``: the command writes the folder before checking the spec when nothing is at ``path``,
    then decodes it into the cache; a folder that exists is left as it is."""
    from harness.cli.common import load_spec

    path = write_spec(base_spec(model={"layers": LAYERS}, dataset={
        "name": "image_folder", "path": "made", "size": [8, 8], "cache_dir": "cache",
        "generate": {"classes": 3, "per_class": 5, "size": [10, 12], "seed": 2}}))
    spec = load_spec(path)
    files = sorted((tmp_path / "made").rglob("*.jpg"))
    assert len(files) == 15 and sorted({f.parent.name for f in files}) == ["class_0", "class_1", "class_2"]
    assert spec.dataset.path == tmp_path / "made" and list((tmp_path / "cache" / "image_folder").glob("*.npz"))
    files[0].unlink()
    load_spec(path)  # exists: not written again
    assert len(sorted((tmp_path / "made").rglob("*.jpg"))) == 14


@pytest.mark.parametrize("name", ["loader.yaml", "loader_gpu.yaml"])
def test_the_shipped_loader_specs(name):
    from harness import spec as spec_module

    spec = spec_module.load(ROOT / "specs" / name)  # read only: its folder is written on first use
    assert spec.dataset.name == "image_folder" and spec.dataset.generate is not None
    assert spec.variants.input == ["resident", "loader"] and spec.augmentation
    assert {entry.name for entry in spec.entries} == {"pytorch", "tensorflow", "mxnet", "jax"}
    assert spec.model.layers[-1].units == spec.dataset.generate.classes
