"""Sharding: which training samples each rank reads at each step of an epoch.

A pure function of (dataset size, epoch, seed, global batch, batch vector, rank); no MPI,
no torch. `HeteroSampler` serves these shards to a torch DataLoader (as its batch_sampler);
the parameter server's Cursor (parameter_server/work.py) hands out the same permutation.

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

from ..options import user_stacklevel
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


def shard_slice(step: int, row, global_batch: int, rank: int) -> slice:
    """Where `rank`'s local batch of `step` lies in the epoch's permutation: after the
    global batches of the steps before it and the local batches of ranks 0..rank-1 in the
    step's row, b_rank long."""
    start = step * global_batch + int(row[:rank].sum())
    return slice(start, start + int(row[rank]))


def epoch_shard(num_samples: int, epoch: int, seed: int, global_batch: int, batch_sizes, rank: int,
                drop_last: bool = False) -> list[np.ndarray]:
    """Index arrays, one per step, of the samples `rank` reads in `epoch`."""
    perm = epoch_permutation(num_samples, epoch, seed)
    table = step_batch_sizes(num_samples, global_batch, batch_sizes, drop_last)
    return [perm[shard_slice(s, row, global_batch, rank)] for s, row in enumerate(table)]


def eval_shard(num_samples: int, rank: int, world_size: int) -> slice:
    """Contiguous, near-equal slice of the test set for evaluation on `rank`."""
    bounds = np.linspace(0, num_samples, world_size + 1).round().astype(int)
    return slice(int(bounds[rank]), int(bounds[rank + 1]))


class HeteroSampler:
    """A batch sampler that gives this rank its uneven shard, step by step:

        sampler = HeteroSampler(dataset, balancer, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2, pin_memory=True)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader: ...

    Step s of epoch e is the next global batch of the (seed, e) permutation and this rank
    reads its b_i samples of it (epoch_shard), so the union of the ranks' batches does not
    depend on the vector: allocation invariance holds for any map-style Dataset. Every
    rank yields the same number of batches, ceil(N / B) (N // B with drop_last), whatever
    the vector. Iterating opens the epoch at the balancer; each step's local batches are
    read from the balancer's table when the step is handed out (the balancer is told, so
    that dbs changes the vector only from a step no rank has handed out yet, however far
    a DataLoader prefetches). Iterating again while that epoch is open (the loop broke
    out of it) goes on from the next step not yet taken.

    A rank whose share of the last, partial step is 0 gets one placeholder sample (the
    step's first), so that no batch is empty and the loop body is the same on every rank;
    its weight in that step is 0 (DistributedOptimizer), so it changes neither gradient
    nor loss. (Only BatchNorm running statistics see it.)

    state_dict() is the position reached by the training loop (the balancer counts the
    steps taken, however far a DataLoader has prefetched); load_state_dict() continues
    there, in the middle of an epoch if need be.

    A plain class, not a torch Sampler: a DataLoader's batch_sampler needs only to be
    iterable with a length, and the simulator plans with this module without torch."""

    def __init__(self, dataset, balancer, *, seed: int = 0, drop_last: bool = False):
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        self.balancer, self.seed, self.drop_last = balancer, int(seed), bool(drop_last)
        if not isinstance(dataset, int):      # what a rank that sits out probes itself with (training/prober.py)
            balancer.sample_source = dataset
        self.epoch, self._first_step = 0, 0
        self._loaded = False                # a loaded position not iterated yet (state_dict reports it)
        self._warned = False                # a repeated epoch (set_epoch forgotten) was pointed out

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._first_step, self._loaded = int(epoch), 0, False

    def __len__(self) -> int:
        return steps_per_epoch(self.num_samples, self.balancer.global_batch, self.drop_last) - self._first_step

    def iter_arrays(self):
        """The batches as numpy index arrays (the in-memory fast path indexes tensors with them)."""
        epoch, first, b = self.epoch, self._first_step, self.balancer
        if b.open_epoch == epoch:           # the loop broke out of this epoch: go on where it stopped
            table, first = b.epoch_table, b.step
        else:
            self._check_new_epoch(epoch, b)
            table = b.begin_epoch(epoch, self.num_samples, self.drop_last, first, seed=self.seed)
        self._first_step, self._loaded = 0, False
        perm = epoch_permutation(self.num_samples, epoch, self.seed)
        rank, global_batch = self.balancer.rank, self.balancer.global_batch
        for s in range(first, len(table)):
            b.hand_out(s)                   # from here on, dbs leaves step s's vector alone
            part = shard_slice(s, table[s], global_batch, rank)
            yield perm[part] if part.stop > part.start else perm[s * global_batch:s * global_batch + 1]

    def _check_new_epoch(self, epoch: int, balancer) -> None:
        """Warn (once, rank 0) where an epoch that already ended begins again: the loop
        forgot sampler.set_epoch(epoch), and every epoch would repeat one permutation."""
        if epoch < getattr(balancer, "next_epoch", 0) and not self._warned:
            self._warned = True
            if balancer.rank == 0:
                import warnings
                warnings.warn(f"HeteroSampler: epoch {epoch} begins again ({balancer.next_epoch} epoch(s) ended), so "
                              f"its sample order repeats: call sampler.set_epoch(epoch) at the start of every epoch",
                              UserWarning, stacklevel=user_stacklevel())

    def __iter__(self):
        for indices in self.iter_arrays():
            yield indices.tolist()

    def state_dict(self) -> dict:
        b = self.balancer
        if b.open_epoch is not None:
            return {"epoch": b.open_epoch, "step": b.step, "seed": self.seed}
        if self._loaded:                    # loaded, not iterated yet: the position it will go on from
            return {"epoch": self.epoch, "step": self._first_step, "seed": self.seed}
        return {"epoch": b.next_epoch, "step": 0, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"HeteroSampler: the state was saved with seed {state['seed']}, this sampler has "
                             f"seed {self.seed}")
        self.epoch, self._first_step, self._loaded = int(state["epoch"]), int(state["step"]), True
