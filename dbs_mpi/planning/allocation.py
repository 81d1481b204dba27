"""Allocation: how the global batch B is split into local batches b_i.

Pure functions, no MPI. A rank's step time is modelled as

    t_i(b) = a_i + c_i * b          (a_i: fixed cost per step, seconds; c_i = 1/v_i: seconds per sample)

and the allocation equalises t_i over ranks subject to sum_i b_i = B and
min_local <= b_i <= max_local (heterogeneous gradient computing; the affine model
and why it beats the plain rule at small local batches: docs/method.md). With a_i = 0
this is the plain proportional rule b_i = B * v_i / sum_j v_j of the DBS paper.
Continuous solutions are rounded so that sum_i b_i = B exactly and the longest step is as
short as any integer vector's (round_by_time).
The start-up calibration fits the model (SpeedModel.fit) to every rank's step times at
two local batches (calibration_batches).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..options import UserError


class AllocationError(UserError):
    pass


def _bounds(n: int, min_local: int, max_local):
    """(lo, hi) per rank; max_local: None or 0 (no bound), a number, or one bound per rank."""
    if max_local is None or np.ndim(max_local) == 0:
        hi = np.full(n, np.inf if not max_local else float(max_local))
    else:
        hi = np.asarray(max_local, dtype=float).copy()
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


def check_feasible(global_batch: int, n: int, min_local: int = 1, max_local=None) -> None:
    """AllocationError unless global_batch samples fit n ranks within the bounds (max_local:
    None or 0 for none, a number, or one bound per rank)."""
    if n < 1:
        raise AllocationError("need at least one rank")
    if global_batch < 1:
        raise AllocationError(f"global_batch must be positive; got {global_batch}")
    if min_local < 0:
        raise AllocationError(f"min_local_batch must be zero or positive; got {min_local}")
    if global_batch < n * min_local:
        raise AllocationError(f"global_batch {global_batch} is smaller than {n} ranks x min_local_batch {min_local}")
    if max_local is not None and np.ndim(max_local) > 0:
        if len(max_local) != n or global_batch > np.sum(max_local) or np.min(max_local) < min_local:
            raise AllocationError(f"cannot place {global_batch} samples within the per-rank bounds "
                                  f"{np.asarray(max_local).tolist()} (at least {min_local} each)")
    elif max_local and global_batch > n * max_local:
        raise AllocationError(f"global_batch {global_batch} is larger than {n} ranks x max_local_batch {max_local}")


def least_time(fill, global_batch: int, t_lo: float, t_hi: float) -> float:
    """Bisection: the least common step time t in [t_lo, t_hi] by which the ranks' local
    batches fill(t) (non-decreasing in t) hold global_batch samples."""
    for _ in range(200):
        t_mid = 0.5 * (t_lo + t_hi)
        if fill(t_mid).sum() < global_batch:
            t_lo = t_mid
        else:
            t_hi = t_mid
    return t_hi


def allocate(global_batch: int, per_sample, overhead=None, min_local: int = 1, max_local=None) -> np.ndarray:
    """Local batches that equalise a_i + c_i * b_i (c = per_sample seconds, a = overhead seconds),
    rounded so that the longest step is as short as any integer vector's (round_by_time).

    Returns an int64 vector summing to global_batch, each in [min_local, max_local]
    (max_local: None or 0 for no bound, a number, or one bound per rank)."""
    x, a, c, lo, hi = _balanced(global_batch, per_sample, overhead, min_local, max_local)
    return round_by_time(x, global_batch, a, c, lo, hi)


def _balanced(global_batch: int, per_sample, overhead, min_local: int, max_local) -> tuple:
    """The continuous local batches that equalise a_i + c_i * b_i within the bounds, the
    model in units of the fastest rank's per-sample time, and the bounds: (x, a, c, lo, hi)."""
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

    # sum(fill(t)) is continuous and non-decreasing in the common step time t
    t = least_time(fill, global_batch, float(np.min(a + c * lo)), float(np.max(a + c * np.minimum(hi, global_batch))))
    x = fill(t)
    x *= global_batch / x.sum()  # remove the bisection's last sliver before rounding
    return np.clip(x, lo, hi), a, c, lo, hi


