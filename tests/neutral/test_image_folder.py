"""Image folders: real JPEG and PNG files written here with Pillow, read as the ``image_folder`` dataset (class
mapping, split, resize, cache, bad input), its plan-time checks and its spec fields."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from harness import plan
from harness.cli.common import load_spec
from harness.neutral import datasets, image_folder, inputs
from harness.neutral.datasets import DatasetError
from harness.spec import ImageFolderData, SpecError
from tests.helpers import ROOT, base_spec


def write_image(path, array, image_format=None):
    """Saves a uint8 (H, W, 3) or (H, W) array with Pillow; the format from the suffix unless given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, dtype=np.uint8)).save(path, format=image_format)
    return path


def solid(colour, size=(6, 8)):
    return np.broadcast_to(np.asarray(colour, dtype=np.uint8), (*size, 3)).copy()


def noisy(seed, size=(10, 14)):
    return np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)


def cfg_for(root, tmp_path, **options):
    return ImageFolderData(name="image_folder", path=root, cache_dir=tmp_path / "cache", **options)


def pillow_pixels(path, size=None, mode="RGB"):
    """What Pillow itself gives for a file: decoded, converted, resized (bilinear) to (height, width), / 255."""
    image = Image.open(path).convert(mode)
    if size is not None:
        image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.float32) / 255.0
    return array if array.ndim == 3 else array[..., None]


def test_classes_are_the_sorted_sub_folders_and_labels_follow_them(tmp_path):
    colours = {"zebra": (200, 10, 10), "ant": (10, 200, 10), "bee": (10, 10, 200)}
    for name, colour in colours.items():
        for i in range(5):
            write_image(tmp_path / "d" / name / f"{i}.png", solid(colour))
    (tmp_path / "d" / "ant" / "notes.txt").write_text("not an image")  # other files are ignored
    write_image(tmp_path / "d" / ".hidden" / "x.png", solid((1, 2, 3)))  # so are hidden folders
    cfg = cfg_for(tmp_path / "d", tmp_path, test_fraction=0.2)
    listing = image_folder.scan(cfg)
    assert listing.classes == ("ant", "bee", "zebra") and listing.layout == "fraction"
    data = datasets.load(cfg)
    assert data.num_classes == 3 and data.skipped_files == ()
    assert data.x_train.dtype == np.float32 and data.x_train.shape == (12, 6, 8, 3) and data.x_test.shape[0] == 3
    for x, y in ((data.x_train, data.y_train), (data.x_test, data.y_test)):
        for image, label in zip(x, y):
            expected = np.asarray(colours[listing.classes[label]], dtype=np.float32) / 255.0
            np.testing.assert_allclose(image[0, 0], expected, atol=1e-6)  # PNG: lossless
    assert datasets.describe(cfg) == ((6, 8, 3), 3)
    assert datasets.sample_bytes(cfg) == 4 * 6 * 8 * 3 + 8


def test_the_split_is_stratified_and_fixed_by_the_file_names_alone(tmp_path):
    for name in ("a", "b", "c"):
        for i in range(10):
            write_image(tmp_path / "d" / name / f"img{i:02d}.png", noisy(hash((name, i)) % 1000, (4, 4)))
    cfg = cfg_for(tmp_path / "d", tmp_path, test_fraction=0.3)
    first = image_folder.scan(cfg)
    assert [sum(1 for _, y in first.test if y == k) for k in range(3)] == [3, 3, 3]  # stratified: 30% of each
    assert {r for r, _ in first.train} | {r for r, _ in first.test} == {f"{n}/img{i:02d}.png" for n in "abc"
                                                                        for i in range(10)}
    assert not {r for r, _ in first.train} & {r for r, _ in first.test}
    # the same split for another copy of the folder (other path, other mtimes) and for every trial seed
    os.rename(tmp_path / "d", tmp_path / "moved")
    moved = image_folder.scan(cfg_for(tmp_path / "moved", tmp_path, test_fraction=0.3))
    assert moved.train == first.train and moved.test == first.test
    a = datasets.load(cfg_for(tmp_path / "moved", tmp_path, test_fraction=0.3), seed=1)
    b = datasets.load(cfg_for(tmp_path / "moved", tmp_path, test_fraction=0.3), seed=2)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    np.testing.assert_array_equal(np.bincount(a.y_test), [3, 3, 3])
    # another fraction picks another count, not another rule: the 3 chosen are among the 5 chosen
    five = image_folder.scan(cfg_for(tmp_path / "moved", tmp_path, test_fraction=0.5))
    assert set(moved.test) < set(five.test) and len(five.test) == 15
    # a class of one image keeps it for training
    write_image(tmp_path / "moved" / "d" / "only.png", noisy(0, (4, 4)))
    lonely = image_folder.scan(cfg_for(tmp_path / "moved", tmp_path, test_fraction=0.3))
    assert ("d/only.png", 3) in lonely.train


