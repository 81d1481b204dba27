"""A rank's batches: the in-memory dataset, the fast loader over it, the few samples the
calibration and the parameter server's workers read, and the augmentation. No MPI here.

Every built-in dataset (tools/data.py) is a `Dataset`: float32 tensors (N, C, H, W) and
int64 labels held in memory. It is also a map-style torch Dataset (dataset[i] is
(image, label)), so a DataLoader takes it; but the training loop reads it through
`InMemoryLoader`, the fast path, which indexes a whole local batch out of the tensors at
once. Any other map-style dataset of (tensor, int label), a user's own, goes through
torch's DataLoader; `first_samples` and `fetch_batch` read a few samples of either kind.
The tensors may live on the rank's GPU (device_data.py): the batches are then indexed,
and augmented, there.

The augmentation is a function of (seed, epoch, sample index) only, so a sample is
transformed alike whichever rank reads it: allocation invariance holds with it on.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


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

    def __getitem__(self, index):
        """(image tensor, int label): the map-style Dataset protocol (one sample)."""
        return self.x[index], int(self.y[index])


class InMemoryLoader:
    """The fast path for an in-memory Dataset: the HeteroSampler's batches indexed out of
    the tensors in one gather each (no per-sample collation); with `augment`, the CIFAR
    augmentation of the sampler's epoch. Iterates like DataLoader(dataset,
    batch_sampler=sampler): (x, y) per step."""

    def __init__(self, dataset: Dataset, sampler, augment: bool = False, seed: int = 0):
        self.dataset, self.sampler, self.augment, self.seed = dataset, sampler, augment, seed

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        x_all, y_all = self.dataset.x, self.dataset.y
        for indices in self.sampler.iter_arrays():
            where = host_to(indices, x_all.device)
            x = x_all[where]
            if self.augment:
                x = augment(x, indices, self.sampler.epoch, self.seed)
            yield x, y_all[where]


def host_to(array, device) -> torch.Tensor:
    """A host array (numpy, or a CPU tensor) as a tensor on `device`: on the CPU a view of
    it; for a GPU copied through pinned memory without waiting, so that the host never
    stalls on the device's queue (a plain copy from pageable memory synchronises)."""
    tensor, device = torch.as_tensor(array), torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def fetch_batch(dataset, indices) -> tuple:
    """Samples `indices` of a map-style dataset as a batch (x, y): one gather for an
    in-memory Dataset, else dataset[i] for each and torch's default collation."""
    if isinstance(dataset, Dataset):
        where = host_to(indices, dataset.x.device)
        return dataset.x[where], dataset.y[where]
    from torch.utils.data import default_collate
    return tuple(default_collate([dataset[int(i)] for i in indices]))


def first_samples(dataset, count: int) -> tuple:
    """The first `count` samples of a dataset as a batch (x, y), repeating it if it is
    shorter (what the start-up calibration computes on, the same on every rank)."""
    return fetch_batch(dataset, torch.arange(count) % len(dataset))


def sample_shape_and_classes(dataset, num_classes: int = 0) -> tuple[tuple, int]:
    """(shape of one input, number of classes) of a dataset: num_classes if given, else
    the dataset's num_classes or len(classes) attribute (as torchvision datasets have)."""
    if isinstance(dataset, Dataset):
        return dataset.sample_shape, dataset.num_classes
    x, _ = dataset[0]
    classes = num_classes or getattr(dataset, "num_classes", 0) or len(getattr(dataset, "classes", ()) or ())
    return tuple(x.shape), int(classes)


# --- augmentation --------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 in which every input bit flips
    about half of the output bits."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sample_hashes(indices, epoch: int, seed: int) -> np.ndarray:
    """A 64-bit pseudo-random value per sample, a function of (seed, epoch, index) only."""
    key = np.array([seed, epoch], dtype=np.int64).astype(np.uint64)
    stream = _mix64(_mix64(key[:1] + _GOLDEN) + key[1:] + _GOLDEN)
    return _mix64(stream + np.asarray(indices, dtype=np.uint64) + _GOLDEN)


def augment_params(indices, epoch: int, seed: int, padding: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row offset, column offset, flip) of each sample's crop, offsets in 0..2*padding
    pixels of the padded image: independent bits of the sample's hash."""
    h = sample_hashes(indices, epoch, seed)
    span = np.uint64(2 * padding + 1)
    dy = (h & np.uint64(0xFFFFFFFF)) % span
    dx = ((h >> np.uint64(32)) & np.uint64(0x7FFFFFFF)) % span
    flip = (h >> np.uint64(63)).astype(bool)
    return dy.astype(np.int64), dx.astype(np.int64), flip


def augment(x: torch.Tensor, indices, epoch: int, seed: int, padding: int = 4) -> torch.Tensor:
    """CIFAR-style augmentation of a batch x (N, C, H, W) of dataset samples `indices`:
    pad by `padding` pixels of zeros (the mean colour, since x is normalised, as in He
    et al. 2016), crop HxW at a random offset, flip horizontally with probability 1/2.

    Runs on x's device (the hashes on the host, one small copy of them).
    Each sample's crop and flip are a function of (seed, epoch, its dataset index) only:
    the same whichever rank reads it and whatever else is in its batch, so a step's
    transformed samples do not depend on the batch vector (allocation invariance).
    Vectorised: one gather for the whole batch."""
    n, c, h, w = x.shape
    dy, dx, flip = (host_to(a, x.device) for a in augment_params(indices, epoch, seed, padding))
    padded = F.pad(x, (padding,) * 4)
    height, width = h + 2 * padding, w + 2 * padding
    rows = dy[:, None] + torch.arange(h, device=x.device)     # (N, H) rows of the padded image
    cols = dx[:, None] + torch.arange(w, device=x.device)     # (N, W) columns
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    flat = (rows[:, :, None] * width + cols[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
    return padded.reshape(n, c, height * width).gather(2, flat).view(n, c, h, w)
