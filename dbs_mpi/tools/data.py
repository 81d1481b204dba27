"""The built-in datasets, read from their official files into memory, and `dbs-mpi
data fetch|check`. No MPI here, and torch only where a dataset is loaded into tensors:
`dbs-mpi data` and the simulator (SPLIT_SIZES) run without it.

Every built-in dataset is loaded whole into memory as a `training.batches.Dataset`:
float32 tensors (N, C, H, W), normalised with its standard per-channel mean and std,
with int64 labels. How a rank's batches are cut out of it (and out of a user's own
map-style dataset), and the CIFAR augmentation, are in training/batches.py.

Where files are looked for: `<data_dir>/<name>/`, where data_dir is the `--data-dir`
option, else the environment variable DBS_MPI_DATA_DIR, else `./data`.

* mnist, fashion-mnist: the four IDX files (gzip or raw) in `<data_dir>/<name>/` or
  directly in `<data_dir>/`. Fashion-MNIST is also found in
  /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist).
* cifar10: the python version (`cifar-10-batches-py/`: data_batch_1..5, test_batch)
  or the binary version (`cifar-10-batches-bin/`: data_batch_1..5.bin,
  test_batch.bin), in `<data_dir>/cifar10/` or directly in `<data_dir>/`.

`dbs-mpi data fetch NAME` downloads the official files, verifies their published MD5s
and unpacks them; `dbs-mpi data check` verifies what is there. A mirror
(`--mirror URL` or $DBS_MPI_MIRROR) serves the official files as
`URL/<name>/<official file name>`.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import math
import http.client
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import numpy as np

from ..options import UserError
from .config import ArgumentParser

if TYPE_CHECKING:
    import torch

    from ..training.batches import Dataset

ENV_DATA_DIR = "DBS_MPI_DATA_DIR"
ENV_MIRROR = "DBS_MPI_MIRROR"


class DataError(UserError):
    """Missing, truncated or corrupt data: the message names the file."""


class MissingData(DataError):
    """A file that should be there is not."""


# Per-channel mean and std of the training images (pixel values scaled to [0, 1]).
NORMALISATION = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
# name: (folder under data_dir, other folders to look in)
IDX_DATASETS = {
    "mnist": ("mnist", ()),
    "fashion-mnist": ("fashion-mnist", ("/usr/share/datasets/fashion-mnist",)),
}
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
CIFAR_FOLDER = "cifar10"
CIFAR_VERSIONS = ("cifar-10-batches-py", "cifar-10-batches-bin")   # python, binary
CIFAR_FILES = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
CIFAR_IMAGE_BYTES = 3 * 32 * 32
REAL_DATASETS = ("mnist", "fashion-mnist", "cifar10")
# Samples per split of the official files; `data check` insists on these.
SPLIT_SIZES = {"mnist": {"train": 60000, "test": 10000},
               "fashion-mnist": {"train": 60000, "test": 10000},
               "cifar10": {"train": 50000, "test": 10000}}


def default_data_dir() -> Path:
    return Path(os.environ.get(ENV_DATA_DIR) or "data")


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    return Path(data_dir) if data_dir else default_data_dir()


def normalise(images: np.ndarray, name: str) -> torch.Tensor:
    """uint8 images (N, C, H, W) -> float32, scaled to [0, 1], minus the dataset's
    per-channel mean, divided by its per-channel std."""
    import torch
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in NORMALISATION[name])
    x = torch.from_numpy(images.astype(np.float32)).div_(255.0)
    return x.sub_(mean).div_(std)


def read_bytes(path: Path) -> bytes:
    """A file's bytes, gunzipped if it is gzip; corrupt or truncated gzip -> DataError."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: corrupt or truncated gzip file ({exc})") from None
    return raw


def check_labels(labels: np.ndarray, count: int, path: Path, classes: int = 10) -> None:
    if labels.ndim != 1 or len(labels) != count:
        raise DataError(f"{path}: {len(labels)} labels for {count} images")
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise DataError(f"{path}: labels outside 0..{classes - 1}")