def round_by_time(x, total: int, overhead, per_sample, lo, hi) -> np.ndarray:
    """Integers near x summing to total that keep the longest step short: the floors, then
    each missing sample to the rank that would finish it soonest (a + c (b + 1); ties:
    the largest remainder, then the lower rank, as round_preserving_sum). Largest
    remainders alone gave the sample to a rank at 1.4 samples whose one sample costs
    30 ms, beside ranks at 43 ms: its step took 60 ms instead of 43."""
    x = np.asarray(x, dtype=float)
    base = np.clip(np.floor(x + 1e-9), np.ceil(lo), np.floor(hi)).astype(np.int64)
    short = int(total - base.sum())
    if short < 0 or short > len(x):          # (not the floors of a sum of `total`)
        return round_preserving_sum(x, total, lo, hi)
    for _ in range(short):
        finish = np.where(base + 1 <= hi, overhead + per_sample * (base + 1), np.inf)
        if not np.isfinite(finish).any():
            raise AllocationError(f"cannot place {total} samples within the local batch bounds")
        soonest = finish <= finish.min() * (1.0 + 1e-9)
        base[int(np.argmax(np.where(soonest, x - base, -np.inf)))] += 1
    return base


def proportional(global_batch: int, weights, min_local: int = 1, max_local: int | None = None) -> np.ndarray:
    """b_i proportional to weights (speeds), summing to global_batch (largest remainders)."""
    w = np.asarray(weights, dtype=float)
    check_feasible(global_batch, len(w), min_local, max_local)
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise AllocationError(f"speeds must be positive and finite; got {w.tolist()}")
    w = np.maximum(w / w.max(), 1e-15)  # relative speeds; 1/w cannot overflow
    x, _, _, lo, hi = _balanced(global_batch, 1.0 / w, None, min_local, max_local)
    return round_preserving_sum(x, global_batch, lo, hi)     # (a split by weights: no step to shorten)


def equal(global_batch: int, n: int, min_local: int = 1, max_local: int | None = None) -> np.ndarray:
    """The ssgd baseline: equal local batches (the first B mod n ranks get one more)."""
    return proportional(global_batch, np.ones(n), min_local, max_local)


def split_partial(count: int, batch_sizes) -> np.ndarray:
    """Split a last, partial global batch of `count` samples in proportion to the vector
    (a rank may get 0 samples)."""
    b = np.asarray(batch_sizes, dtype=float)
    return round_preserving_sum(count * b / b.sum(), count)


def step_time(batch_sizes, per_sample, overhead) -> np.ndarray:
    """Predicted per-rank step time of a vector under the affine model; a rank with no
    samples computes nothing (0: it sits out, participation.py)."""
    b = np.asarray(batch_sizes, float)
    return np.where(b > 0, np.asarray(overhead, float) + np.asarray(per_sample, float) * b, 0.0)


def calibration_batches(global_batch: int, world_size: int, min_local: int = 1,
                        max_local: int | None = None) -> tuple[int, int]:
    """The two local batches the start-up calibration times: about half and twice the
    equal share B/n (within the bounds), so that the fit spans the vector's range."""
    small = max(min_local, global_batch // (2 * world_size))
    large = max(small + 1, min(global_batch, 2 * global_batch // world_size))
    if max_local:
        large = min(large, max_local)
        small = min(small, max(1, large - 1))
    return small, large


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

    def scaled(self, scale) -> "SpeedModel":
        """Every rank's step time `scale` times (a number, or one per rank): a rank's speed changed."""
        scale = np.asarray(scale, float)
        return SpeedModel(np.asarray(self.per_sample, float) * scale,
                          np.asarray(self.overhead, float) * scale)

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