def test_train_and_test_folders_are_the_split(tmp_path):
    files = image_folder.make_image_folder(tmp_path / "d", classes=3, per_class=4, size=(12, 10), test_per_class=2,
                                           image_format="png")
    assert len(files) == 18
    cfg = cfg_for(tmp_path / "d", tmp_path, test_fraction=0.5)  # test_fraction does not apply
    listing = image_folder.scan(cfg)
    assert listing.layout == "folders" and listing.classes == ("class_0", "class_1", "class_2")
    assert all(r.startswith("train/") for r, _ in listing.train) and all(r.startswith("test/") for r, _ in listing.test)
    data = datasets.load(cfg)
    assert data.x_train.shape == (12, 12, 10, 3) and data.x_test.shape == (6, 12, 10, 3)
    np.testing.assert_array_equal(data.y_test, [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(data.x_test[0], pillow_pixels(tmp_path / "d/test/class_0/0_00000.png"))
    # a test set without one of the classes is fine; a test class that is not a training class is not
    for name in ("0_00000.png", "0_00001.png"):
        os.remove(tmp_path / "d/test/class_0" / name)
    os.rmdir(tmp_path / "d/test/class_0")
    assert datasets.load(cfg).y_test.tolist() == [1, 1, 2, 2]
    write_image(tmp_path / "d/test/class_9/x.png", noisy(1))
    with pytest.raises(DatasetError, match=r"test/class_9: test class 'class_9' has no folder in .*train") as info:
        image_folder.scan(cfg)
    assert info.value.field == "path"


def test_train_without_test_is_an_error(tmp_path):
    write_image(tmp_path / "d/train/cat/1.png", noisy(1))
    with pytest.raises(DatasetError, match=r"has train/ with sub-folders but no test/"):
        image_folder.scan(cfg_for(tmp_path / "d", tmp_path))


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
def test_pixels_equal_pillows_own_decode_and_bilinear_resize(tmp_path, suffix):
    for i, size in enumerate([(10, 14), (20, 9), (7, 7)]):
        write_image(tmp_path / "d" / "c0" / f"{i}{suffix}", noisy(i, size))
        write_image(tmp_path / "d" / "c1" / f"{i}{suffix}", noisy(10 + i, size))
    for channels, mode in ((3, "RGB"), (1, "L")):
        cfg = cfg_for(tmp_path / "d", tmp_path, size=(8, 12), channels=channels, test_fraction=0.34)
        listing = image_folder.scan(cfg)
        data = datasets.load(cfg)
        assert data.x_train.shape == (4, 8, 12, channels) and data.x_test.shape == (2, 8, 12, channels)
        for (rel, _), image in zip(listing.train + listing.test, np.concatenate([data.x_train, data.x_test])):
            np.testing.assert_array_equal(image, pillow_pixels(tmp_path / "d" / rel, (8, 12), mode))
        assert datasets.describe(cfg) == ((8, 12, channels), 2)


def test_without_size_every_image_keeps_its_size_and_must_share_it(tmp_path):
    for i in range(3):
        write_image(tmp_path / "d" / "c0" / f"{i}.jpg", noisy(i, (9, 13)))
        write_image(tmp_path / "d" / "c1" / f"{i}.jpg", noisy(5 + i, (9, 13)))
    cfg = cfg_for(tmp_path / "d", tmp_path)
    assert datasets.describe(cfg) == ((9, 13, 3), 2)
    data = datasets.load(cfg)
    np.testing.assert_array_equal(data.x_train[0], pillow_pixels(tmp_path / "d/c0/0.jpg"))
    write_image(tmp_path / "d" / "c1" / "odd.jpg", noisy(9, (9, 12)))
    with pytest.raises(DatasetError) as info:
        datasets.load(cfg)
    message = str(info.value)
    assert info.value.field == "size" and "\n" not in message
    assert message.startswith(f"{tmp_path / 'd'}: images of different sizes") and "c1/odd.jpg is 9x12" in message
    assert datasets.load(cfg_for(tmp_path / "d", tmp_path, size=(9, 13))).x_train.shape[1:] == (9, 13, 3)


def test_image_sizes_are_read_from_headers_alone(tmp_path):
    """describe and sample_bytes decode nothing: a file cut off after its header still gives its size (a decode of
    it fails), and so does a progressive JPEG or one with a long EXIF block before its frame header."""
    progressive = tmp_path / "d" / "c0" / "1.jpg"
    progressive.parent.mkdir(parents=True)
    Image.fromarray(noisy(3, (15, 16))).save(progressive, progressive=True, quality=80)
    with_exif = tmp_path / "d" / "c1" / "1.jpg"
    with_exif.parent.mkdir(parents=True)
    exif = Image.Exif()
    exif[0x010E] = "x" * 3000
    Image.fromarray(noisy(4, (15, 16))).save(with_exif, exif=exif)
    cut = tmp_path / "cut.jpg"
    Image.fromarray(noisy(5, (150, 160))).save(cut)
    whole = cut.read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])
    assert image_folder.header_size(cut) == (150, 160)
    with pytest.raises(OSError):
        Image.open(cut).load()
    assert image_folder.header_size(with_exif) == (15, 16)
    (tmp_path / "f.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00")  # not even a header
    assert image_folder.header_size(tmp_path / "f.jpg") is None
    cfg = cfg_for(tmp_path / "d", tmp_path)
    assert datasets.describe_input(cfg)[0].shape == (15, 16, 3)
    assert datasets.sample_bytes(cfg_for(tmp_path / "d", tmp_path, channels=1)) == 4 * 15 * 16 + 8


