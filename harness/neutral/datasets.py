"""Datasets as numpy arrays, and the per-epoch batch order every framework shares.

Images are float32 NHWC arrays scaled to [0, 1] (the same normalisation for every framework, done here once);
token sequences are int64 (N, L) arrays of ids in [0, vocab); labels are int64 class indices, (N,), or (N, L) for a
next-token task (one label per position). Nothing here downloads: the CIFAR-10 archive is fetched, when missing,
by ``harness.neutral.download`` in the orchestrating process before any trial starts; image folders are read by
``harness.neutral.image_folder``. The loaded arrays (``Data``), ``DatasetError`` and the cache folder, which every
reader shares, are ``harness.neutral.data``'s (and importable from here).
"""

from __future__ import annotations

import hashlib
import importlib.util
import pickle
import tarfile
from pathlib import Path

import numpy as np

from harness.neutral import image_folder
from harness.neutral.data import Data, DatasetError, cache_folder
from harness.neutral.info import Input
from harness.spec import Cifar10Data, DigitsData, ImageFolderData, SyntheticData, SyntheticTokens

CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"  # the archive's published checksum (cs.toronto.edu/~kriz/cifar.html)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"

DatasetSpec = DigitsData | SyntheticData | SyntheticTokens | Cifar10Data | ImageFolderData


def describe(cfg: DatasetSpec) -> tuple[tuple[int, ...], int]:
    """One sample's shape and the number of classes, without loading anything: an image's (H, W, C), or a token
    sequence's (L,) (see ``describe_input`` for what a model needs to know). An image folder is listed, not decoded
    (``image_folder.describe``); it raises DatasetError when the folder cannot be used."""
    if isinstance(cfg, DigitsData):
        return (8, 8, 1), 10
    if isinstance(cfg, SyntheticData):
        return tuple(cfg.shape), cfg.classes
    if isinstance(cfg, SyntheticTokens):
        return (cfg.length,), token_classes(cfg)
    if isinstance(cfg, ImageFolderData):
        return image_folder.describe(cfg)
    return (32, 32, 3), 10


def describe_input(cfg: DatasetSpec) -> tuple[Input, int]:
    """What a model is fed (``harness.neutral.models.Input``: images (H, W, C), or tokens (L,) with their vocabulary
    and whether the labels are per position) and the number of classes, without loading anything."""
    shape, classes = describe(cfg)
    if isinstance(cfg, SyntheticTokens):
        return Input.tokens(cfg.length, cfg.vocab, per_position=cfg.task == "copy"), classes
    return Input.images(shape), classes


def sample_bytes(cfg: DatasetSpec) -> int:
    """Bytes of one training sample and its label(s) as ``load`` returns them: float32 pixels and an int64 label,
    or int64 token ids and one int64 label (sorted) or one per position (copy)."""
    shape, _ = describe(cfg)
    if isinstance(cfg, SyntheticTokens):
        return 8 * cfg.length + 8 * (cfg.length if cfg.task == "copy" else 1)
    return 4 * int(np.prod(shape)) + 8


def load(cfg: DatasetSpec, seed: int = 0, train_images: bool = True) -> Data:
    """Loads the dataset a spec names. ``seed`` drives synthetic data only. ``train_images`` False leaves an image
    folder's training images in their files (``Data.x_train`` None) for a data loader that decodes them as it reads
    (``input: loader``); every other dataset is held in host memory either way, and a loader reads it there. Raises
    DatasetError."""
    if isinstance(cfg, DigitsData):
        return _digits(cfg)
    if isinstance(cfg, SyntheticData):
        return _synthetic(cfg, seed)
    if isinstance(cfg, SyntheticTokens):
        return _synthetic_tokens(cfg, seed)
    if isinstance(cfg, ImageFolderData):
        return image_folder.load(cfg, train_images=train_images)
    return _cifar10(cfg)


def token_classes(cfg: SyntheticTokens) -> int:
    """The classes of a token task: the vocabulary (copy: the label is a token), or 2 (sorted: no, yes)."""
    return cfg.vocab if cfg.task == "copy" else 2