# --- IDX (MNIST, Fashion-MNIST) ---------------------------------------------------

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (MNIST's format), gzip or raw, as a numpy array; validated."""
    path = Path(path)
    data = read_bytes(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number)")
    dtype = np.dtype(_IDX_TYPES[data[2]])
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise DataError(f"{path}: truncated or oversized IDX file: {len(data)} bytes, "
                        f"header {list(shape)} needs {expected}")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def idx_folders(name: str, data_dir) -> list[Path]:
    """Where an IDX dataset's files are looked for: <data_dir>/<name>/, data_dir itself
    (the folder of the files, as for CIFAR-10), then the system's copy."""
    folder, fallbacks = IDX_DATASETS[name]
    root = resolve_data_dir(data_dir)
    return [root / folder, root, *map(Path, fallbacks)]


def find_file(folders, stem: str, name: str) -> Path:
    """stem.gz or stem in the first of `folders` that has either."""
    for folder in folders:
        for file in (stem + ".gz", stem):
            p = Path(folder) / file
            if p.is_file():
                return p
    raise MissingData(f"{Path(folders[0]) / (stem + '.gz')}: missing (looked in "
                      f"{', '.join(str(f) for f in folders)}; see `dbs-mpi data fetch {name}`)")


def read_idx_split(name: str, split: str, data_dir) -> tuple[np.ndarray, np.ndarray, list[Path]]:
    """(uint8 images (N, 1, H, W), labels (N,), the files read) of an IDX dataset."""
    folders = idx_folders(name, data_dir)
    images_path, labels_path = (find_file(folders, stem, name) for stem in IDX_FILES[split])
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(f"{images_path}: expected 3-d uint8 images, got {images.dtype} {list(images.shape)}")
    check_labels(labels, len(images), labels_path)
    return images[:, None], labels.astype(np.int64), [images_path, labels_path]


# --- CIFAR-10 ------------------------------------------------------------------------

_RECONSTRUCT = np.zeros(0).__reduce__()[0]   # numpy's array-unpickling function
# The only globals the official python batches refer to (a numpy uint8 array in a dict).
_CIFAR_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,    # as written by numpy 1.x
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,   # as written by numpy 2.x
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles plain data and numpy arrays, nothing else: no other class or function
    can be named by the file, so loading it cannot run code."""

    def find_class(self, module, name):
        try:
            return _CIFAR_PICKLE_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a CIFAR batch never does") from None


def read_cifar_pickle(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images (N, 3, 32, 32), int64 labels) of one batch of the python version:
    a pickled dict with b"data" (N, 3072) uint8, rows R then G then B, and b"labels"."""
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="bytes").load()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # a corrupt pickle fails in many ways (EOFError, UnpicklingError, ValueError...)
        raise DataError(f"{path}: corrupt or truncated CIFAR-10 batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(entry, dict):
        raise DataError(f"{path}: not a CIFAR-10 batch (a {type(entry).__name__}, not a dict)")
    entry = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}
    data, labels = entry.get("data"), entry.get("labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != CIFAR_IMAGE_BYTES:
        raise DataError(f"{path}: not a CIFAR-10 batch (its 'data' is not a uint8 (N, 3072) array)")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise DataError(f"{path}: not a CIFAR-10 batch (its 'labels' are not integers)") from None
    check_labels(labels, len(data), path)
    return data.reshape(-1, 3, 32, 32), labels


def read_cifar_binary(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images (N, 3, 32, 32), int64 labels) of one file of the binary version:
    records of 1 label byte and 3072 pixel bytes (R, G, B planes of 32x32)."""
    data = read_bytes(path)
    record = 1 + CIFAR_IMAGE_BYTES
    if not data or len(data) % record:
        raise DataError(f"{path}: truncated or not a CIFAR-10 binary batch: {len(data)} bytes is not "
                        f"a positive multiple of the {record}-byte record")
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, record)
    labels = rows[:, 0].astype(np.int64)
    check_labels(labels, len(rows), path)
    return rows[:, 1:].reshape(-1, 3, 32, 32), labels


def cifar_folders(data_dir) -> list[Path]:
    root = resolve_data_dir(data_dir)
    return [base / version for base in (root / CIFAR_FOLDER, root) for version in CIFAR_VERSIONS]


def cifar_files(split: str, data_dir) -> list[Path]:
    """The files of `split` in the first CIFAR-10 folder that exists; MissingData if
    there is none or it lacks one."""
    folders = cifar_folders(data_dir)
    folder = next((f for f in folders if f.is_dir()), None)
    if folder is None:
        raise MissingData(f"{folders[0]}: missing (looked for {', '.join(str(f) for f in folders)}; "
                          f"see `dbs-mpi data fetch cifar10`)")
    suffix = ".bin" if folder.name == CIFAR_VERSIONS[1] else ""
    paths = [folder / (stem + suffix) for stem in CIFAR_FILES[split]]
    for p in paths:
        if not p.is_file():
            raise MissingData(f"{p}: missing (see `dbs-mpi data fetch cifar10`)")
    return paths


def read_cifar_split(split: str, data_dir) -> tuple[np.ndarray, np.ndarray, list[Path]]:
    """(uint8 images (N, 3, 32, 32), int64 labels, the files read) of CIFAR-10."""
    paths = cifar_files(split, data_dir)
    read = read_cifar_binary if paths[0].suffix == ".bin" else read_cifar_pickle
    parts = [read(p) for p in paths]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), paths


def read_split(name: str, split: str, data_dir) -> tuple[np.ndarray, np.ndarray, list[Path]]:
    """(uint8 images (N, C, H, W), int64 labels, files read) of a real dataset."""
    if name == "cifar10":
        return read_cifar_split(split, data_dir)
    return read_idx_split(name, split, data_dir)


# --- synthetic ---------------------------------------------------------------

def load_synthetic(split: str, samples: int, shape, classes: int, seed: int) -> Dataset:
    """Learnable synthetic data: each class is a fixed random pattern plus noise.
    Seeded: the same (seed, split) gives the same tensors on every rank."""
    import torch

    from ..training.batches import Dataset
    n = samples if split == "train" else max(1, samples // 4)
    _check_fits(n, shape, classes)
    g = torch.Generator().manual_seed(1_000_003 * seed + (0 if split == "train" else 1))
    gp = torch.Generator().manual_seed(7919 * seed + 17)  # class patterns shared by both splits
    patterns = torch.randn((classes, *shape), generator=gp)
    y = torch.randint(0, classes, (n,), generator=g)
    x = patterns[y] + 1.5 * torch.randn((n, *shape), generator=g)
    return Dataset(x=x.float().contiguous(), y=y, num_classes=classes, name="synthetic")


def _check_fits(samples: int, shape, classes: int) -> None:
    """The synthetic tensors (3 of their size while they are made) fit in this machine's
    memory: else one line, not torch's allocator error."""
    need = 3 * 4 * (samples + classes) * math.prod(shape)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise DataError(f"synthetic_samples: {samples} samples of shape {tuple(shape)} ({classes} classes) take "
                        f"about {need / 2**30:.1f} GiB to make; this machine has {have / 2**30:.1f} GiB")


def load_dataset(name: str, split: str, data_dir=None, *, subset: int = 0, seed: int = 0,
                 synthetic_samples: int = 4096, synthetic_shape=(1, 28, 28), synthetic_classes: int = 10) -> Dataset:
    """Load `split` ("train" or "test") of dataset `name`; first `subset` samples if > 0."""
    import torch

    from ..training.batches import Dataset
    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, got {split!r}")
    if name in REAL_DATASETS:
        images, labels, _ = read_split(name, split, data_dir)
        if subset:
            images, labels = images[:subset], labels[:subset]
        return Dataset(x=normalise(images, name), y=torch.from_numpy(labels), num_classes=10, name=name)
    if name != "synthetic":
        raise DataError(f"dataset: unknown dataset {name!r}")
    ds = load_synthetic(split, synthetic_samples, tuple(synthetic_shape), synthetic_classes, seed)
    if subset and subset < len(ds):
        ds = Dataset(x=ds.x[:subset].contiguous(), y=ds.y[:subset].contiguous(), num_classes=ds.num_classes,
                     name=ds.name)
    return ds


# --- integrity: published checksums ----------------------------------------------------

UPSTREAM = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/",
}
# The official files to download and their published MD5s (as in torchvision).
DOWNLOADS = {
    "mnist": {"train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
              "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
              "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
              "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c"},
    "fashion-mnist": {"train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                      "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
                      "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
                      "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"},
    "cifar10": {"cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a"},
}
# Published MD5s of the files the loaders read, by file name. Debian's
# dataset-fashion-mnist (0.0~git20200523.55506a9-1) ships gzip files without the
# original file name in their headers (each shorter by exactly that name), so their
# MD5s differ from upstream's; the second MD5s are from the package's md5sums.
# CIFAR-10's binary version has no published per-file MD5s: only its records are checked.
KNOWN_MD5 = {
    "mnist": {f: (m,) for f, m in DOWNLOADS["mnist"].items()},
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "cf8536b0aa1a6ac5fa3f23001093305c"),
        "train-labels-idx1-ubyte.gz": ("25c81989df183df01b3e8a0aad5dffbe", "10bea18fdb374794d4bb42e356e600c9"),
        "t10k-images-idx3-ubyte.gz": ("bef4ecab320f06d8554ea6380940ec79", "f78720b4224f21cce2f2ccf2d7a94c9a"),
        "t10k-labels-idx1-ubyte.gz": ("bb300cfdad3c16e7a12a480ee83cd310", "0d30e22e447f3c33dab9ed536400ac01")},
    "cifar10": {"data_batch_1": ("c99cafc152244af753f735de768cd75f",),
                "data_batch_2": ("d4bba439e000b95fd0a9bffe97cbabec",),
                "data_batch_3": ("54ebc095f3ab1f0389bbae665268c751",),
                "data_batch_4": ("634d18415352ddfa80567beed471001a",),
                "data_batch_5": ("482c414d41f54cd18b22e5b47cb7c3cb",),
                "test_batch": ("40351d587109b95175f43aff81a1287e",)},
}
DEBIAN_PACKAGE, DEBIAN_FOLDER = "dataset-fashion-mnist", "usr/share/datasets/fashion-mnist"


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_md5(name: str, path: Path) -> bool:
    """True if a published MD5 of this file name exists and matches; False if none is
    published; DataError if one is and the file differs."""
    known = KNOWN_MD5[name].get(path.name)
    if not known:
        return False
    actual = md5_of(path)
    if actual not in known:
        raise DataError(f"{path}: MD5 {actual} is not the published {' or '.join(known)} (corrupt or "
                        f"not the official file; delete it and run `dbs-mpi data fetch {name}`)")
    return True


