"""The global batch that adapts: Balancer(global_batch="auto"), `dbs-mpi train --global-batch auto`.

The run starts at the global batch B0 (`global_batch_start`), with the learning rate the
user tuned for B0, and measures the gradient noise scale every step (gradient_noise.py).
After every epoch each rank:

  1. predicts a step's seconds T(B) at every candidate B between the lower bound
     (`min_global_batch`, default B0 / 2) and the upper one (`max_global_batch`, the
     training set, ranks x max_local_batch), within 2x of the current B: the slowest
     rank's compute under the planner's speed model (the within-epoch estimate under
     dbs, else the calibration's) for the vector it would run at B, plus the epoch's
     measured seconds of a step that do not grow with B (exchange, update, loading);
  2. takes the B of most goodput, gain(B) / T(B) (planning/goodput.py), where it beats
     the current B's by at least 5%.

Rank 0's choice and its vector are broadcast (one bounded collective per epoch), so the
ranks can never split over a float's last bit, and the next epoch runs at it: B changes
between epochs only, at the same step on every rank, and an epoch still has the training
set's samples (ceil(N / B) steps). The learning rate of every step is the user's
(schedule included) times lr_factor: AdaScale's gain at the current B and noise scale
(default), sqrt(B / B0) or B / B0 (`lr_scaling`), and 1 at or below B0. DistributedOptimizer
applies it for the wrapped optimizer's step and puts the user's value back after it, so
schedulers and checkpoints see the unscaled one.

`set_global_batch(B)` sets B by hand between epochs (a schedule of batch sizes, or a
test's), with any global batch. The method, with its formulas: docs/method.md, section 5.5.
"""
from __future__ import annotations

import math

import numpy as np

from ..mpi.agreement import agree_settings
from ..mpi.waits import wait
from ..options import UserError
from ..planning import allocation, dynamic, goodput, participation, schedule
from ..planning.goodput import AdaptiveBatch  # noqa: F401 (the settings and the decision: pure planning)