def test_the_cache_is_read_again_and_a_changed_file_invalidates_it(tmp_path, monkeypatch):
    for i in range(4):
        write_image(tmp_path / "d" / "c0" / f"{i}.png", noisy(i))
        write_image(tmp_path / "d" / "c1" / f"{i}.png", noisy(10 + i))
    cfg = cfg_for(tmp_path / "d", tmp_path)
    decoded = []
    original = image_folder.decode
    monkeypatch.setattr(image_folder, "decode", lambda *a: decoded.append(a[0]) or original(*a))
    first = datasets.load(cfg)
    assert len(decoded) == 8
    (cached,) = (tmp_path / "cache" / "image_folder").iterdir()  # one file, no temporary left behind
    assert cached.name.startswith("d-") and cached.suffix == ".npz"
    prepared = image_folder.prepare(cfg)
    assert (prepared.cache, prepared.decoded, prepared.train, prepared.test) == (cached, False, 6, 2)
    second = datasets.load(cfg, seed=5)
    assert len(decoded) == 8  # read from the cache, nothing decoded
    np.testing.assert_array_equal(first.x_train, second.x_train)
    np.testing.assert_array_equal(first.y_test, second.y_test)
    # the cache holds what the workers need: it loads where Pillow is not installed
    monkeypatch.setitem(sys.modules, "PIL", None)
    np.testing.assert_array_equal(datasets.load(cfg).x_test, first.x_test)
    monkeypatch.delitem(sys.modules, "PIL")
    # a changed file (new content, size and mtime) makes a new key, and the new pixels are read
    changed = tmp_path / "d" / "c1" / "3.png"
    write_image(changed, solid((1, 2, 3), (10, 14)))
    stat = changed.stat()
    os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    third = datasets.load(cfg)
    assert len(decoded) == 16
    listing = image_folder.scan(cfg)
    where = [rel for rel, _ in listing.train + listing.test].index("c1/3.png")
    np.testing.assert_array_equal(np.concatenate([third.x_train, third.x_test])[where],
                                  pillow_pixels(changed))
    assert len(list((tmp_path / "cache" / "image_folder").iterdir())) == 2
    # other options are other keys
    assert image_folder.cache_path(cfg, listing) != image_folder.cache_path(
        cfg.model_copy(update={"channels": 1}), listing)
    # a damaged cache file is decoded again and replaced
    current = image_folder.cache_path(cfg, listing)
    current.write_bytes(b"PK\x03\x04 not a zip")
    np.testing.assert_array_equal(datasets.load(cfg).x_train, third.x_train)
    assert len(decoded) == 24
    np.load(current)  # a readable .npz again


