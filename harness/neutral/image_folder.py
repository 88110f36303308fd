"""Image folders: a folder with one sub-folder per class holding JPEG and PNG files, as numpy arrays.

Layout (``ImageFolderData.path``): ``ROOT/<class>/**/*.jpg|.jpeg|.png``; the class index is the position of the class
in the sorted sub-folder names; hidden names (a leading ``.``) and files with other suffixes are ignored. When ROOT
holds both ``train/`` and ``test/``, each with class sub-folders, they are the split (every test class must be a
training class; indices come from ``train/``). Otherwise ``test_fraction`` of each class's files (rounded, at least
one left for training) are the test set: the files whose names hash lowest (SHA-256 of ``SPLIT_SEED`` and the path
inside the class folder), so the split depends on the file names only, never on the trial seed, and every framework
and trial sees the same one.

Decoding (Pillow, imported only when images are decoded): each file is opened, converted to RGB (``channels: 3``) or
grayscale (``channels: 1``, Pillow's ``L``: 0.299 R + 0.587 G + 0.114 B), resized to ``size`` [height, width] with
Pillow's bilinear filter (``Image.resize(..., Image.Resampling.BILINEAR)``, which widens its support when it
shrinks, i.e. antialiases; not applied to an image already of that size) and scaled to float32 [0, 1] (value / 255),
NHWC like every image dataset of ``harness.neutral.datasets``. Without ``size`` every image must have the size of the
first one (``describe``).

Cache: decoding thousands of JPEGs in every fresh worker would cost more than a short trial, so the decoded uint8
arrays are kept in ``<cache>/image_folder/<folder name>-<key>.npz`` (cache = ``cache_dir``, ``$HARNESS_DATA`` or
``~/.cache/harness``). The key is a SHA-256 of the sorted relative file paths with their byte sizes and
modification times (ns), the split and labels, and the options that change the arrays (size, channels,
on_bad_file, the resize filter): a changed, added or removed file makes a new key. The file is written to a
temporary name in the same folder and renamed into place (``os.replace``), so workers that decode at the same time
never read a partial file. ``harness run`` and ``harness max-batch`` decode into the cache before the first trial
(``prepare``): the workers, whose environments need not have Pillow, then only read the ``.npz``, each split its own
member (``load(cfg, train_images=False)`` reads the test images alone). Old cache files are not removed (delete
``<cache>/image_folder/`` to reclaim the space).

Bad input: a file Pillow cannot decode stops the load with a DatasetError naming it (``on_bad_file: error``) or is
left out and listed in ``Data.skipped_files`` (``on_bad_file: skip``). A missing folder, no class folders, an empty
class folder, a test class that is not a training class and images of different sizes without ``size`` are always
errors naming the folder. Every DatasetError here is one line, with ``field`` set to the dataset field to fix.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.neutral.data import Data, DatasetError, cache_folder
from harness.spec import ImageFolderData

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
SPLIT_SEED = 20240101  # the fixed seed of the test_fraction split
RESIZE_FILTER = "bilinear"  # Pillow's Image.Resampling.BILINEAR; part of the cache key
CACHE_VERSION = 2  # bump when the cached arrays' meaning changes (2: x_train and x_test apart)


@dataclass(frozen=True)
class Listing:
    """What an image folder holds, from names and file metadata alone (no image is opened).

    root: the folder. classes: class names, index = position. layout: ``folders`` (``train/`` and ``test/``) or
    ``fraction`` (split by ``test_fraction``). train, test: (path relative to root, class index) pairs in class
    order, then sorted by path.
    """

    root: Path
    classes: tuple[str, ...]
    layout: str
    train: tuple[tuple[str, int], ...]
    test: tuple[tuple[str, int], ...]

    @property
    def files(self) -> tuple[tuple[str, int], ...]:
        """Every (relative path, class index) pair, training files first."""
        return self.train + self.test


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` did: the cache file, whether it decoded now (False: the cache already held the arrays), the
    images per split, the unreadable files it left out (relative paths) and the seconds it took."""

    cache: Path
    decoded: bool
    train: int
    test: int
    skipped: tuple[str, ...]
    seconds: float


