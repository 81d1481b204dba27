"""The per-epoch rule (the DBS paper's granularity, `interval = "epoch"`): the epoch's
total compute time per rank against what the model predicted, once an epoch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..allocation import SpeedModel, round_preserving_sum
from ..participation import allocate_for


@dataclass
class DBSController:
    """Dynamic batch size once per epoch: re-plans the vector after every epoch from that
    epoch's measured compute time.

    Rule (docs/method.md, section 5.4):
      1. For every rank, ratio = measured compute time / time the model predicted
         for the local batches the rank actually ran.
      2. If |ratio - 1| >= follow (default 25%), the speed really changed: the
         rank's model is scaled by ratio at once (followed within one epoch).
         Otherwise it is noise or drift: the model is scaled by
         1 + smoothing * (ratio - 1) (an exponential moving average).
      3. A new vector is computed from the updated model over the ranks that take part
         (a rank that sits out, participation.py, stays out); it replaces the current one
         only if it lowers the predicted step time (max over ranks) by at least
         min_gain (default 3%): a dead band, so that noise never makes it oscillate.
      4. A rank whose local batch would reverse direction for the second epoch in a
         row goes only half way: an oscillation (seen under heavy load, where a step
         time measured at a very small local batch misleads the model) is damped,
         while a change of speed, and its end, are each followed at once.
    With model="proportional", smoothing=1, follow=0 and min_gain=0 this is exactly the
    DBS authors' rule r_i <- (r_i/t_i) / sum_j (r_j/t_j).
    """
    model: SpeedModel
    global_batch: int
    min_local: int = 1
    max_local: int | None = None
    smoothing: float = 0.5
    follow: float = 0.25
    min_gain: float = 0.03
    last_move: np.ndarray | None = None          # vector change of the last re-allocation
    last_reversed: np.ndarray | None = None      # ranks whose last change reversed the one before

    def state_dict(self) -> dict:
        """The controller's state (plain types and arrays, for checkpoints)."""
        arrays = {k: (None if getattr(self, k) is None else np.asarray(getattr(self, k)).copy())
                  for k in ("last_move", "last_reversed")}
        return {"model": self.model.state_dict(), "global_batch": int(self.global_batch),
                "min_local": int(self.min_local), "max_local": self.max_local and int(self.max_local),
                "smoothing": float(self.smoothing), "follow": float(self.follow), "min_gain": float(self.min_gain),
                **arrays}

    @classmethod
    def from_state(cls, state: dict) -> "DBSController":
        arrays = {k: (None if state[k] is None else np.asarray(state[k]).copy()) for k in ("last_move", "last_reversed")}
        if arrays["last_reversed"] is not None:
            arrays["last_reversed"] = arrays["last_reversed"].astype(bool)
        if arrays["last_move"] is not None:
            arrays["last_move"] = arrays["last_move"].astype(np.int64)
        return cls(model=SpeedModel.from_state(state["model"]), global_batch=int(state["global_batch"]),
                   min_local=int(state["min_local"]), max_local=state["max_local"] and int(state["max_local"]),
                   smoothing=float(state["smoothing"]), follow=float(state["follow"]),
                   min_gain=float(state["min_gain"]), **arrays)

    def update(self, current, steps_batches, measured_time) -> tuple[np.ndarray, np.ndarray]:
        """current: the vector of the epoch; steps_batches: (steps x ranks) local batches
        actually run; measured_time: (ranks,) compute seconds over those steps.
        Returns (new vector, ratio measured/predicted per rank)."""
        steps_batches = np.asarray(steps_batches, float)
        measured = np.asarray(measured_time, float)
        predicted = (self.model.overhead * np.count_nonzero(steps_batches, axis=0)
                     + self.model.per_sample * steps_batches.sum(axis=0))
        ratio = np.where(predicted > 0, measured / np.maximum(predicted, 1e-12), 1.0)
        ratio = np.where(np.isfinite(ratio) & (ratio > 0), ratio, 1.0)
        jump = np.abs(ratio - 1.0) >= self.follow
        scale = np.where(jump, ratio, 1.0 + self.smoothing * (ratio - 1.0))
        self.model = self.model.scaled(scale)
        current = np.asarray(current, dtype=np.int64)
        part = current > 0                       # the set it has: ranks that sit out stay out
        candidate = allocate_for(self.model, self.global_batch, self.min_local, self.max_local, within=part)
        if candidate is None or \
                self.model.predict(candidate).max() > self.model.predict(current).max() * (1.0 - self.min_gain):
            return current, ratio
        move = candidate - current
        reverse = np.zeros(len(current), bool)
        if self.last_move is not None:
            reverse = np.sign(move) * np.sign(self.last_move) < 0
            damp = reverse & self.last_reversed
            if damp.any():
                candidate[part] = self._half_way(current[part], move[part], candidate[part], damp[part])
                move = candidate - current
        self.last_move, self.last_reversed = move, reverse
        return candidate, ratio

    def _half_way(self, current, move, candidate, damp) -> np.ndarray:
        """The vector of the ranks taking part with the damped ones (`damp`) moved half way."""
        target = np.where(damp, current + 0.5 * move, candidate).astype(float)
        hi = None if self.max_local is None else np.full(len(current), float(self.max_local))
        target = np.clip(target * self.global_batch / target.sum(), self.min_local, hi)
        return round_preserving_sum(target, self.global_batch, np.full(len(current), self.min_local), hi)
