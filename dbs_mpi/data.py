"""Datasets as in-memory tensors. No MPI here.

Every dataset is loaded whole into memory as float32 tensors (N, C, H, W), normalised
with its standard mean and std, with int64 labels; a training step only indexes it.

Where files are looked for: `<data_dir>/<name>/`, where data_dir is the `--data-dir`
option, else the environment variable DBS_MPI_DATA_DIR, else `./data`. Fashion-MNIST
is also found in /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist).
"""
from __future__ import annotations

import gzip
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import UserError

ENV_DATA_DIR = "DBS_MPI_DATA_DIR"


class DataError(UserError):
    """Missing, truncated or corrupt data: the message names the file."""


@dataclass(frozen=True)
class Dataset:
    x: torch.Tensor          # float32 (N, C, H, W), normalised
    y: torch.Tensor          # int64 (N,)
    num_classes: int
    name: str

    def __len__(self) -> int:
        return len(self.y)

    @property
    def sample_shape(self) -> tuple:
        return tuple(self.x.shape[1:])


# name: (folder under data_dir, per-channel mean, per-channel std, other folders to look in)
IDX_DATASETS = {
    "mnist": ("mnist", (0.1307,), (0.3081,), ()),
    "fashion-mnist": ("fashion-mnist", (0.2860,), (0.3530,), ("/usr/share/datasets/fashion-mnist",)),
}
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IDX_COUNTS = {"train": 60000, "test": 10000}


def default_data_dir() -> Path:
    return Path(os.environ.get(ENV_DATA_DIR) or "data")


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    return Path(data_dir) if data_dir else default_data_dir()


# --- IDX (MNIST, Fashion-MNIST) ---------------------------------------------------

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


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


def find_file(folders, stem: str) -> Path:
    for folder in folders:
        for name in (stem + ".gz", stem):
            p = Path(folder) / name
            if p.is_file():
                return p
    raise DataError(f"{Path(folders[0]) / (stem + '.gz')}: missing (looked in "
                    f"{', '.join(str(f) for f in folders)}; see `dbs-mpi data fetch`)")


def load_idx_dataset(name: str, split: str, data_dir) -> Dataset:
    folder, mean, std, fallbacks = IDX_DATASETS[name]
    folders = [resolve_data_dir(data_dir) / folder, *fallbacks]
    images_stem, labels_stem = IDX_FILES[split]
    images_path = find_file(folders, images_stem)
    labels_path = find_file(folders, labels_stem)
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3:
        raise DataError(f"{images_path}: expected 3-d images, got shape {list(images.shape)}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(f"{labels_path}: {len(labels)} labels for {len(images)} images in {images_path}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{labels_path}: labels outside 0..9")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - mean[0]) / std[0]
    return Dataset(x=x.contiguous(), y=torch.from_numpy(labels.astype(np.int64)), num_classes=10, name=name)


# --- synthetic ---------------------------------------------------------------

def load_synthetic(split: str, samples: int, shape, classes: int, seed: int) -> Dataset:
    """Learnable synthetic data: each class is a fixed random pattern plus noise.
    Seeded: the same (seed, split) gives the same tensors on every rank."""
    n = samples if split == "train" else max(1, samples // 4)
    g = torch.Generator().manual_seed(1_000_003 * seed + (0 if split == "train" else 1))
    gp = torch.Generator().manual_seed(7919 * seed + 17)  # class patterns shared by both splits
    patterns = torch.randn((classes, *shape), generator=gp)
    y = torch.randint(0, classes, (n,), generator=g)
    x = patterns[y] + 1.5 * torch.randn((n, *shape), generator=g)
    return Dataset(x=x.float().contiguous(), y=y, num_classes=classes, name="synthetic")


def load_dataset(name: str, split: str, data_dir=None, *, subset: int = 0, seed: int = 0,
                 synthetic_samples: int = 4096, synthetic_shape=(1, 28, 28), synthetic_classes: int = 10) -> Dataset:
    """Load `split` ("train" or "test") of dataset `name`; first `subset` samples if > 0."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, got {split!r}")
    if name in IDX_DATASETS:
        ds = load_idx_dataset(name, split, data_dir)
    elif name == "synthetic":
        ds = load_synthetic(split, synthetic_samples, tuple(synthetic_shape), synthetic_classes, seed)
    else:
        raise DataError(f"dataset: unknown dataset {name!r}")
    if subset and subset < len(ds):
        ds = Dataset(x=ds.x[:subset].contiguous(), y=ds.y[:subset].contiguous(), num_classes=ds.num_classes, name=ds.name)
    return ds