def _subfolders(folder: Path) -> list[str]:
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def _images(class_dir: Path) -> list[str]:
    """The image files under ``class_dir`` (recursively), as sorted POSIX paths relative to it."""
    found: list[str] = []
    for top, dirs, names in os.walk(class_dir, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = Path(top).relative_to(class_dir)
        found += [(rel / n).as_posix() for n in names
                  if not n.startswith(".") and n.lower().endswith(IMAGE_SUFFIXES)]
    return sorted(found)


def _class_files(folder: Path, classes: Sequence[str]) -> list[list[str]]:
    out = []
    for name in classes:
        files = _images(folder / name)
        if not files:
            raise DatasetError(f"{folder / name}: an empty class folder (no {', '.join(IMAGE_SUFFIXES)} files)",
                               field="path")
        out.append(files)
    return out


def _split_rank(class_name: str, rel: str) -> bytes:
    return hashlib.sha256(f"{SPLIT_SEED}/{class_name}/{rel}".encode()).digest()


def scan(cfg: ImageFolderData) -> Listing:
    """Lists ``cfg.path``: classes, the split and every file's label, without opening an image. Raises DatasetError
    (field ``path``) for a missing or unreadable folder, no class folders, an empty class folder, ``train/`` without
    ``test/`` (or the reverse), or a test class that is not a training class."""
    try:
        return _scan(cfg)
    except OSError as err:  # a folder that cannot be listed (permissions), or one that went away
        raise DatasetError(f"{err.filename or cfg.path}: cannot list the folder ({err.strerror or err})",
                           field="path") from None


def _scan(cfg: ImageFolderData) -> Listing:
    root = Path(cfg.path)
    if not root.is_dir():
        raise DatasetError(f"{root}: {'not a folder' if root.exists() else 'no such folder'}", field="path")
    top = _subfolders(root)
    if "train" in top and "test" in top:
        classes = _subfolders(root / "train")
        test_classes = _subfolders(root / "test")
        if not classes:
            raise DatasetError(f"{root / 'train'}: no class folders (one sub-folder per class)", field="path")
        if extra := [c for c in test_classes if c not in classes]:
            raise DatasetError(f"{root / 'test' / extra[0]}: test class {extra[0]!r} has no folder in "
                               f"{root / 'train'} (training classes: {', '.join(classes)})", field="path")
        train = [(f"train/{c}/{f}", i) for i, (c, files) in
                 enumerate(zip(classes, _class_files(root / "train", classes))) for f in files]
        test = [(f"test/{c}/{f}", classes.index(c)) for c, files in
                zip(test_classes, _class_files(root / "test", test_classes)) for f in files]
        return Listing(root, tuple(classes), "folders", tuple(train), tuple(test))
    for half in ("train", "test"):
        if half in top and _subfolders(root / half):
            other = "test" if half == "train" else "train"
            raise DatasetError(f"{root}: has {half}/ with sub-folders but no {other}/; give both (the same class "
                               "folders in each) or class folders only", field="path")
    if not top:
        raise DatasetError(f"{root}: no class folders (expected one sub-folder per class holding "
                           f"{', '.join(IMAGE_SUFFIXES)} files)", field="path")
    train, test = [], []
    for i, (name, files) in enumerate(zip(top, _class_files(root, top))):
        take = min(round(len(files) * cfg.test_fraction), len(files) - 1)
        ranked = sorted((_split_rank(name, f), f) for f in files)
        chosen = {f for _, f in ranked[:take]}
        train += [(f"{name}/{f}", i) for f in files if f not in chosen]
        test += [(f"{name}/{f}", i) for f in files if f in chosen]
    return Listing(root, tuple(top), "fraction", tuple(train), tuple(test))


def header_size(path: Path) -> tuple[int, int] | None:
    """(height, width) in pixels from the image file's header (``PIL.Image.open`` is lazy: it reads the header and
    no pixel data, https://pillow.readthedocs.io/en/stable/reference/Image.html#PIL.Image.open); None when Pillow
    cannot read it. Raises DatasetError when Pillow is not installed."""
    try:
        from PIL import Image
    except ImportError:
        raise DatasetError(f"reading {path}'s size needs Pillow, which {sys.executable} lacks (pip install Pillow; "
                           "requirements/worker.txt has it)", field="path") from None
    try:
        with Image.open(path) as image:  # reads the header only
            return int(image.size[1]), int(image.size[0])
    except Exception:  # noqa: BLE001 - Pillow raises many types for a damaged file; the caller names the file
        return None


def reference_size(cfg: ImageFolderData, listing: Listing) -> tuple[int, int]:
    """(height, width) every image is given: ``cfg.size``, else the first file's (training files in class and name
    order) whose header can be read; with ``on_bad_file: error`` that must be the first file. Raises DatasetError."""
    if cfg.size is not None:
        return int(cfg.size[0]), int(cfg.size[1])
    for rel, _ in listing.files:
        if (size := header_size(listing.root / rel)) is not None:
            return size
        if cfg.on_bad_file == "error":
            raise DatasetError(f"{listing.root / rel}: cannot read the image's size (not a readable PNG or JPEG); "
                               "fix or remove the file, or set dataset.on_bad_file: skip", field="path")
    raise DatasetError(f"{listing.root}: no image whose size can be read", field="path")


def describe(cfg: ImageFolderData) -> tuple[tuple[int, int, int], int]:
    """One image's (height, width, channels) and the number of classes, from the listing and at most a few image
    headers (``reference_size``), with nothing decoded. Raises DatasetError."""
    listing = scan(cfg)
    height, width = reference_size(cfg, listing)
    return (height, width, cfg.channels), len(listing.classes)


def cache_key(cfg: ImageFolderData, listing: Listing) -> str:
    """The hex SHA-256 that names the cache file: every file's relative path, label, byte size and modification time
    (ns), the split, and the options that change the arrays."""
    digest = hashlib.sha256()
    options = {"version": CACHE_VERSION, "size": list(cfg.size) if cfg.size else None, "channels": cfg.channels,
               "on_bad_file": cfg.on_bad_file, "filter": RESIZE_FILTER, "classes": list(listing.classes),
               "layout": listing.layout, "test": len(listing.test)}
    digest.update(json.dumps(options, sort_keys=True).encode())
    for rel, label in listing.files:
        try:
            st = (listing.root / rel).stat()
        except OSError as err:
            raise DatasetError(f"{listing.root / rel}: cannot read ({err.strerror or err})", field="path") from None
        digest.update(f"\n{rel}\0{label}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()


def cache_path(cfg: ImageFolderData, listing: Listing) -> Path:
    """``<cache>/image_folder/<folder name>-<first 24 hex digits of cache_key>.npz``."""
    name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in listing.root.name) or "folder"
    return cache_folder(cfg.cache_dir) / "image_folder" / f"{name}-{cache_key(cfg, listing)[:24]}.npz"


def decode(path: Path, size: tuple[int, int] | None, channels: int) -> np.ndarray:
    """One image file as uint8 (H, W, channels): decoded by Pillow, converted to RGB or L, resized to ``size``
    (height, width) with the bilinear filter unless it already has that size. Raises what Pillow raises for a file
    it cannot decode (OSError, SyntaxError, ValueError, ...) and ImportError without Pillow."""
    from PIL import Image

    with Image.open(path) as opened:
        image = opened.convert("RGB" if channels == 3 else "L")
    if size is not None and image.size != (size[1], size[0]):
        image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.uint8)
    return array.reshape(array.shape[0], array.shape[1], channels)