def test_a_loader_leaves_the_training_images_in_their_files(tmp_path):
    """``train_images=False`` (a loader trial): no training image is read from the cache; the test set and the labels
    are the full load's, and the loader's reads from the files are the cache's training images."""
    image_folder.make_image_folder(tmp_path / "d", classes=2, per_class=6, size=(10, 8), seed=3)
    cfg = cfg_for(tmp_path / "d", tmp_path)
    full = datasets.load(cfg)
    light = datasets.load(cfg, train_images=False)
    assert light.x_train is None and full.x_train is not None
    np.testing.assert_array_equal(light.x_test, full.x_test)
    np.testing.assert_array_equal(light.y_train, full.y_train)
    assert light.nbytes == full.nbytes - full.x_train.nbytes
    with pytest.raises(ValueError, match="left in their files"):
        _ = light.train_images
    source = inputs.for_dataset(cfg, light)
    assert source.from_files
    x, y = source.read(np.arange(len(full.y_train)), 0)
    np.testing.assert_array_equal(x, full.x_train)
    np.testing.assert_array_equal(y, full.y_train)
    # the cache holds each split as its own member, so the test images are read without the training ones
    with np.load(image_folder.cache_path(cfg, image_folder.scan(cfg))) as npz:
        assert {"x_train", "x_test"} <= set(npz.files) and "x" not in npz.files


def test_a_cache_miss_without_pillow_says_what_to_do(tmp_path, monkeypatch):
    write_image(tmp_path / "d" / "c0" / "1.png", noisy(1))
    write_image(tmp_path / "d" / "c1" / "1.png", noisy(2))
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DatasetError, match=r"needs Pillow, which .* lacks; `harness run` and `harness max-batch` "
                                           r"decode them into the cache"):
        datasets.load(cfg_for(tmp_path / "d", tmp_path))


