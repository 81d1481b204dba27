"""Data on the device: an in-memory dataset held in the rank's GPU memory, so that a step
gathers its batch there and nothing crosses the PCIe bus but the step's indices. No MPI
here (the command line decides on every rank together, tools/train.py).

A plain loop on a GPU copies each batch from the host: a gather on the CPU, a copy into
pinned memory, a transfer. A dataset that fits is better copied once: the sampler's
indices then select the batch on the device (InMemoryLoader indexes the tensors where
they are) and the augmentation runs there too. The built-in datasets are in memory
already, and so is a user's TensorDataset of (inputs, int64 labels) (`in_memory`).

How much may go there: the training and test sets of every rank that shares the device
must take at most MEMORY_SHARE of its free memory (a quarter for auto, half for on), the
rest being the model's, its activations' and the kernels' workspace (`fits`).
`--data-on-device`:

* auto: on where the rank computes on a GPU, the dataset is in memory and it fits;
  off otherwise (a CPU rank's data is in its memory already);
* on: the same, up to half the free memory, and a dataset that is not in memory or does
  not fit is refused in one line (on a CPU rank: nothing to move, the batches are
  indexed out of the data in memory as on a GPU);
* off: batches are gathered on the host and copied, as a DataLoader does.
"""
from __future__ import annotations

import dataclasses

import torch

from ..options import DATA_ON_DEVICE, UserError
from .batches import Dataset

MEMORY_SHARE = {"auto": 0.25, "on": 0.5}   # the most of a GPU's free memory the data of its ranks may take


def in_memory(dataset, num_classes: int = 0, name: str = "dataset") -> Dataset | None:
    """The dataset as an in-memory Dataset: itself, or a TensorDataset of (float inputs,
    1-d int64 labels) viewed as one (no copy; not a subclass, whose items may be more than
    the tensors' rows); None for any other dataset."""
    if isinstance(dataset, Dataset):
        return dataset
    tensors = getattr(dataset, "tensors", None)
    if type(dataset) is torch.utils.data.TensorDataset and len(tensors) == 2 \
            and tensors[1].dtype == torch.int64 and tensors[1].dim() == 1 and tensors[0].is_floating_point():
        classes = num_classes or (int(tensors[1].max()) + 1 if len(tensors[1]) else 0)
        return Dataset(x=tensors[0], y=tensors[1], num_classes=int(classes), name=name)
    return None


def data_bytes(*datasets: Dataset) -> int:
    """Bytes of the datasets' tensors."""
    return sum(d.x.nelement() * d.x.element_size() + d.y.nelement() * d.y.element_size() for d in datasets)


def free_memory(device: torch.device) -> int | None:
    """Free bytes of a GPU's memory (None for the CPU: the data is in its memory already)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def fits(need: int, sharing: int, free: int | None, mode: str = "on") -> bool:
    """Whether `sharing` ranks' copies of `need` bytes fit in mode's MEMORY_SHARE of `free`."""
    return free is None or need * sharing <= MEMORY_SHARE[mode] * free


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def decide(mode: str, device, datasets, sharing: int = 1, free: int | None = None) -> bool:
    """Whether this rank's data goes on its device (see the module docstring). datasets:
    the rank's training and test sets (in_memory's view, None where a set is not in
    memory); sharing: the ranks of this host on the same device; free: the device's free
    bytes (free_memory). Raises UserError where `on` cannot be met."""
    if mode not in DATA_ON_DEVICE:
        raise UserError(f"data_on_device: must be one of {', '.join(DATA_ON_DEVICE)}; got {mode!r}")
    if mode == "off" or (mode == "auto" and torch.device(device).type != "cuda"):
        return False
    if any(d is None for d in datasets):
        if mode == "on":
            raise UserError("data_on_device: on needs the data in memory, a built-in dataset or a TensorDataset of "
                            "float inputs and 1-d int64 labels; this one is not: use auto or off")
        return False
    need = data_bytes(*datasets)
    if not fits(need, sharing, free, mode):
        if mode == "on":
            raise UserError(f"data_on_device: the data takes {_gib(need)} a rank, {_gib(need * sharing)} for the "
                            f"{sharing} rank(s) on {device}, more than {MEMORY_SHARE['on']:.0%} of its {_gib(free)} "
                            f"free; use auto or off, or less data")
        return False
    return True


def to_device(dataset: Dataset, device) -> Dataset:
    """The dataset with its tensors on `device` (the same object where they are there)."""
    device = torch.device(device)
    if dataset.x.device == device and dataset.y.device == device:
        return dataset
    return dataclasses.replace(dataset, x=dataset.x.to(device), y=dataset.y.to(device))


def data_on_device(dataset, device, sharing: int = 1, num_classes: int = 0) -> Dataset:
    """The API's way: `dataset` (a built-in Dataset or a TensorDataset of inputs and int64
    labels) on `device`, refused in one line (UserError) where it is not in memory or
    would take more than half the device's free memory with `sharing` ranks holding a
    copy. Iterate it with InMemoryLoader(dataset, sampler)."""
    view = in_memory(dataset, num_classes)
    decide("on", device, [view], sharing, free_memory(device))
    return to_device(view, device)