def _decode_or_reason(path: Path, size: tuple[int, int] | None, channels: int) -> np.ndarray | str:
    try:
        return decode(path, size, channels)
    except ImportError:
        raise
    except Exception as err:  # noqa: BLE001 - Pillow raises many types for a damaged file; the reason is reported
        return f"{type(err).__name__}: {err}".splitlines()[0]


def _decode_all(cfg: ImageFolderData, listing: Listing) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """uint8 (N, H, W, C) images and int64 (N,) labels of ``listing.files`` (train then test) that decoded, and the
    relative paths of those left out."""
    try:
        import PIL  # noqa: F401 - only to say clearly that it is missing
    except ImportError:
        raise DatasetError(f"decoding the images of {listing.root} needs Pillow, which {sys.executable} lacks; "
                           "`harness run` and `harness max-batch` decode them into the cache before the first trial, "
                           "or install Pillow here", field="path") from None
    height, width = reference_size(cfg, listing)
    paths = [listing.root / rel for rel, _ in listing.files]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:  # Pillow decodes without the GIL
        results = list(pool.map(lambda p: _decode_or_reason(p, cfg.size, cfg.channels), paths))
    images, labels, skipped = [], [], []
    for (rel, label), result in zip(listing.files, results):
        if isinstance(result, str):
            if cfg.on_bad_file == "error":
                raise DatasetError(f"{listing.root / rel}: cannot decode the image ({result}); fix or remove the "
                                   "file, or set dataset.on_bad_file: skip", field="path")
            skipped.append(rel)
            continue
        if result.shape[:2] != (height, width):
            raise DatasetError(f"{listing.root}: images of different sizes (the first is {height}x{width}, {rel} is "
                               f"{result.shape[0]}x{result.shape[1]}, height x width); set dataset.size: [H, W] to "
                               "resize them all", field="size")
        images.append(result)
        labels.append(label)
    x = np.stack(images) if images else np.zeros((0, height, width, cfg.channels), np.uint8)
    return x, np.asarray(labels, dtype=np.int64), tuple(skipped)


