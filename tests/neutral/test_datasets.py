"""Datasets: real digits, synthetic data, the CIFAR-10 archive reader, and the shared batch order."""

from __future__ import annotations

import hashlib
import io
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from harness.neutral import datasets
from harness.spec import Cifar10Data, DigitsData, SyntheticData, SyntheticTokens


def test_digits_is_real_normalised_and_split_the_same_way_every_time():
    a = datasets.load(DigitsData(name="digits"))
    b = datasets.load(DigitsData(name="digits"), seed=123)
    assert a.x_train.shape[1:] == (8, 8, 1) and a.x_train.dtype == np.float32
    assert len(a.y_train) + len(a.y_test) == 1797
    assert 0.19 < len(a.y_test) / 1797 < 0.21
    assert a.x_train.min() == 0.0 and a.x_train.max() == 1.0
    assert set(np.unique(a.y_test)) == set(range(10))  # stratified: every class in the test set
    np.testing.assert_array_equal(a.x_test, b.x_test)  # the split does not depend on the trial seed
    assert datasets.describe(DigitsData(name="digits")) == ((8, 8, 1), 10)


def test_synthetic_follows_the_seed():
    cfg = SyntheticData(name="synthetic", shape=(4, 5, 3), classes=3, size=20, test_size=6)
    a, b, c = datasets.load(cfg, 1), datasets.load(cfg, 1), datasets.load(cfg, 2)
    assert a.x_train.shape == (20, 4, 5, 3) and a.y_test.shape == (6,) and a.y_train.max() < 3
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, c.x_train)


def test_epoch_order_is_a_seeded_permutation_per_epoch():
    n = 1000
    first = datasets.epoch_order(n, 0, 0)
    assert sorted(first.tolist()) == list(range(n))
    np.testing.assert_array_equal(first, datasets.epoch_order(n, 0, 0))
    assert not np.array_equal(first, datasets.epoch_order(n, 0, 1))
    assert not np.array_equal(first, datasets.epoch_order(n, 1, 0))


def fake_cifar_archive(path, n_per_batch=4):
    """An archive in the layout of cifar-10-python.tar.gz, holding generated images."""
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            batch = {b"data": rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8),
                     b"labels": rng.integers(0, 10, size=n_per_batch).tolist()}
            blob = pickle.dumps(batch)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_cifar10_archive_reader_layout_and_checksum(tmp_path):
    path = tmp_path / "cifar-10-python.tar.gz"
    md5 = fake_cifar_archive(path)
    data = datasets.load_cifar10_archive(path, expected_md5=md5)
    assert data.x_train.shape == (20, 32, 32, 3) and data.x_test.shape == (4, 32, 32, 3)
    assert data.x_train.dtype == np.float32 and 0 <= data.x_train.min() and data.x_train.max() <= 1
    # channel-first rows become NHWC: pixel (0, 0) of channel 1 is element 1024 of the row
    with tarfile.open(path) as tar:
        first = pickle.load(tar.extractfile("cifar-10-batches-py/data_batch_1"), encoding="bytes")
    assert data.x_train[0, 0, 0, 1] == pytest.approx(first[b"data"][0, 1024] / 255.0)
    with pytest.raises(datasets.DatasetError, match="is not CIFAR-10's"):
        datasets.load_cifar10_archive(path)  # the real checksum does not match generated data


def test_cifar10_lookup_order_and_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_DATA", str(tmp_path))
    with pytest.raises(datasets.DatasetError, match=f"no CIFAR-10 archive at {tmp_path}/cifar-10-python.tar.gz"):
        datasets.resolve_cifar10_path(Cifar10Data(name="cifar10"))
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"x")
    assert datasets.resolve_cifar10_path(Cifar10Data(name="cifar10")) == tmp_path / "cifar-10-python.tar.gz"


def test_augment_is_a_seeded_crop_and_flip_of_each_image():
    rng = np.random.default_rng(3)
    images = rng.random((40, 8, 8, 2), dtype=np.float32)
    out = datasets.augment(images, seed=5, epoch=1)
    assert out.shape == images.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, datasets.augment(images, seed=5, epoch=1))
    assert not np.array_equal(out, datasets.augment(images, seed=5, epoch=2))
    padded = np.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)))  # 8 // 8 = 1 pixel of padding
    flips = 0
    for i in range(len(images)):
        matches = [(dy, dx, flip) for dy in range(3) for dx in range(3) for flip in (False, True)
                   if np.array_equal(out[i], (lambda c: c[:, ::-1] if flip else c)(padded[i, dy:dy + 8, dx:dx + 8]))]
        assert len(matches) == 1, (i, matches)  # exactly one crop offset and flip explains each output
        flips += matches[0][2]
    assert 8 < flips < 32  # about half flipped


