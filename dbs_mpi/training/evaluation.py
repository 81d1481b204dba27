"""Evaluation on a test set shared out over the ranks.

Each rank takes a contiguous, near-equal slice of the test set (sharding.eval_shard),
computes the sum of its losses, its correct predictions and its sample count, and one
sum-allreduce gives every rank the mean loss and the accuracy over the whole test set.
Evaluation is not training: the ranks split the test set evenly whatever their speed
(it is not part of any epoch time).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..mpi.collectives import allreduce_sum
from ..mpi.devices import model_device, to_device
from ..planning import sharding
from .batches import Dataset


def test_batches(dataset, part: slice, batch_size: int, num_workers: int = 0):
    """(x, y) batches of samples part.start .. part.stop - 1 of `dataset`."""
    if isinstance(dataset, Dataset):          # in memory: slices, no copies
        for start in range(part.start, part.stop, batch_size):
            stop = min(start + batch_size, part.stop)
            yield dataset.x[start:stop], dataset.y[start:stop]
        return
    from torch.utils.data import DataLoader, Subset
    if part.stop > part.start:
        yield from DataLoader(Subset(dataset, range(part.start, part.stop)), batch_size=batch_size,
                              num_workers=num_workers)


def evaluate(comm, model: torch.nn.Module, dataset, loss_fn=None, *, batch_size: int = 1024, num_workers: int = 0,
             timeout: float = 600.0) -> tuple[float, float]:
    """Collective: (mean loss, accuracy) of `model` over the whole `dataset` (a map-style
    dataset of (input, int label)), each rank computing its slice. loss_fn: the mean loss
    over a batch (default: cross-entropy)."""
    loss_fn = loss_fn or F.cross_entropy
    part = sharding.eval_shard(len(dataset), comm.Get_rank(), comm.Get_size())
    sums = np.zeros(3)
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for x, y in test_batches(dataset, part, batch_size, num_workers):
                x, y = to_device((x, y), device)
                out = model(x)
                sums += (float(loss_fn(out, y)) * len(y), (out.argmax(1) == y).sum().item(), len(y))
    finally:
        model.train(was_training)
    allreduce_sum(comm, sums, timeout)
    return sums[0] / max(sums[2], 1), sums[1] / max(sums[2], 1)