def corrupt_folder(tmp_path):
    for i in range(3):
        write_image(tmp_path / "d" / "cat" / f"{i}.jpg", noisy(i))
        write_image(tmp_path / "d" / "dog" / f"{i}.jpg", noisy(5 + i))
    (tmp_path / "d" / "dog" / "1.jpg").write_bytes(b"this is not a JPEG")
    whole = (tmp_path / "d" / "cat" / "2.jpg").read_bytes()
    (tmp_path / "d" / "cat" / "2.jpg").write_bytes(whole[: len(whole) // 2])  # truncated: the header still reads
    return tmp_path / "d"


def test_an_unreadable_file_is_one_error_line_naming_it(tmp_path):
    root = corrupt_folder(tmp_path)
    with pytest.raises(DatasetError) as info:
        datasets.load(cfg_for(root, tmp_path, size=(8, 8)))
    message = str(info.value)
    assert message.startswith(f"{root / 'cat' / '2.jpg'}: cannot decode the image (")  # the first, in listing order
    assert "on_bad_file: skip" in message and "\n" not in message and info.value.field == "path"
    cache = tmp_path / "cache" / "image_folder"
    assert not cache.exists() or not any(cache.iterdir())  # nothing cached, no temporary file left


def test_skip_leaves_unreadable_files_out_and_counts_them(tmp_path):
    root = corrupt_folder(tmp_path)
    cfg = cfg_for(root, tmp_path, size=(8, 8), on_bad_file="skip", test_fraction=0.34)
    listing = image_folder.scan(cfg)
    data = datasets.load(cfg)
    assert data.skipped_files == ("cat/2.jpg", "dog/1.jpg")
    assert len(data.y_train) + len(data.y_test) == 4
    kept = [rel for rel, _ in listing.train + listing.test if rel not in data.skipped_files]
    for rel, image in zip(kept, np.concatenate([data.x_train, data.x_test])):
        np.testing.assert_array_equal(image, pillow_pixels(root / rel, (8, 8)))
    assert image_folder.prepare(cfg).skipped == ("cat/2.jpg", "dog/1.jpg")  # from the cache, with the count
    assert datasets.load(cfg).skipped_files == ("cat/2.jpg", "dog/1.jpg")
    # the worker records the count with the trial's metrics
    from harness.execution.worker import _data_metrics

    assert _data_metrics(data) == {"data_bytes": data.nbytes, "data_skipped_files": 2}
    assert "data_skipped_files" not in _data_metrics(datasets.load(datasets.DigitsData(name="digits")))


def test_without_size_a_bad_first_file_is_skipped_for_the_size_too(tmp_path):
    (tmp_path / "d" / "a").mkdir(parents=True)
    (tmp_path / "d" / "a" / "0.jpg").write_bytes(b"garbage")
    write_image(tmp_path / "d" / "a" / "1.jpg", noisy(1, (5, 7)))
    write_image(tmp_path / "d" / "b" / "1.jpg", noisy(2, (5, 7)))
    with pytest.raises(DatasetError, match=r"a/0\.jpg: cannot read the image's size"):
        datasets.describe(cfg_for(tmp_path / "d", tmp_path))
    cfg = cfg_for(tmp_path / "d", tmp_path, on_bad_file="skip")
    assert datasets.describe(cfg) == ((5, 7, 3), 2)
    assert datasets.load(cfg).skipped_files == ("a/0.jpg",)


@pytest.mark.parametrize("layout, words", [
    ("missing", "no such folder"),
    ("file", "not a folder"),
    ("no classes", "no class folders"),
    ("empty class", "an empty class folder"),
    ("only text files", "an empty class folder"),
])
def test_folder_errors_name_the_folder(tmp_path, layout, words):
    root = tmp_path / "d"
    if layout == "file":
        root.write_text("x")
    elif layout != "missing":
        root.mkdir()
        if layout != "no classes":
            write_image(root / "a" / "1.png", noisy(1))
            (root / "b").mkdir()
            if layout == "only text files":
                (root / "b" / "readme.txt").write_text("x")
    with pytest.raises(DatasetError) as info:
        datasets.describe(cfg_for(root, tmp_path))
    message = str(info.value)
    assert words in message and "\n" not in message and info.value.field == "path"
    assert message.startswith(str(root / "b") if "empty" in words else str(root))


def test_the_generated_folder_is_learnable(tmp_path):
    image_folder.make_image_folder(tmp_path / "d", classes=4, per_class=20, size=(16, 16), seed=3)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["class_0", "class_1", "class_2", "class_3"]
    assert Image.open(next((tmp_path / "d" / "class_2").iterdir())).format == "JPEG"
    data = datasets.load(cfg_for(tmp_path / "d", tmp_path))
    means = np.stack([data.x_train[data.y_train == k].mean(axis=0) for k in range(4)])
    distances = ((data.x_test[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
    assert (distances.argmin(axis=1) == data.y_test).mean() > 0.9  # nearest class mean
    again = tmp_path / "again"
    image_folder.make_image_folder(again, classes=4, per_class=20, size=(16, 16), seed=3)
    assert (again / "class_1" / "1_00004.jpg").read_bytes() == (tmp_path / "d/class_1/1_00004.jpg").read_bytes()


def test_the_script_writes_a_folder(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_image_folder.py"), str(tmp_path / "d"),
                           "--classes", "3", "--per-class", "2", "--size", "8", "6", "--format", "png"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 6 PNG files of 8x6 pixels in 3 classes" in proc.stdout
    assert Image.open(tmp_path / "d" / "class_2" / "2_00001.png").size == (6, 8)
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_image_folder.py"), str(tmp_path / "e"),
                          "--per-class", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be positive" in bad.stderr


# ------------------------------------------------------------------------------------------- spec and plan checks

def folder_spec(path, classes=2, **dataset):
    layers = [{"type": "conv2d", "filters": 2, "kernel_size": 3, "padding": "same"}, {"type": "flatten"},
              {"type": "dense", "units": classes}]
    return base_spec(model={"layers": layers}, dataset={"name": "image_folder", "path": str(path), **dataset})


def test_a_relative_path_is_the_spec_files_and_absolute_for_the_workers(write_spec, tmp_path, monkeypatch):
    image_folder.make_image_folder(tmp_path / "images", classes=2, per_class=3, size=(8, 8))
    monkeypatch.chdir(tmp_path.parent)  # not the spec's folder
    spec = plan.load(write_spec(folder_spec("images", cache_dir="cache")))
    assert spec.dataset.path == tmp_path / "images" and spec.dataset.cache_dir == tmp_path / "cache"
    assert datasets.describe(spec.dataset) == ((8, 8, 3), 2)
    # checked_spec leaves the path as written, and checks it (and the model) against the spec file's folder
    assert plan.checked_spec(folder_spec("images"), tmp_path / "s.yaml").dataset.path.name == "images"
    with pytest.raises(SpecError, match=r"s\.yaml: model\.layers\.2: .*2 classes"):
        plan.checked_spec(folder_spec("images", classes=3), tmp_path / "s.yaml")


@pytest.mark.parametrize("make, dataset, field, words", [
    (None, {}, "dataset.path", "no such folder"),
    ("empty class", {}, "dataset.path", "an empty class folder"),
    ("bad first", {}, "dataset.path", "cannot read the image's size"),
    ("ok", {}, "model.layers.2", "classes"),
])
def test_plan_time_errors_are_one_line_naming_the_field(write_spec, tmp_path, make, dataset, field, words):
    root = tmp_path / "images"
    if make is not None:
        image_folder.make_image_folder(root, classes=3 if make == "ok" else 2, per_class=2, size=(8, 8))
    if make == "empty class":
        (root / "class_9").mkdir()
    if make == "bad first":
        (root / "class_0" / "0_00000.jpg").write_bytes(b"broken")
    path = write_spec(folder_spec("images", **dataset))
    with pytest.raises(SpecError) as info:
        plan.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}: ") and words in message and "\n" not in message


@pytest.mark.parametrize("dataset, field, words", [
    ({"channels": 2}, "dataset.image_folder.channels", "1 or 3"),
    ({"size": [0, 8]}, "dataset.image_folder.size.0", "greater than 0"),
    ({"size": [8]}, "dataset.image_folder.size", "[height, width] in pixels, two numbers, not 1"),
    ({"test_fraction": 1.0}, "dataset.image_folder.test_fraction", "less than 1"),
    ({"on_bad_file": "ignore"}, "dataset.image_folder.on_bad_file", "'error' or 'skip'"),
    ({"resize": "nearest"}, "dataset.image_folder.resize", "unknown field"),
    ({"path": None}, "dataset.image_folder.path", ""),
])
def test_bad_options_are_spec_errors(write_spec, tmp_path, dataset, field, words):
    data = folder_spec(tmp_path)
    data["dataset"].update(dataset)
    if dataset.get("path", "") is None:
        del data["dataset"]["path"]
    path = write_spec(data)
    with pytest.raises(SpecError) as info:
        plan.load(path)
    assert str(info.value).startswith(f"{path}: {field}: ") and words in str(info.value)


def test_the_cli_decodes_into_the_cache_once_before_the_trials(write_spec, tmp_path, capsys):
    root = corrupt_folder(tmp_path)
    path = write_spec(folder_spec(root, size=[8, 8], on_bad_file="skip", cache_dir=str(tmp_path / "c")))
    spec = load_spec(path)
    err = capsys.readouterr().err
    assert f"decoding 6 images of {root} (2 classes) into the cache {tmp_path / 'c' / 'image_folder'}" in err
    assert "decoded 3 training and 1 test images" in err
    assert "skipped 2 unreadable file(s)" in err and "cat/2.jpg, dog/1.jpg" in err
    assert spec.dataset.on_bad_file == "skip"
    load_spec(path)
    again = capsys.readouterr().err
    assert "decoding" not in again and "skipped 2 unreadable file(s)" in again  # from the cache
    strict = write_spec(folder_spec(root, size=[8, 8], cache_dir=str(tmp_path / "c")), name="strict.yaml")
    with pytest.raises(SpecError, match=rf"^{strict}: dataset.path: {root / 'cat' / '2.jpg'}: cannot decode"):
        load_spec(strict)


@pytest.mark.slow
def test_a_run_decodes_once_and_its_worker_trains_from_the_cache(write_spec, tmp_path):
    """``python -m harness run``: the command decodes the folder once, before the first trial; the PyTorch worker
    reads the cache, trains, and records the skipped file."""
    root = tmp_path / "images"
    image_folder.make_image_folder(root, classes=2, per_class=24, size=(20, 20))
    (root / "class_1" / "zz.jpg").write_bytes(b"not a JPEG")
    layers = [{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "activation": "relu"},
              {"type": "maxpool2d", "pool_size": 2}, {"type": "flatten"}, {"type": "dense", "units": 2}]
    spec = write_spec(base_spec(model={"layers": layers}, batch_sizes=[8], epochs=2, dataset={
        "name": "image_folder", "path": "images", "size": [16, 16], "on_bad_file": "skip", "cache_dir": "cache"}))
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(spec), "--out", str(out), "--no-progress"],
                          cwd=tmp_path.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"decoding 49 images of {root} (2 classes)" in proc.stderr and "class_1/zz.jpg" in proc.stderr
    from harness.results import store

    (record,) = store.read_trials(next(out.iterdir()))
    assert record.status == "ok", (record.log_tail or "")[-2000:]
    assert record.metrics.data_skipped_files == 1
    assert record.metrics.data_bytes == 48 * (16 * 16 * 3 * 4 + 8)
    assert record.metrics.test_accuracy > 0.8
