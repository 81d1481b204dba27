"""Sharding: which training samples each rank reads at each step of an epoch.

A pure function of (dataset size, epoch, seed, global batch, batch vector, rank); no MPI.

Every epoch the training set is permuted with a generator seeded by (seed, epoch).
Step s of the epoch consumes the next global batch of that permutation,
perm[s*B : s*B + B_s], and rank i reads the slice of it that starts after the local
batches of ranks 0..i-1 and has length b_i. So

* every rank takes ceil(N / B) steps (N // B with drop_last), whatever the vector:
  the step count depends only on N and B, never on b_i (no hang);
* the union of the local batches of a step is the same set of samples for any
  vector and any number of ranks: with sample-weighted aggregation the update is the
  one a single process makes on that global batch (allocation invariance);
* rank i's shard of the epoch has size steps * b_i, in proportion to b_i.

The last, partial global batch (N mod B samples) is split in proportion to the vector
(a rank may get none; it still joins the step's collective).
"""
from __future__ import annotations

import numpy as np

from .allocation import split_partial


def epoch_permutation(num_samples: int, epoch: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def steps_per_epoch(num_samples: int, global_batch: int, drop_last: bool = False) -> int:
    if drop_last:
        return num_samples // global_batch
    return -(-num_samples // global_batch)


def step_batch_sizes(num_samples: int, global_batch: int, batch_sizes, drop_last: bool = False) -> np.ndarray:
    """(steps x ranks) local batch of every rank at every step of an epoch."""
    b = np.asarray(batch_sizes, dtype=np.int64)
    if b.sum() != global_batch:
        raise ValueError(f"batch vector {b.tolist()} does not sum to the global batch {global_batch}")
    steps = steps_per_epoch(num_samples, global_batch, drop_last)
    table = np.tile(b, (steps, 1))
    tail = num_samples - (steps - 1) * global_batch if steps else 0
    if steps and tail < global_batch:
        table[-1] = split_partial(tail, b)
    return table


def epoch_shard(num_samples: int, epoch: int, seed: int, global_batch: int, batch_sizes, rank: int,
                drop_last: bool = False) -> list[np.ndarray]:
    """Index arrays, one per step, of the samples `rank` reads in `epoch`."""
    perm = epoch_permutation(num_samples, epoch, seed)
    table = step_batch_sizes(num_samples, global_batch, batch_sizes, drop_last)
    out = []
    for s, row in enumerate(table):
        start = s * global_batch + int(row[:rank].sum())
        out.append(perm[start:start + int(row[rank])])
    return out


def eval_shard(num_samples: int, rank: int, world_size: int) -> slice:
    """Contiguous, near-equal slice of the test set for evaluation on `rank`."""
    bounds = np.linspace(0, num_samples, world_size + 1).round().astype(int)
    return slice(int(bounds[rank]), int(bounds[rank + 1]))