def accuracy_ceiling(cfg: SyntheticTokens) -> float:
    """The expected test accuracy of the best possible predictor of a token task (a fraction).

    copy, length L = 2H: the sequence a_0..a_{H-1} a_0..a_{H-1} (then a_0, the label of the last position) is
    periodic with period H, so the label at position t, the token at t + 1, is the input token at t + 1 - H once
    t >= H - 1: H + 1 of the L positions are predictable from the prefix a causal model sees; the other H - 1 labels
    are uniform draws, right by chance with probability 1 / vocab. The ceiling is (H + 1 + (H - 1) / vocab) / L,
    e.g. 0.6625 for L = 8, vocab 10 (about 0.5 + 0.5 / vocab for long sequences). sorted: 1.0 (the label is a
    function of the sequence)."""
    if cfg.task == "sorted":
        return 1.0
    half = cfg.length // 2
    return (half + 1 + (half - 1) / cfg.vocab) / cfg.length


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the n training samples: int64 (n,), a permutation of range(n).

    Drawn from (seed, epoch) alone, so every framework sees the same batches in the same order.
    """
    return np.random.default_rng([seed, epoch, 0x0BA7C4]).permutation(n).astype(np.int64)


def augment_pad(height: int) -> int:
    """The zero padding of ``augment``'s crop on each side: ``max(1, height // 8)`` pixels."""
    return max(1, height // 8)


def augment_offsets(n: int, height: int, width: int, seed: int, epoch: int) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """``augment``'s draws for epoch ``epoch`` of n images: the crop's row and column offsets, int64 (n,) each in
    [0, 2 x pad], and whether each image is flipped, bool (n,). Sample i's draws depend on (seed, epoch, n) only, so a
    loader that augments sample by sample (``harness.neutral.inputs``) makes the same images."""
    pad = augment_pad(height)
    rng = np.random.default_rng([seed, epoch, 0xA06])
    dy = rng.integers(0, 2 * pad + 1, size=n)
    dx = rng.integers(0, 2 * pad + 1, size=n)
    flip = rng.random(n) < 0.5
    return dy, dx, flip


def augment(images: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Random crop and horizontal flip of every training image, drawn from (seed, epoch): the same augmented images
    for every framework. images: float32 (N, H, W, C). Returns a new array of the same shape.

    Crop: pad each side with ``max(1, H // 8)`` zero pixels (4 for 32x32, the usual CIFAR setting; 1 for 8x8) and cut
    an H x W window at a random offset. Flip: left-right with probability 1/2 (``augment_offsets``).
    """
    n, h, w, _ = images.shape
    return crop_and_flip(images, *augment_offsets(n, h, w, seed, epoch))


def crop_and_flip(images: np.ndarray, dy: np.ndarray, dx: np.ndarray, flip: np.ndarray) -> np.ndarray:
    """``augment``'s crop and flip of images float32 (B, H, W, C) with their draws (``augment_offsets``' int64 (B,)
    offsets and bool (B,) flips, sample b's in position b): zero-padded by ``augment_pad(H)`` on each side, the
    H x W window at (dy, dx), mirrored left-right where ``flip``. Returns a new float32 array of the same shape."""
    n, h, w, _ = images.shape
    pad = augment_pad(h)
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    rows = dy[:, None] + np.arange(h)[None, :]  # (B, H)
    cols = dx[:, None] + np.arange(w)[None, :]  # (B, W)
    cols = np.where(flip[:, None], cols[:, ::-1], cols)
    out = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
    return np.ascontiguousarray(out, dtype=np.float32)


DIGITS_FILE = Path("datasets") / "data" / "digits.csv.gz"  # inside scikit-learn's package folder


def digits_table() -> np.ndarray:
    """scikit-learn's bundled digits as one float64 (1797, 65) table: each row an image's 64 pixel values (0..16,
    row by row) and its label, as ``sklearn.datasets.load_digits`` reads them (``np.loadtxt`` of the package's
    ``datasets/data/digits.csv.gz``, https://scikit-learn.org/stable/modules/generated/
    sklearn.datasets.load_digits.html). The file is read without importing scikit-learn: its import (SciPy's with
    it) took 2.3 s of every worker's start on this project's 2-core CPU, a fifth of a digits trial. When the file is
    not where that layout puts it (another scikit-learn), ``load_digits`` itself gives the table. Raises
    ModuleNotFoundError without scikit-learn."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DIGITS_FILE
        if path.is_file():
            return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target]).astype(np.float64)


def _digits(cfg: DigitsData) -> Data:
    table = digits_table()
    images = (table[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0)[..., None]  # pixel values are 0..16
    labels = table[:, -1].astype(np.int64)
    # A fixed stratified split, independent of the trial seed: every trial evaluates on the same test images.
    rng = np.random.default_rng(20240101)
    test_idx: list[int] = []
    for label in range(10):
        members = np.flatnonzero(labels == label)
        take = int(round(len(members) * cfg.test_fraction))
        test_idx.extend(rng.choice(members, size=take, replace=False).tolist())
    test_mask = np.zeros(len(labels), dtype=bool)
    test_mask[test_idx] = True
    return Data(images[~test_mask], labels[~test_mask], images[test_mask], labels[test_mask], 10)


def _synthetic(cfg: SyntheticData, seed: int) -> Data:
    rng = np.random.default_rng([seed, 0x5E7])
    h, w, c = cfg.shape

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.random((n, h, w, c), dtype=np.float32), rng.integers(0, cfg.classes, size=n, dtype=np.int64)

    x_train, y_train = draw(cfg.size)
    x_test, y_test = draw(cfg.test_size)
    return Data(x_train, y_train, x_test, y_test, cfg.classes)


def _synthetic_tokens(cfg: SyntheticTokens, seed: int) -> Data:
    """Token sequences drawn from (seed, the task), training and test sets from one generator (disjoint draws).

    copy: each sequence is length / 2 uniform tokens followed by their copy; x = the sequence, y[:, t] = the next
    token (x[:, t + 1], and for the last position the first token, continuing the period), int64 (N, L).
    sorted: uniform tokens; floor(N / 2) sequences, at random positions, sorted ascending (non-decreasing) and
    labelled 1; the others redrawn until they are not sorted and labelled 0; y int64 (N,)."""
    rng = np.random.default_rng([seed, 0x70C, 0 if cfg.task == "copy" else 1])

    def copy(n: int) -> tuple[np.ndarray, np.ndarray]:
        half = rng.integers(0, cfg.vocab, size=(n, cfg.length // 2), dtype=np.int64)
        x = np.concatenate([half, half], axis=1)
        return x, np.concatenate([x[:, 1:], x[:, :1]], axis=1)

    def is_sorted(x: np.ndarray) -> np.ndarray:
        return np.all(x[:, 1:] >= x[:, :-1], axis=1)

    def sorted_task(n: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.integers(0, cfg.vocab, size=(n, cfg.length), dtype=np.int64)
        y = np.zeros(n, dtype=np.int64)
        y[rng.permutation(n)[: n // 2]] = 1
        x[y == 1] = np.sort(x[y == 1], axis=1)
        while np.any(redraw := (y == 0) & is_sorted(x)):
            x[redraw] = rng.integers(0, cfg.vocab, size=(int(redraw.sum()), cfg.length), dtype=np.int64)
        return x, y

    draw = copy if cfg.task == "copy" else sorted_task
    x_train, y_train = draw(cfg.size)
    x_test, y_test = draw(cfg.test_size)
    return Data(x_train, y_train, x_test, y_test, token_classes(cfg))


def cifar10_cache_path(cfg: Cifar10Data) -> Path:
    """Where the CIFAR-10 archive belongs when ``dataset.path`` is not given: ``<cache>/cifar-10-python.tar.gz``,
    cache = ``cfg.cache_dir``, ``$HARNESS_DATA`` or ``~/.cache/harness`` (``cache_folder``)."""
    return cache_folder(cfg.cache_dir) / CIFAR10_ARCHIVE


def missing_cifar10_message(path: Path, explicit: bool = False) -> str:
    """The one line that says a CIFAR-10 archive is missing at ``path`` and where to put it. ``explicit``: the path
    is ``dataset.path`` (never downloaded), not the cache's."""
    if explicit:
        return (f"no CIFAR-10 archive at {path} (dataset.path, which is never downloaded); download {CIFAR10_URL} "
                "and put it there, or leave dataset.path out to have it downloaded into the cache")
    return (f"no CIFAR-10 archive at {path}; download {CIFAR10_URL} and put it there (or set dataset.path); offline "
            "(--offline or HARNESS_OFFLINE=1) the harness never downloads, else `harness run` and `harness "
            "max-batch` download it there before the first trial")


def resolve_cifar10_path(cfg: Cifar10Data, base_dir: Path | None = None) -> Path:
    """Where the CIFAR-10 archive is: ``cfg.path``, else ``cifar10_cache_path(cfg)``. Raises DatasetError saying
    where to put it (``missing_cifar10_message``) when there is no file there."""
    if cfg.path is not None:
        path = cfg.path if cfg.path.is_absolute() or base_dir is None else base_dir / cfg.path
    else:
        path = cifar10_cache_path(cfg)
    if not path.is_file():
        raise DatasetError(missing_cifar10_message(path, explicit=cfg.path is not None), field="path")
    return path


def file_md5(path: Path) -> str:
    """The md5 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_cifar10_archive(path: Path, expected_md5: str | None = CIFAR10_MD5) -> Data:
    """Reads the standard python-version CIFAR-10 tarball.

    The archive holds ``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``, pickles of dicts with ``b"data"``
    (uint8 (N, 3072), channel-first rows) and ``b"labels"``. The checksum is verified before anything is unpickled
    (pickle must only read a trusted file). Raises DatasetError on a wrong checksum or a malformed archive.
    """
    if expected_md5 is not None and (actual := file_md5(path)) != expected_md5:
        raise DatasetError(f"{path}: md5 {actual} is not CIFAR-10's {expected_md5}; the file is damaged or another "
                           "file")
    parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar.getmembers():
                name = member.name.rsplit("/", 1)[-1]
                if name.startswith("data_batch_") or name == "test_batch":
                    handle = tar.extractfile(member)
                    assert handle is not None
                    batch = pickle.load(handle, encoding="bytes")
                    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
                    parts[name] = (data, np.asarray(batch[b"labels"], dtype=np.int64))
    except (tarfile.TarError, OSError, KeyError, pickle.UnpicklingError, ValueError) as err:
        raise DatasetError(f"{path}: not a readable CIFAR-10 python archive ({err})") from None
    train_names = sorted(n for n in parts if n.startswith("data_batch_"))
    if not train_names or "test_batch" not in parts:
        raise DatasetError(f"{path}: the archive lacks data_batch_* or test_batch")

    def to_nhwc(images: np.ndarray) -> np.ndarray:
        return images.transpose(0, 2, 3, 1).astype(np.float32) / 255.0

    x_train = np.concatenate([parts[n][0] for n in train_names])
    y_train = np.concatenate([parts[n][1] for n in train_names])
    x_test, y_test = parts["test_batch"]
    return Data(to_nhwc(x_train), y_train, to_nhwc(x_test), y_test, 10)


def _cifar10(cfg: Cifar10Data) -> Data:
    data = load_cifar10_archive(resolve_cifar10_path(cfg))
    if cfg.limit_train or cfg.limit_test:
        data = Data(data.train_images[: cfg.limit_train], data.y_train[: cfg.limit_train],
                    data.x_test[: cfg.limit_test], data.y_test[: cfg.limit_test], data.num_classes)
    return data