def test_copy_tokens_are_a_half_and_its_copy_with_next_token_labels():
    cfg = SyntheticTokens(name="synthetic_tokens", vocab=10, length=8, size=500, test_size=40, task="copy")
    a, b, c = datasets.load(cfg, 1), datasets.load(cfg, 1), datasets.load(cfg, 2)
    assert a.x_train.shape == (500, 8) and a.y_train.shape == (500, 8) and a.x_test.shape == (40, 8)
    assert a.x_train.dtype == np.int64 and a.y_train.dtype == np.int64 and a.num_classes == 10
    assert 0 <= a.x_train.min() and a.x_train.max() < 10
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, c.x_train)
    np.testing.assert_array_equal(a.x_train[:, 4:], a.x_train[:, :4])  # the second half copies the first
    np.testing.assert_array_equal(a.y_train[:, :-1], a.x_train[:, 1:])  # the label is the next token
    np.testing.assert_array_equal(a.y_train[:, -1], a.x_train[:, 0])  # ... continuing the period at the end


def test_copy_accuracy_ceiling_counted_from_the_data():
    cfg = SyntheticTokens(name="synthetic_tokens", vocab=10, length=8, size=4000, test_size=4, task="copy")
    data = datasets.load(cfg, 0)
    x, y, half = data.x_train, data.y_train, 4
    # A position is predictable when its label is a token the causal prefix x[:, :t + 1] already holds: x[t + 1 - H].
    predictable = [t for t in range(8) if t + 1 - half >= 0 and np.array_equal(y[:, t], x[:, t + 1 - half])]
    assert predictable == [3, 4, 5, 6, 7]  # H + 1 of them
    # The others are uniform draws: the best guess (the commonest label) is right about 1 / vocab of the time.
    for t in set(range(8)) - set(predictable):
        assert np.bincount(y[:, t], minlength=10).max() / len(y) < 0.13
    ceiling = (len(predictable) + (8 - len(predictable)) / cfg.vocab) / 8
    assert datasets.accuracy_ceiling(cfg) == pytest.approx(ceiling) == pytest.approx(0.6625)


def test_sorted_tokens_are_half_sorted_and_labelled_by_sortedness():
    cfg = SyntheticTokens(name="synthetic_tokens", vocab=3, length=3, size=301, test_size=50, task="sorted")
    a = datasets.load(cfg, 5)
    assert a.y_train.shape == (301,) and a.num_classes == 2 and a.x_train.shape == (301, 3)
    assert a.y_train.sum() == 150  # floor(301 / 2) sorted
    is_sorted = np.all(np.diff(a.x_train, axis=1) >= 0, axis=1)
    np.testing.assert_array_equal(a.y_train, is_sorted.astype(np.int64))  # none of the others is sorted by chance
    np.testing.assert_array_equal(a.x_test, datasets.load(cfg, 5).x_test)
    assert datasets.accuracy_ceiling(cfg) == 1.0


def test_describing_token_data_without_loading_it():
    copy = SyntheticTokens(name="synthetic_tokens", vocab=7, length=6)
    feed, classes = datasets.describe_input(copy)
    assert (feed.kind, feed.shape, feed.vocab, feed.per_position, classes) == ("tokens", (6,), 7, True, 7)
    feed, classes = datasets.describe_input(SyntheticTokens(name="synthetic_tokens", task="sorted", length=5))
    assert (feed.per_position, classes) == (False, 2)
    assert datasets.describe_input(DigitsData(name="digits"))[0].model_shape == (1, 8, 8)
    # bytes of one sample as loaded: ids and labels int64; pixels float32 and an int64 label
    data = datasets.load(copy.model_copy(update={"size": 3}))
    assert datasets.sample_bytes(copy) == (data.x_train.nbytes + data.y_train.nbytes) // 3 == 96
    assert datasets.sample_bytes(SyntheticData(name="synthetic", shape=(4, 5, 3))) == 4 * 60 + 8


def test_token_spec_rules():
    with pytest.raises(ValueError, match="the copy task needs an even length"):
        SyntheticTokens(name="synthetic_tokens", length=7)
    with pytest.raises(ValueError):
        SyntheticTokens(name="synthetic_tokens", vocab=1)
    assert SyntheticTokens(name="synthetic_tokens", length=7, task="sorted").length == 7


def test_digits_read_from_scikit_learns_file_equal_load_digits_and_skip_its_import(monkeypatch):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    table = datasets.digits_table()
    np.testing.assert_array_equal(table[:, :-1].reshape(-1, 8, 8), bunch.images)
    np.testing.assert_array_equal(table[:, -1].astype(int), bunch.target)
    direct = datasets.load(DigitsData(name="digits"))
    monkeypatch.setattr(datasets, "DIGITS_FILE", datasets.DIGITS_FILE.with_name("no-such-file.csv.gz"))
    fallback = datasets.load(DigitsData(name="digits"))  # through load_digits
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(direct, name), getattr(fallback, name))
    code = ("import sys; from harness.neutral import datasets; from harness.spec import DigitsData; "
            "d = datasets.load(DigitsData(name='digits')); print(len(d.y_train), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1438", "False"]