def check_dataset(name: str, data_dir) -> tuple[str, str]:
    """(status, detail) of a real dataset's files: status "ok", "missing" or "bad".
    Reads every file (format, labels), compares record counts with the official
    ones and MD5s with the published ones where those exist."""
    counts, files, verified = {}, [], 0
    try:
        for split in ("train", "test"):
            images, _, paths = read_split(name, split, data_dir)
            if len(images) != SPLIT_SIZES[name][split]:
                raise DataError(f"{', '.join(map(str, paths))}: {len(images)} {split} samples, the official "
                                f"files have {SPLIT_SIZES[name][split]}")
            counts[split] = len(images)
            files += paths
            verified += sum(verify_md5(name, p) for p in paths)
    except MissingData as exc:
        return "missing", str(exc)
    except DataError as exc:
        return "bad", str(exc)
    folders = sorted({str(p.parent) for p in files})
    return "ok", (f"{counts['train']} train + {counts['test']} test samples in {', '.join(folders)}; "
                  f"{verified} of {len(files)} files match published MD5s"
                  + ("" if verified == len(files) else ", the others' records were checked"))


# --- fetch -------------------------------------------------------------------------

MAX_DOWNLOAD_BYTES = 512 << 20   # no official file is larger (CIFAR-10's archive: 163 MiB)
MAX_ARCHIVE_MEMBERS = 64         # CIFAR-10's archive has 9 (a folder and 8 files)
MAX_ARCHIVE_BYTES = 1 << 30      # unpacked; CIFAR-10's: about 178 MiB


