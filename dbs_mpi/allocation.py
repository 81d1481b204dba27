"""Allocation: how the global batch B is split into local batches b_i.

Pure functions, no MPI. A rank's step time is modelled as

    t_i(b) = a_i + c_i * b          (a_i: fixed cost per step, seconds; c_i = 1/v_i: seconds per sample)

and the allocation equalises t_i over ranks subject to sum_i b_i = B and
min_local <= b_i <= max_local (heterogeneous gradient computing; the affine model
and why it beats the plain rule at small local batches: docs/method.md). With a_i = 0
this is the plain proportional rule b_i = B * v_i / sum_j v_j of the DBS paper.
Continuous solutions are rounded with largest remainders so that sum_i b_i = B exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import UserError


class AllocationError(UserError):
    pass


def _bounds(n: int, min_local: int, max_local: int | None):
    hi = np.full(n, np.inf if not max_local else float(max_local))
    lo = np.full(n, float(min_local))
    return lo, hi


def round_preserving_sum(x, total: int, lo=None, hi=None) -> np.ndarray:
    """Integers near x summing to total (largest remainders), within [lo, hi] element-wise.

    x must already satisfy lo <= x <= hi and sum(x) == total (up to rounding)."""
    x = np.asarray(x, dtype=float)
    n = len(x)
    if not np.all(np.isfinite(x)):
        raise AllocationError(f"local batch sizes must be finite numbers; got {x.tolist()}")
    lo = np.zeros(n) if lo is None else np.asarray(lo, dtype=float)
    hi = np.full(n, np.inf) if hi is None else np.asarray(hi, dtype=float)
    base = np.clip(np.floor(x + 1e-9), np.ceil(lo), np.floor(hi)).astype(np.int64)
    short = int(total - base.sum())
    remainder = x - base
    # Hand out the missing units to the largest remainders (ties: lower rank first),
    # never above a rank's bound; take surplus units from the smallest remainders.
    order = sorted(range(n), key=lambda i: (-remainder[i], i))
    while short > 0:
        progressed = False
        for i in order:
            if short == 0:
                break
            if base[i] + 1 <= hi[i]:
                base[i] += 1
                short -= 1
                progressed = True
        if not progressed:
            raise AllocationError(f"cannot place {total} samples within the local batch bounds")
    while short < 0:
        progressed = False
        for i in reversed(order):
            if short == 0:
                break
            if base[i] - 1 >= lo[i]:
                base[i] -= 1
                short += 1
                progressed = True
        if not progressed:
            raise AllocationError(f"cannot place {total} samples within the local batch bounds")
    return base


def check_feasible(global_batch: int, n: int, min_local: int = 1, max_local: int | None = None) -> None:
    if n < 1:
        raise AllocationError("need at least one rank")
    if global_batch < 1:
        raise AllocationError(f"global_batch must be positive; got {global_batch}")
    if min_local < 0:
        raise AllocationError(f"min_local_batch must be zero or positive; got {min_local}")
    if global_batch < n * min_local:
        raise AllocationError(f"global_batch {global_batch} is smaller than {n} ranks x min_local_batch {min_local}")
    if max_local and global_batch > n * max_local:
        raise AllocationError(f"global_batch {global_batch} is larger than {n} ranks x max_local_batch {max_local}")


def allocate(global_batch: int, per_sample, overhead=None, min_local: int = 1,
             max_local: int | None = None) -> np.ndarray:
    """Local batches that equalise a_i + c_i * b_i (c = per_sample seconds, a = overhead seconds).

    Returns an int64 vector summing to global_batch, each in [min_local, max_local]."""
    c = np.asarray(per_sample, dtype=float)
    n = len(c)
    check_feasible(global_batch, n, min_local, max_local)
    if not np.all(np.isfinite(c)) or np.any(c <= 0):
        raise AllocationError(f"per-sample times must be positive and finite; got {c.tolist()}")
    a = np.zeros(n) if overhead is None else np.asarray(overhead, dtype=float)
    if len(a) != n or not np.all(np.isfinite(a)) or np.any(a < 0):
        raise AllocationError(f"overheads must be {n} non-negative finite numbers; got {a.tolist()}")
    lo, hi = _bounds(n, min_local, max_local)
    # Only ratios matter: measure time in units of the fastest rank's per-sample time,
    # and cap how much slower a rank can be so that no step of the bisection overflows
    # (a rank 1e15 times slower than the fastest gets min_local for any real B anyway).
    unit = float(c.min())
    with np.errstate(over="ignore"):
        c = np.minimum(c / unit, 1e15)
        a = np.minimum(a / unit, 1e15)

    def fill(t):  # local batches that finish by time t, within bounds
        return np.clip((t - a) / c, lo, hi)

    # Bisection on the common step time t: sum(fill(t)) is continuous and non-decreasing.
    t_lo = float(np.min(a + c * lo))
    t_hi = float(np.max(a + c * np.minimum(hi, global_batch)))
    for _ in range(200):
        t_mid = 0.5 * (t_lo + t_hi)
        if fill(t_mid).sum() < global_batch:
            t_lo = t_mid
        else:
            t_hi = t_mid
    x = fill(t_hi)
    x *= global_batch / x.sum()  # remove the bisection's last sliver before rounding
    x = np.clip(x, lo, hi)
    return round_preserving_sum(x, global_batch, lo, hi)


def proportional(global_batch: int, weights, min_local: int = 1, max_local: int | None = None) -> np.ndarray:
    """b_i proportional to weights (speeds), summing to global_batch."""
    w = np.asarray(weights, dtype=float)
    check_feasible(global_batch, len(w), min_local, max_local)
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise AllocationError(f"speeds must be positive and finite; got {w.tolist()}")
    w = np.maximum(w / w.max(), 1e-15)  # relative speeds; 1/w cannot overflow
    return allocate(global_batch, 1.0 / w, None, min_local, max_local)


def equal(global_batch: int, n: int, min_local: int = 1, max_local: int | None = None) -> np.ndarray:
    """The ssgd baseline: equal local batches (the first B mod n ranks get one more)."""
    return proportional(global_batch, np.ones(n), min_local, max_local)


def split_partial(count: int, batch_sizes) -> np.ndarray:
    """Split a last, partial global batch of `count` samples in proportion to the vector
    (a rank may get 0 samples)."""
    b = np.asarray(batch_sizes, dtype=float)
    return round_preserving_sum(count * b / b.sum(), count)


def step_time(batch_sizes, per_sample, overhead) -> np.ndarray:
    """Predicted per-rank step time of a vector under the affine model."""
    return np.asarray(overhead, float) + np.asarray(per_sample, float) * np.asarray(batch_sizes, float)


@dataclass
class SpeedModel:
    """Per-rank affine step-time model, t_i(b) = overhead[i] + per_sample[i] * b (seconds)."""
    per_sample: np.ndarray
    overhead: np.ndarray

    @classmethod
    def fit(cls, small_batch, small_time, large_batch, large_time, affine: bool = True) -> "SpeedModel":
        """Two-point fit from a benchmark at two local batch sizes (arrays over ranks).
        With affine=False the fixed cost is folded into the per-sample time (proportional rule)."""
        bs, ts = np.asarray(small_batch, float), np.asarray(small_time, float)
        bl, tl = np.asarray(large_batch, float), np.asarray(large_time, float)
        if not affine:
            return cls(per_sample=tl / bl, overhead=np.zeros_like(tl))
        slope = np.where(bl > bs, (tl - ts) / np.maximum(bl - bs, 1e-12), tl / bl)
        # Noise can make the slope non-positive or the intercept negative: fall back to
        # the proportional reading of the larger batch, which is always sensible.
        bad = (slope <= 0) | (ts - slope * bs < 0)
        # A disturbed small-batch timing can also fake a huge fixed cost, which would
        # starve the rank: the fixed cost is capped at half of the small batch's time.
        overhead = np.clip(np.where(bad, 0.0, tl - slope * bl), 0.0, 0.5 * ts)
        per_sample = np.where(bad, tl / bl, (tl - overhead) / bl)
        return cls(per_sample=per_sample, overhead=overhead)

    @classmethod
    def measured(cls, samples, seconds) -> "SpeedModel":
        """The proportional model of one measurement: seconds / samples per sample, no fixed cost."""
        samples, seconds = np.asarray(samples, float), np.asarray(seconds, float)
        per_sample = np.where((samples > 0) & (seconds > 0), seconds / np.maximum(samples, 1), np.nan)
        fill = np.nanmax(per_sample) if np.isfinite(per_sample).any() else 1.0
        return cls(per_sample=np.where(np.isfinite(per_sample), per_sample, fill), overhead=np.zeros(len(samples)))

    def state_dict(self) -> dict:
        return {"per_sample": np.asarray(self.per_sample, float).copy(), "overhead": np.asarray(self.overhead, float).copy()}

    @classmethod
    def from_state(cls, state: dict) -> "SpeedModel":
        return cls(per_sample=np.asarray(state["per_sample"], float).copy(),
                   overhead=np.asarray(state["overhead"], float).copy())

    def allocate(self, global_batch, min_local=1, max_local=None) -> np.ndarray:
        return allocate(global_batch, self.per_sample, self.overhead, min_local, max_local)

    def predict(self, batch_sizes) -> np.ndarray:
        return step_time(batch_sizes, self.per_sample, self.overhead)


@dataclass
class DBSController:
    """Dynamic batch size: re-plans the vector after every epoch from that epoch's
    measured compute time.

    Rule (documented in the README):
      1. For every rank, ratio = measured compute time / time the model predicted
         for the local batches the rank actually ran.
      2. If |ratio - 1| >= follow (default 25%), the speed really changed: the
         rank's model is scaled by ratio at once (followed within one epoch).
         Otherwise it is noise or drift: the model is scaled by
         1 + smoothing * (ratio - 1) (an exponential moving average).
      3. A new vector is computed from the updated model; it replaces the current one
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
        self.model = SpeedModel(self.model.per_sample * scale, self.model.overhead * scale)
        candidate = self.model.allocate(self.global_batch, self.min_local, self.max_local)
        now = self.model.predict(current).max()
        new = self.model.predict(candidate).max()
        current = np.asarray(current, dtype=np.int64)
        if new > now * (1.0 - self.min_gain):
            return current, ratio
        move = candidate - current
        reverse = np.zeros(len(current), bool)
        if self.last_move is not None:
            reverse = np.sign(move) * np.sign(self.last_move) < 0
            damp = reverse & self.last_reversed
            if damp.any():
                target = np.where(damp, current + 0.5 * move, candidate).astype(float)
                hi = None if self.max_local is None else np.full(len(current), float(self.max_local))
                target = np.clip(target * self.global_batch / target.sum(), self.min_local, hi)
                candidate = round_preserving_sum(target, self.global_batch, np.full(len(current), self.min_local), hi)
                move = candidate - current
        self.last_move, self.last_reversed = move, reverse
        return candidate, ratio