class Resizing:
    """The global batch's half of a BatchPolicy (its subclass: the same attributes):
    setting B between epochs, the adaptive choice after each, the learning rate's factor."""

    @property
    def lr_factor(self) -> float:
        """The factor on the learning rate of the coming step (1: B fixed)."""
        if self.adaptive is None:
            return 1.0
        return self.adaptive.factor(self.global_batch, self.noise.estimator.value())

    def schedule_position(self, steps_per_epoch: int) -> int:
        """Steps a schedule of `steps_per_epoch` steps an epoch (at the starting B) has taken
        by now: the epochs done and the open epoch's share of its samples (schedule.position)."""
        e = self._open
        if e is None:
            return schedule.position(self.next_epoch, 0, 1, steps_per_epoch)
        return schedule.position(e.epoch, int(e.table[:e.step].sum()), int(e.table.sum()), steps_per_epoch)

    def _load_global_batch(self, state: dict) -> None:
        """A checkpoint's B: the balancer must have been built as the saved one was (the same
        global batch, or the same adaptive settings: a schedule's steps are counted at the
        start); B is then the state's (it changed by set_global_batch, or adapted). On another
        number of ranks an adaptive B is brought within the new world's bounds."""
        saved = state.get("adaptive")
        mine = self.adaptive and self.adaptive.state_dict()
        if saved and mine and "lower" not in saved and not self.adaptive.lower_given \
                and saved == {k: v for k, v in mine.items() if k != "lower"}:
            self.adaptive.lower = self.adaptive.start    # saved before B could go below its start by default
            mine = saved
        if saved != mine:
            said = lambda a: "a fixed global batch" if a is None else \
                f"a global batch adapting from {a['start']} (down to {a.get('lower', a['start'])}, up to " \
                f"{a['upper']}, lr scaling {a['rule']})"
            raise UserError(f"balancer: the state was saved with {said(saved)}, this balancer has {said(mine)}")
        initial = int(state.get("initial_batch", state["global_batch"]))
        if initial != self.initial_batch:
            raise UserError(f"balancer: the state was saved with global_batch {initial}, this balancer has "
                            f"{self.initial_batch}")
        b = int(state["global_batch"])
        if self.adaptive is not None and state["world_size"] != self.world_size:
            n = self.world_size
            b = max(min(b, n * self.max_local) if self.max_local else b, n * self.min_local)
        if b != self.global_batch:
            self.global_batch = b
            if self.replanner is not None:
                self.replanner.resize(b)

    def set_global_batch(self, global_batch: int) -> np.ndarray:
        """Collective, between epochs: the global batch of the next epochs, with any policy
        (every rank passes the same B: checked first, on every rank) and its vector (rank
        0's). Nothing changes where B is the current one. Returns the vector."""
        if self._open is not None:
            raise RuntimeError(f"set_global_batch() in epoch {self._open.epoch + 1}: the global batch changes between "
                               f"epochs (after end_epoch(), before the sampler's next epoch)")
        agree_settings(self.comm, dict(global_batch=int(global_batch)), self.timeout, "set_global_batch")
        if int(global_batch) != self.global_batch:
            self._resize(int(global_batch))
        return self.batch_sizes

    def _resize(self, global_batch: int) -> None:
        """B changes (every rank with the same B): rank 0's vector for it, the planners resized."""
        vector = np.ascontiguousarray(self._run_at(global_batch), dtype=np.int64)    # (checked on every rank)
        if self.replanner is not None:
            self.replanner.resize(global_batch)
        if self.world_size > 1:
            wait(self.comm.Ibcast(vector, root=0), self.timeout, "broadcasting the new global batch's vector")
        self.global_batch, self.batch_sizes = global_batch, vector
        if self.controller is not None:
            self.controller.global_batch = global_batch

    def _vector_at(self, global_batch: int) -> np.ndarray:
        """The vector this policy runs at `global_batch` (participation.vector_at)."""
        return participation.vector_at(self.policy, self._planning_model(), global_batch, self.world_size,
                                       self.min_local, self.max_local, self.participation)

    def _run_at(self, global_batch: int) -> np.ndarray:
        """The vector a new `global_batch` runs: _vector_at's, not in a set the set check
        banned (Replanner.allowed: within the set that runs now)."""
        vector = self._vector_at(global_batch)
        return vector if self.replanner is None else self.replanner.allowed(vector, self.batch_sizes)

    def _planning_model(self):
        return dynamic.planning_model(self.replanner, self.controller, self.speed_model)

    def _adapt(self, table: np.ndarray, phases: tuple, num_samples: int) -> dict:
        """Collective where B adapts (end_epoch): choose the next epoch's B, set it on every
        rank, and return the epoch's records."""
        if self.adaptive is None:
            return {}
        if self._planning_model() is None:      # not calibrated: the epoch's measurement is the model
            self.speed_model = allocation.SpeedModel.measured(table.sum(axis=0), phases[4].sum(axis=1))
        fixed = goodput.fixed_seconds(*phases[:5])
        upper = min(num_samples, self.world_size * self.max_local) if self.max_local else num_samples
        model = self._planning_model()

        def step_time(b: int) -> float:
            try:
                return goodput.predicted_step(model, b, self._run_at, fixed)
            except UserError:                # outside the bounds: cannot run
                return math.inf

        choice, records = self.adaptive.decide(self.global_batch, self.noise.estimator.value(), step_time, upper)
        chosen = np.array([choice], dtype=np.int64)             # rank 0's: a float's last bit never splits them
        if self.world_size > 1:
            wait(self.comm.Ibcast(chosen, root=0), self.timeout, "broadcasting the next global batch")
        if int(chosen[0]) != self.global_batch:                 # (else the vector and the planners go on as they are)
            self._resize(int(chosen[0]))
        records["next_global_batch"] = np.int64(self.global_batch)
        return records

    def _step_goodput(self, noise, records: dict) -> np.ndarray | None:
        """The epoch's steps' gain and predicted goodput (goodput.per_step) at the epoch's B
        and its predicted step (the epoch's records, _adapt's among them); None where B is fixed."""
        if self.adaptive is None or "global_batch" not in records:
            return None
        return goodput.per_step(int(records["global_batch"]), noise, self.adaptive.start,
                                float(records["predicted_step"]))


def scaled_step(optimizer, factor: float) -> None:
    """optimizer.step() with every group's lr times `factor`, put back after it (the
    user's lr, which schedulers and checkpoints hold, stays unscaled)."""
    if factor == 1.0:
        optimizer.step()
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr * factor
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr
