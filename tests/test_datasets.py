"""Datasets: real digits, synthetic data, the CIFAR-10 archive reader, and the shared batch order."""

from __future__ import annotations

import hashlib
import io
import pickle
import tarfile

import numpy as np
import pytest

from harness.neutral import datasets
from harness.spec import Cifar10Data, DigitsData, SyntheticData


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
