"""What the parameter server hands out: pieces of each epoch's samples, sized by the
workers' local batches (dbs-sgd: re-planned at every epoch from their compute times),
until the budget is used up or the segment pauses (a checkpoint boundary, a stop request).

Work and the budget. The server hands out the samples: a work message says
(epoch, start, count), and the worker reads perm_epoch[start:start + count] of the
sharding module's seeded permutation (the same one the synchronous path uses). The
budget is the synchronous one, counted at the server: cfg.epochs passes over the
training set, every sample handed out exactly once per epoch, all of epoch e before
any of epoch e+1; cfg.time_budget > 0 also stops handing out work after that many
seconds. Two ways of handing out:
  * rounds (hardsync: softsync_wait with c = lambda): round s of an epoch is step s of
    the synchronous path; worker w reads the slice the synchronous rank w-1 reads
    (sharding.step_batch_sizes: in the last, partial step a worker may get 0 samples).
  * stream (everything else): the next min(b_w, left in the epoch) samples.
An epoch ends when all its samples (and those of the epochs before) have been applied;
the weights are copied then, and each copy is evaluated on the test set by all ranks
together at the end of the segment ("Checkpoints" below: at the next checkpoint
boundary, or after the run), with the training clock stopped, so evaluation is not in
epoch times and never interrupts a segment.

`Cursor` is the position in the data (no torch, no MPI: the simulator drives the same
one); `WorkPlan` adds the workers' local batches and dbs-sgd's re-plans.
"""
from __future__ import annotations

import numpy as np

from ..planning.sharding import shard_slice, step_batch_sizes, steps_per_epoch
from .groups import in_rounds


class Cursor:
    """Hands out the training samples: the budget, counted at the server.

    `take(w)` returns (epoch, start, count): worker w reads perm_epoch[start:start+count].
    Epoch e's samples are all handed out before any of epoch e+1. `begin_epoch(vector)`
    is called by the server whenever `needs_epoch` is true, with the local batches
    (over workers) to use in that epoch. Rounds mode follows the synchronous path's
    steps exactly (take must then be called for workers 0..lambda-1 in order)."""

    def __init__(self, num_samples: int, global_batch: int, epochs: int, drop_last: bool, workers: int,
                 rounds: bool):
        self.num_samples, self.global_batch, self.epochs = num_samples, global_batch, epochs
        self.drop_last, self.workers, self.rounds = drop_last, workers, rounds
        steps = steps_per_epoch(num_samples, global_batch, drop_last)
        self.per_epoch = min(num_samples, steps * global_batch)   # samples handed out per epoch
        self.epoch, self.pos, self.row, self.next_worker = 0, 0, 0, 0
        self.started = -1                                         # last epoch begin_epoch was called for
        self.vector = None
        self.table = None

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    @property
    def needs_epoch(self) -> bool:
        return not self.done and self.started < self.epoch

    def begin_epoch(self, vector) -> None:
        self.vector = np.asarray(vector, dtype=np.int64)
        self.started = self.epoch
        if self.rounds:
            self.table = step_batch_sizes(self.num_samples, self.global_batch, self.vector, self.drop_last)

    def take(self, worker: int) -> tuple[int, int, int]:
        assert not self.done and self.started == self.epoch
        epoch = self.epoch
        if self.rounds:
            if worker != self.next_worker:
                raise RuntimeError(f"rounds: work for worker {worker} out of turn (expected {self.next_worker})")
            part = shard_slice(self.row, self.table[self.row], self.global_batch, worker)
            start, count = part.start, part.stop - part.start
            self.next_worker = (worker + 1) % self.workers
            if self.next_worker == 0:
                self.row += 1
                if self.row == len(self.table):
                    self.epoch, self.row = self.epoch + 1, 0
            return epoch, start, count
        start = self.pos
        count = min(int(self.vector[worker]), self.per_epoch - self.pos)
        self.pos += count
        if self.pos == self.per_epoch:
            self.epoch, self.pos = self.epoch + 1, 0
        return epoch, start, count


class WorkPlan:
    """The data cursor, the workers' local batches (vector) and dbs-sgd's controller with
    the compute times it re-plans from (measure)."""

    def __init__(self, cfg, num_samples: int, workers: int, vector, controller, log):
        self.cfg, self.workers, self.log = cfg, workers, log
        rounds = in_rounds(cfg.strategy, cfg.softsync_wait, cfg.softsync_n, workers)
        self.cursor = Cursor(num_samples, cfg.global_batch, cfg.epochs, cfg.drop_last, workers, rounds)
        self.vector = np.asarray(vector, dtype=np.int64)
        self.controller = controller                 # dbs-sgd: re-plans self.vector at every epoch
        self.measure = [[] for _ in range(workers)]  # dbs-sgd: (count, compute seconds) since the last re-plan
        self.segment_epoch = 0                       # cursor epoch when this segment began

    def new_segment(self) -> None:
        self.segment_epoch = self.cursor.epoch

    def out_of_work(self, elapsed: float) -> bool:
        """The budget is used up: every epoch handed out, or cfg.time_budget seconds passed."""
        return self.cursor.done or (self.cfg.time_budget > 0 and elapsed >= self.cfg.time_budget)

    def pausing(self, signal: int) -> bool:
        """Hand out no more work in this segment: a stop request, or the cursor reached an
        epoch boundary at which a checkpoint is due. Decided per push, so in rounds mode
        (replies to a whole round at once, after one push) a round is never split."""
        if signal:
            return True
        c, every = self.cursor, self.cfg.checkpoint_every
        return bool(every) and c.needs_epoch and c.epoch > self.segment_epoch and c.epoch % every == 0

    def measured(self, w: int, count: int, seconds: float) -> None:
        """Worker w computed `count` samples in `seconds` (dbs-sgd re-plans from these; kept
        only where it does, since every checkpoint holds them)."""
        if count and self.controller is not None:
            self.measure[w].append((count, seconds))

    def take(self, w: int) -> tuple[int, int, int, bool]:
        """Worker w's next (epoch, start, count), and whether it opened a new epoch (whose
        local batches are then self.vector)."""
        opened = self.cursor.needs_epoch
        if opened:
            self._begin_epoch()
        return (*self.cursor.take(w), opened)

    def _begin_epoch(self) -> None:
        """The cursor enters a new epoch: dbs-sgd re-plans the local batches first, from
        the workers' compute times since the last re-plan."""
        epoch = self.cursor.epoch
        if self.controller is not None and epoch > 0:
            counts = [[c for c, _ in m] for m in self.measure]
            rows = max(len(c) for c in counts)
            if rows:
                table = np.zeros((rows, self.workers))
                for w, c in enumerate(counts):
                    table[:len(c), w] = c
                measured = [sum(t for _, t in m) for m in self.measure]
                new, _ = self.controller.update(self.vector, table, measured)
                if not np.array_equal(new, self.vector):
                    self.log(f"dbs-sgd: local batches {self.vector.tolist()} -> {new.tolist()} for epoch {epoch + 1}")
                self.vector = np.asarray(new, dtype=np.int64)
            self.measure = [[] for _ in range(self.workers)]
        self.cursor.begin_epoch(self.vector)