def download(url: str, dest: Path, md5: str, timeout: float) -> None:
    """Download url to dest: into a temporary file beside it, renamed into place only
    once complete and matching `md5`. timeout: seconds for connecting and for each read."""
    try:
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    except OSError as exc:
        raise DataError(f"{dest.parent}: cannot write ({exc.strerror or exc})") from None
    try:
        digest, chunk = hashlib.md5(usedforsecurity=False), 1 << 20
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            for _ in range(MAX_DOWNLOAD_BYTES // chunk + 1):
                block = response.read(chunk)
                if not block:
                    break
                digest.update(block)
                out.write(block)
            else:
                raise DataError(f"{url}: larger than {MAX_DOWNLOAD_BYTES >> 20} MiB, not an official file")
        if digest.hexdigest() != md5:
            raise DataError(f"{url}: MD5 {digest.hexdigest()} is not the published {md5} (corrupt download "
                            f"or not the official file)")
        os.replace(tmp, dest)
    except urllib.error.HTTPError as exc:
        raise DataError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise DataError(f"{url}: {exc.reason}") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:  # reset, read timeout, disk full, bad URL
        raise DataError(f"{url}: {getattr(exc, 'strerror', None) or str(exc) or type(exc).__name__}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def safe_members(tar: tarfile.TarFile, archive: Path, top: str) -> list[tarfile.TarInfo]:
    """The archive's members, if every one is a plain file or folder inside `top`/
    (no absolute paths, '..', links or devices); DataError otherwise."""
    members, total = [], 0
    for member in tar:
        if len(members) >= MAX_ARCHIVE_MEMBERS:
            raise DataError(f"{archive}: more than {MAX_ARCHIVE_MEMBERS} members, not the official archive")
        parts = PurePosixPath(member.name).parts
        if not (member.isfile() or member.isdir()) or not parts or parts[0] != top or ".." in parts:
            raise DataError(f"{archive}: unsafe or unexpected member {member.name!r} (only files inside "
                            f"{top}/ are extracted)")
        total += member.size
        if total > MAX_ARCHIVE_BYTES:
            raise DataError(f"{archive}: unpacks to more than {MAX_ARCHIVE_BYTES >> 20} MiB, not the official archive")
        members.append(member)
    return members


def unpack(archive: Path, dest: Path, top: str) -> Path:
    """Extract the tar.gz `archive`, whose members all lie in `top`/, to dest/top,
    through a temporary folder renamed into place (replacing an older dest/top)."""
    staging = Path(tempfile.mkdtemp(dir=dest, prefix=".unpack-"))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in safe_members(tar, archive, top):
                target = staging.joinpath(*PurePosixPath(member.name).parts)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
        if not (staging / top).is_dir():
            raise DataError(f"{archive}: holds no {top}/ folder")
        final = dest / top
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging / top, final)
        return final
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise DataError(f"{archive}: corrupt or truncated archive ({exc})") from None
    except OSError as exc:
        raise DataError(f"{archive}: cannot unpack into {dest} ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch_from_debian(dest: Path, timeout: float) -> None:
    """Fashion-MNIST from Debian's dataset-fashion-mnist without root: `apt-get download`
    and `dpkg-deb -x` in a temporary folder, then the four files copied to dest and
    checked against the package's MD5s. DataError if any step fails."""
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        raise DataError("apt-get or dpkg-deb not found")
    with tempfile.TemporaryDirectory(dir=dest, prefix=".debian-") as tmp:
        try:
            subprocess.run(["apt-get", "download", DEBIAN_PACKAGE], cwd=tmp, check=True, timeout=timeout,
                           capture_output=True, text=True)
            deb = next(Path(tmp).glob(f"{DEBIAN_PACKAGE}_*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "root")], check=True, timeout=timeout,
                           capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            last = (exc.stderr or "").strip().splitlines()[-1:] or [f"exit status {exc.returncode}"]
            raise DataError(f"{exc.cmd[0]}: {last[0]}") from None
        except (subprocess.TimeoutExpired, StopIteration, OSError) as exc:
            raise DataError(f"apt-get download {DEBIAN_PACKAGE}: {exc or 'no package file'}") from None
        for file in DOWNLOADS["fashion-mnist"]:
            src = Path(tmp) / "root" / DEBIAN_FOLDER / file
            if not src.is_file():
                raise DataError(f"{DEBIAN_PACKAGE}: has no {DEBIAN_FOLDER}/{file}")
            verify_md5("fashion-mnist", src)
            os.replace(src, dest / file)


def fetch(name: str, data_dir, mirror: str | None, timeout: float, say=print) -> None:
    """Put dataset `name`'s official files into data_dir, checked; DataError (saying
    which files to put where) if that fails. Files already good are not fetched again.
    Fashion-MNIST comes from Debian's package first when no mirror is set."""
    status, detail = check_dataset(name, data_dir)
    if status == "ok":
        say(f"{name}: already present ({detail})")
        return
    dest = resolve_data_dir(data_dir) / (CIFAR_FOLDER if name == "cifar10" else IDX_DATASETS[name][0])
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{dest}: cannot create ({exc.strerror or exc})") from None
    base = f"{mirror.rstrip('/')}/{name}/" if mirror else UPSTREAM[name]
    try:
        if name == "fashion-mnist" and not mirror:
            try:
                fetch_from_debian(dest, timeout)
                say(f"{name}: unpacked Debian's {DEBIAN_PACKAGE} into {dest}")
            except DataError as exc:
                say(f"{name}: Debian's {DEBIAN_PACKAGE} not available ({exc}); downloading from {base}")
        if check_dataset(name, data_dir)[0] != "ok":
            fetch_files(name, dest, base, timeout, say)
        status, detail = check_dataset(name, data_dir)
        if status != "ok":
            raise DataError(detail)
    except DataError as exc:
        files = ", ".join(DOWNLOADS[name])
        after = " and unpack it there" if name == "cifar10" else ""
        raise DataError(f"{name}: {exc}. Download failed: put {files} (from {UPSTREAM[name]}) into "
                        f"{dest}{after}, then run `dbs-mpi data check {name}`") from None
    say(f"{name}: ok ({detail})")


def fetch_files(name: str, dest: Path, base: str, timeout: float, say) -> None:
    """Download each of the dataset's official files that is not already good in dest;
    unpack CIFAR-10's archive (then delete it)."""
    for file, md5 in DOWNLOADS[name].items():
        target = dest / file
        if name != "cifar10" and target.is_file() and md5_of(target) in KNOWN_MD5[name][file]:
            continue
        start = time.perf_counter()
        download(base + file, target, md5, timeout)
        say(f"{name}: {base + file}: {target.stat().st_size / 2**20:.1f} MiB in "
            f"{time.perf_counter() - start:.1f} s, MD5 ok")
        if name == "cifar10":
            folder = unpack(target, dest, CIFAR_VERSIONS[0])
            target.unlink()
            say(f"{name}: unpacked into {folder}")


# --- `dbs-mpi data` ------------------------------------------------------------------

def _dataset_name(text: str) -> str:
    if text not in REAL_DATASETS:
        raise argparse.ArgumentTypeError(f"unknown dataset {text!r} (choose from {', '.join(REAL_DATASETS)})")
    return text


def _data_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dbs-mpi data", description="Download and verify the datasets (no MPI).",
                allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="{fetch,check}")
    data_dir_help = f"folder holding <dataset>/ (default: ${ENV_DATA_DIR}, else ./data)"
    f = sub.add_parser("fetch", help="download, verify (MD5) and unpack the official files",
                       description="Download the official files, verify their published MD5s, unpack them.",
                       allow_abbrev=False)
    f.add_argument("names", nargs="+", metavar="NAME", type=_dataset_name, help=", ".join(REAL_DATASETS))
    f.add_argument("--data-dir", help=data_dir_help)
    f.add_argument("--mirror", metavar="URL", help=f"fetch URL/<dataset>/<official file name> instead of "
                   f"upstream (default: ${ENV_MIRROR}, else upstream)")
    f.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="time limit for connecting and for each read (default: 60)")
    c = sub.add_parser("check", help="verify that the files are present and intact",
                       description="Verify files (format, record counts, published MD5s); one line per "
                                   "dataset; exit status 1 if any is missing or bad.", allow_abbrev=False)
    c.add_argument("names", nargs="*", metavar="NAME", type=_dataset_name,
                   help=f"datasets to check (default: all of {', '.join(REAL_DATASETS)})")
    c.add_argument("--data-dir", help=data_dir_help)
    return p


def run_check(names, data_dir) -> int:
    """Print one line per dataset; 0 if all are ok, else 1."""
    failed = False
    for name in names or REAL_DATASETS:
        status, detail = check_dataset(name, data_dir)
        print(f"{name:<14} {status:<8} {detail}", flush=True)
        failed |= status != "ok"
    return 1 if failed else 0


def data_main(argv) -> int:
    """`dbs-mpi data fetch|check ...`; returns the exit status. A user's error (bad
    option, failed download) prints one line `dbs-mpi: error: ...` and returns 2."""
    try:
        args = _data_parser().parse_args(argv)
        if args.command == "check":
            return run_check(args.names, args.data_dir)
        if args.timeout <= 0:
            raise UserError(f"--timeout: must be positive seconds, got {args.timeout}")
        mirror = args.mirror or os.environ.get(ENV_MIRROR) or None
        for name in dict.fromkeys(args.names):
            fetch(name, args.data_dir, mirror, args.timeout, say=lambda msg: print(msg, flush=True))
        return 0
    except UserError as exc:
        print(f"dbs-mpi: error: {exc}", file=sys.stderr, flush=True)
        return 2