def _write_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    except OSError as err:
        raise DatasetError(f"cannot write the image cache in {path.parent} ({err.strerror or err}); set "
                           "dataset.cache_dir or HARNESS_DATA to a writable folder", field="cache_dir") from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # a file object: savez adds no suffix
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_CACHED = ("x_train", "x_test", "y", "train", "skipped")


def _read_cache(path: Path, keys: Sequence[str] = _CACHED) -> dict[str, np.ndarray] | None:
    """The cache file's arrays ``keys`` (an ``.npz`` reads each member only when asked for), or None when the file is
    absent or damaged."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in keys}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None  # absent, or damaged: decode again


def _decoded(cfg: ImageFolderData, listing: Listing, log: Callable[[str], None] | None = None,
             keys: Sequence[str] = _CACHED) -> tuple[dict[str, np.ndarray], Path, bool]:
    """The cached arrays ``keys`` of (x_train uint8 (N_train, H, W, C), x_test likewise, y int64 (N,) training then
    test, train: the count of training images, skipped: str array), decoding and caching them first when the cache
    lacks them (``log`` gets one line before that); the cache file; whether it decoded."""
    path = cache_path(cfg, listing)
    if (cached := _read_cache(path, keys)) is not None:
        return cached, path, False
    if log is not None:
        log(f"decoding {len(listing.files)} images of {listing.root} ({len(listing.classes)} classes) into the cache "
            f"{path}")
    x, y, skipped = _decode_all(cfg, listing)
    left_out = set(skipped)
    n_train = sum(1 for rel, _ in listing.train if rel not in left_out)
    arrays = {"x_train": x[:n_train], "x_test": x[n_train:], "y": y, "train": np.asarray(n_train, dtype=np.int64),
              "skipped": np.asarray(skipped, dtype=str) if skipped else np.zeros(0, dtype="<U1")}
    _write_atomically(path, arrays)
    return {key: arrays[key] for key in keys}, path, True


def prepare(cfg: ImageFolderData, log: Callable[[str], None] | None = None) -> Prepared:
    """Makes sure the cache holds the folder's decoded arrays (decoding them when it does not), without building
    the float32 arrays. ``log`` gets one line before decoding starts. Raises DatasetError."""
    start = time.perf_counter()
    arrays, path, decoded = _decoded(cfg, scan(cfg), log, keys=("y", "train", "skipped"))
    n_train = int(arrays["train"])
    return Prepared(path, decoded, n_train, len(arrays["y"]) - n_train, tuple(str(s) for s in arrays["skipped"]),
                    time.perf_counter() - start)


def load(cfg: ImageFolderData, train_images: bool = True) -> Data:
    """The folder as ``Data``: float32 (N, H, W, C) images in [0, 1] and int64 (N,) labels for each split, in the
    listing's order (class, then path), ``num_classes`` the class folders, ``skipped_files`` the files left out as
    unreadable. ``train_images`` False: ``x_train`` is None and the training images are not read from the cache at
    all, for a data loader that decodes them from their files (``train_files``). Reads the cache, decoding into it
    first when it lacks the arrays. Raises DatasetError."""
    listing = scan(cfg)
    keys = _CACHED if train_images else tuple(key for key in _CACHED if key != "x_train")
    arrays, _, _ = _decoded(cfg, listing, keys=keys)
    n_train = int(arrays["train"])
    scale = np.float32(255.0)
    x_train = arrays["x_train"].astype(np.float32) / scale if train_images else None
    y = arrays["y"].astype(np.int64)
    return Data(x_train, y[:n_train], arrays["x_test"].astype(np.float32) / scale, y[n_train:], len(listing.classes),
                skipped_files=tuple(str(s) for s in arrays["skipped"]))


def train_files(listing: Listing, skipped: tuple[str, ...] = ()) -> tuple[Path, ...]:
    """The training images' files, in the order of ``load``'s ``x_train``: ``listing``'s (``scan``), less ``skipped``
    (``load``'s ``Data.skipped_files``, paths relative to the folder): what a data loader decodes
    (``harness.neutral.inputs.InputSource``). Decodes nothing."""
    left_out = set(skipped)
    return tuple(listing.root / rel for rel, _ in listing.train if rel not in left_out)


def _class_image(rng: np.random.Generator, label: int, classes: int, size: tuple[int, int]) -> np.ndarray:
    """uint8 (H, W, 3): a dominant colour for the class (hues spread round the colour wheel), stripes whose angle
    depends on the class, and per-pixel noise."""
    height, width = size
    hue = 2 * np.pi * label / classes
    colour = 127.5 + 90 * np.array([np.cos(hue), np.cos(hue - 2 * np.pi / 3), np.cos(hue + 2 * np.pi / 3)])
    angle = np.pi * label / classes + rng.normal(0, 0.1)
    yy, xx = np.mgrid[0:height, 0:width]
    stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / max(4.0, min(size) / 4) +
                     rng.uniform(0, 2 * np.pi))
    image = colour[None, None, :] + 40 * stripes[..., None] + rng.normal(0, 25, size=(height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def make_image_folder(root: str | os.PathLike[str], classes: int = 2, per_class: int = 64,
                      size: tuple[int, int] = (64, 64), seed: int = 0, image_format: str = "jpeg",
                      test_per_class: int = 0, quality: int = 90) -> list[Path]:
    """Writes a learnable image folder: ``root/class_<k>/<k>_<i>.jpg`` (``.png`` with ``image_format`` png),
    ``per_class`` images of ``size`` (height, width) per class, each class a dominant colour and stripe angle plus
    noise, drawn from ``seed``. With ``test_per_class`` > 0 the layout is ``root/train/class_<k>/`` (``per_class``
    images) and ``root/test/class_<k>/`` (``test_per_class`` more). JPEGs are saved at ``quality``. Requires Pillow.
    Returns the files written, sorted. Raises ValueError for a bad argument."""
    from PIL import Image

    if classes < 1 or per_class < 1 or test_per_class < 0 or min(size) < 1:
        raise ValueError("classes, per_class and the size must be positive, test_per_class >= 0")
    if image_format not in ("jpeg", "png"):
        raise ValueError(f"image_format must be jpeg or png, not {image_format!r}")
    suffix = ".jpg" if image_format == "jpeg" else ".png"
    digits = len(str(classes - 1))
    rng = np.random.default_rng([seed, 0x1F0])
    halves = [("train", per_class), ("test", test_per_class)] if test_per_class else [("", per_class)]
    written = []
    for half, count in halves:
        for label in range(classes):
            folder = Path(root) / half / f"class_{label:0{digits}d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                buffer = io.BytesIO()
                Image.fromarray(_class_image(rng, label, classes, size)).save(
                    buffer, format=image_format.upper(), **({"quality": quality} if image_format == "jpeg" else {}))
                path = folder / f"{label:0{digits}d}_{i:05d}{suffix}"
                path.write_bytes(buffer.getvalue())
                written.append(path)
    return sorted(written)
