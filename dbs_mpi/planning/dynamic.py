"""Dynamic batch size: re-planning the batch vector from measured step times.

Pure code, no MPI: the balancer (balancer.py) feeds it every rank's measured step times
and carries its decisions to all ranks; the simulator (simulator.py) drives the same
classes with simulated times. Two rules:

* `DBSController`, once per epoch (`interval = "epoch"`, the DBS paper's granularity):
  the epoch's total compute time per rank against what the model predicted.
* `StepPlanner`, every `interval` steps (the default): a robust estimate of every rank's
  step time over a sliding window of the steps actually run (`StepTimeEstimator`), so
  that a real change of speed is followed within a few steps, while noise, a single
  slow step and a tiny local batch's fixed cost do not move the vector.

Both model rank i's step time as t_i(b) = a_i + c_i b (allocation.SpeedModel) and
allocate with allocation.allocate; docs/method.md, section 5, has the formulas.

The estimator, for every rank, on the last `window` steps (b_k, t_k) with b_k > 0 (a
rank's first step at a local batch its last two steps did not have is left out: the
allocator's one-off cost):

  ratio   r_k = t_k / (a + c b_k)                 measured / predicted
  level   L = median of the last RECENT ratios    (one or two outliers among five never move it)
  line    twice: a least-squares line through the steps kept (a level where the local
          batches do not spread by SPREAD), then the steps further than OUTLIER MADs (at
          least NOISE_FLOOR) from it out; the line through the rest, 0 <= a <= FIXED_MAX
          min t. sigma: the rest's spread (log), smoothed over re-estimates
  change  |log L| >= max(log(1 + follow), CHANGE_Z standard errors of a median of RECENT
          steps) and the line does not explain the recent steps either: the rank's speed
          changed. a and c are scaled by L at once; only the recent steps at the new
          speed stay in the window.
  steady  otherwise: a and c are the line's, or scaled by the inliers' mean ratio.

The planner proposes a new vector when a re-allocation from the updated models lowers
the predicted step time max_i t_i(b_i) by at least `min_gain`, and, where no rank's speed
changed, by GAIN_Z standard errors of the estimate too (a dead band: noise never walks
the vector). A rank whose step time at its current local batch is mostly fixed cost
(per-sample share below TINY_SHARE) may at most double its batch (or grow by B/2n) in
one move: its measurement says little about its per-sample cost, so a large jump would
be a guess (the overshoot of a rank cut to a few samples); the rest of the move follows
once RECENT steps have run at the new batch. After any move the planner waits until
RECENT steps have run with the new vector.

How fast: a persistent change is in the level after ceil(RECENT / 2) = 3 steps, the
planner proposes at the next planning step (every `interval` steps), the proposal
reaches every rank with the next step's exchange, and the new vector applies from the
first step whose samples no rank has handed out yet (`switch_step`). With interval 1
and no prefetching the vector changes 4 steps after the change of speed began (the
5th step is the first under the new vector); a DataLoader prefetching P batches per
rank adds P.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..options import UserError
from .allocation import SpeedModel, round_preserving_sum

RECENT = 5            # steps: a rank's current level is the median of its last RECENT ratios
WINDOW = 32           # steps of history per rank for the fit (dbs_window)
OUTLIER = 3.0         # a step further than this many (normal-scaled) MADs from the median is an outlier
NOISE_FLOOR = 0.05    # relative deviation never called an outlier (a very quiet window rejects nothing normal)
SPREAD = 1.5          # the fit needs local batches a factor SPREAD apart among the inliers
FIXED_MAX = 0.9       # a fitted fixed cost is at most this share of the smallest step time
TINY_SHARE = 0.5      # a rank whose per-sample share of its step time is below this is at a tiny batch
REFIT = 8             # steps: the whole window is re-estimated at least this often after a move ...
REFIT_STEADY = 32     # ... and this often once WINDOW steps have run since (drift; a re-estimate costs
                      # some 0.7 ms right after a training step's backward, with cold caches)
DEFAULT_INTERVAL = 1  # steps between re-plans (chosen by measurement: docs/method.md, section 5)
MAD_SIGMA = 1.4826    # MAD of a normal distribution, in standard deviations
MEDIAN_SE = 1.2533    # standard error of a median of k normal values, in sigma / sqrt(k)
SIGMA_WEIGHT = 0.25   # weight of a new window's spread in the smoothed spread of a rank's steps
CHANGE_Z = 5.0        # a change of level is at least this many standard errors of the recent median
GAIN_Z = 3.0          # a new vector must gain at least this many standard errors of the estimate


def best_step_time(model: SpeedModel, global_batch: int) -> float:
    """A lower bound of the step time any vector can reach: the continuous optimum with
    no bounds, sum_i (t - a_i) / c_i = B."""
    inverse = 1.0 / np.asarray(model.per_sample, float)
    return float((global_batch + np.sum(np.asarray(model.overhead, float) * inverse)) / np.sum(inverse))


def switch_step(next_step: int, horizons) -> int:
    """The first step of the epoch from which a vector announced now may apply: not before
    the next step, and not before any rank's sampler has finished handing out the steps it
    already gave away (horizons: steps of the epoch handed out, per rank)."""
    return max(int(next_step), int(np.max(horizons)) if len(horizons) else 0)


def _median(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Column medians of x where mask holds and x is a number (NaN for a column without
    any). A sort with NaN last: much faster than numpy's masked nanmedian for short columns."""
    keep = mask & ~np.isnan(x)
    ordered = np.sort(np.where(keep, x, np.nan), axis=0)
    count = keep.sum(axis=0)
    columns = np.arange(x.shape[1])
    low, high = ordered[np.maximum((count - 1) // 2, 0), columns], ordered[np.maximum(count // 2, 0), columns]
    return np.where(count > 0, 0.5 * (low + high), np.nan)


# --- the within-epoch rule ------------------------------------------------------------

def robust_fit(b, t, ratio, valid, recent: int) -> dict:
    """The steady rule, per rank (columns) over the window's steps (rows): twice, a line
    (or, where the local batches do not spread, a level) through the steps kept so far
    and the outliers out by their distance from it; then the line through the rest, and
    the rest's mean ratio (`scale`, where at least `recent` steps are left) and spread."""
    log_ratio = np.log(np.where(valid, ratio, np.nan))
    spread = np.where(valid, b, -np.inf).max(axis=0) >= SPREAD * np.where(valid, b, np.inf).min(axis=0)
    inlier = valid
    for _ in range(2):
        residual = log_ratio
        if spread.any():
            line = least_squares_line(b, t, inlier, recent)
            residual = np.where(line["ok"], np.log(t / (line["overhead"] + line["per_sample"] * b)), log_ratio)
        deviation = np.abs(residual - _median(residual, inlier))
        mad = np.nan_to_num(_median(deviation, inlier))
        inlier = valid & (deviation <= np.maximum(OUTLIER * MAD_SIGMA * mad, math.log1p(NOISE_FLOOR)))
    count = inlier.sum(axis=0)
    mean_log = np.where(inlier, log_ratio, 0.0).sum(axis=0) / np.maximum(count, 1)
    kept = np.where(inlier, residual, 0.0)
    sigma = np.sqrt(np.maximum((kept ** 2).sum(0) - kept.sum(0) ** 2 / np.maximum(count, 1), 0.0)
                    / np.maximum(count - 1, 1))
    line = least_squares_line(b, t, inlier, recent) if spread.any() else \
        {"ok": np.zeros(len(count), bool), "per_sample": np.ones(len(count)), "overhead": np.zeros(len(count))}
    return {"scale": np.where(count >= recent, np.exp(mean_log), 1.0), "sigma": sigma, **line}


def least_squares_line(b, t, mask, recent: int) -> dict:
    """Least-squares t = a + c b per rank over the masked steps (0 <= a <= FIXED_MAX
    min t); ok where there are enough steps (recent + 3) and their local batches spread."""
    count = mask.sum(axis=0)
    bi, ti = np.where(mask, b, 0.0), np.where(mask, t, 0.0)
    low, high = np.where(mask, b, np.inf).min(axis=0), np.where(mask, b, -np.inf).max(axis=0)
    shortest = np.where(mask, t, np.inf).min(axis=0)
    sb, st, sbb, sbt = bi.sum(0), ti.sum(0), (bi * bi).sum(0), (bi * ti).sum(0)
    denominator = count * sbb - sb * sb
    slope = (count * sbt - sb * st) / denominator
    overhead = np.clip((st - slope * sb) / np.maximum(count, 1), 0.0, FIXED_MAX * shortest)
    per_sample = (sbt - overhead * sb) / sbb           # the best slope for the clipped fixed cost
    ok = (count >= recent + 3) & (high >= SPREAD * low) & (denominator > 0) & np.isfinite(per_sample) \
        & (per_sample > 0) & np.isfinite(overhead)
    return {"ok": ok, "per_sample": np.where(ok, per_sample, 1.0), "overhead": np.where(ok, overhead, 0.0)}


class StepTimeEstimator:
    """Every rank's affine step-time model, kept up to date from the steps actually run
    (the rule is in the module docstring). observe() once per step and moved() (cheap:
    plain Python on a few numbers per rank, since a dozen numpy calls right after a
    training step's backward cost a few hundred microseconds with cold caches); update()
    re-estimates from the window (numpy) and returns the ranks whose speed changed."""

    def __init__(self, model: SpeedModel, window: int = WINDOW, recent: int = RECENT, follow: float = 0.25):
        if window < recent:
            raise UserError(f"dbs_window: must be at least {recent} steps; got {window}")
        self.model = SpeedModel(np.asarray(model.per_sample, float).copy(), np.asarray(model.overhead, float).copy())
        self.window, self.recent, self.follow = int(window), int(recent), float(follow)
        ranks = len(self.model.per_sample)
        self.batches = np.full((self.window, ranks), np.nan)     # a ring of the last `window` steps
        self.seconds = np.full((self.window, ranks), np.nan)
        self.next = 0                                            # the ring row the next step goes to
        self.sigma = np.zeros(ranks)                             # robust spread of log(t / model(b)) per rank
        self.count = np.zeros(ranks, dtype=np.int64)             # steps in the window per rank
        self._last = [[math.nan, math.nan] for _ in range(ranks)]   # every rank's last two local batches
        self._pending = []                                       # steps observed, not in the ring yet
        self._mirror()

    def _mirror(self) -> None:
        """The per-step path's plain-Python copies: the model, the bound (log) of a change
        of level, and every rank's sides (+1 / -1 / 0: beyond the bound above, below, or
        not) of its last RECENT steps, recomputed from the window."""
        self._a, self._c = self.model.overhead.tolist(), self.model.per_sample.tolist()
        self.bound = self._threshold()
        self._b = self.bound.tolist()
        order = (self.next - 1 - np.arange(self.window)) % self.window          # newest first
        b, t = self.batches[order], self.seconds[order]
        valid = np.isfinite(t)
        kept = valid & (np.cumsum(valid, axis=0) <= self.recent)
        with np.errstate(invalid="ignore", divide="ignore"):
            log_ratio = np.log(t / (self.model.overhead + self.model.per_sample * b))
        sides = (log_ratio >= self.bound).astype(np.int8) - (log_ratio <= -self.bound).astype(np.int8)
        self._recent = [deque(sides[kept[:, i], i][::-1].tolist(), maxlen=self.recent) for i in range(len(self._a))]

    def observe(self, batches, seconds) -> None:
        """One step: every rank's local batch and its measured compute seconds. Not a
        measurement: a rank without samples or without a time, and a rank's first step at
        a local batch other than its last two steps' (one-off costs: the allocator maps
        memory for the new sizes, which made that step up to twice as slow here; two, so
        that an epoch's last, partial step does not cost the next epoch's first)."""
        b = batches.tolist() if hasattr(batches, "tolist") else list(batches)
        t = seconds.tolist() if hasattr(seconds, "tolist") else list(seconds)
        row_b, row_t = [], []
        for i, (bi, ti) in enumerate(zip(b, t)):
            last = self._last[i]
            ok = bi > 0 and ti > 0 and ti < math.inf and (bi == last[0] or bi == last[1])
            last[1], last[0] = last[0], bi
            if ok:
                log_ratio = math.log(ti / (self._a[i] + self._c[i] * bi))
                bound = self._b[i]
                self._recent[i].append(1 if log_ratio >= bound else (-1 if log_ratio <= -bound else 0))
            row_b.append(float(bi) if ok else math.nan)
            row_t.append(float(ti) if ok else math.nan)
        self._pending.append((row_b, row_t))
        if len(self._pending) >= self.window:
            self._flush()

    def _flush(self) -> None:
        """Write the steps observed since the last flush into the ring (numpy)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        rows = (self.next + np.arange(len(pending))) % self.window      # fewer than `window` of them
        self.batches[rows] = np.array([p[0] for p in pending], dtype=float)
        self.seconds[rows] = np.array([p[1] for p in pending], dtype=float)
        self.next = (self.next + len(pending)) % self.window

    def _ordered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row indices, batches and seconds of the window, oldest first."""
        self._flush()
        rows = (np.arange(self.window) + self.next) % self.window
        return rows, self.batches[rows], self.seconds[rows]

    def moved(self) -> bool:
        """Cheap, every step: has some rank's level (the median ratio of its last RECENT
        steps) moved by the bound from its model? That is: more than half of those steps
        beyond it on the same side. (update() then tells a change from a shape.)"""
        half = self.recent / 2
        for sides in self._recent:
            if len(sides) == self.recent and (sides.count(1) > half or sides.count(-1) > half):
                return True
        return False

    def update(self) -> np.ndarray:
        """Re-estimate every rank's model from the window; returns the ranks (bool) whose
        speed changed (followed at once)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._update()

    def _update(self) -> np.ndarray:
        rows, b, t = self._ordered()
        a, c = self.model.overhead, self.model.per_sample
        ratio = t / (a + c * b)
        valid = np.isfinite(ratio) & (ratio > 0)
        from_end = np.cumsum(valid[::-1], axis=0)[::-1]           # valid steps from this one to the newest
        recent = valid & (from_end <= self.recent)
        level = _median(ratio, recent)
        fitted = robust_fit(b, t, ratio, valid, self.recent)
        self.count = valid.sum(axis=0)
        # the steps' spread, smoothed over re-estimates (a window's own is itself noisy); a
        # rank with few steps in its window (after a change) keeps its last
        sigma = np.where(self.sigma > 0, (1 - SIGMA_WEIGHT) * self.sigma + SIGMA_WEIGHT * fitted["sigma"],
                         fitted["sigma"])
        self.sigma = np.where(self.count >= 2 * self.recent, sigma, self.sigma)
        threshold = self._threshold()
        changed = (recent.sum(axis=0) >= self.recent) & (np.abs(np.log(level)) >= threshold)
        if (changed & fitted["ok"]).any():
            # A step time that moved with the local batch is the line's shape, not a new
            # speed: a change is one that neither the model nor the window's line explains.
            level_fit = _median(t / (fitted["overhead"] + fitted["per_sample"] * b), recent)
            changed &= ~(fitted["ok"] & (np.abs(np.log(level_fit)) < threshold))
        scale = np.where(changed, level, fitted["scale"])
        fit = fitted["ok"] & ~changed
        self.model = SpeedModel(per_sample=np.where(fit, fitted["per_sample"], c * scale),
                                overhead=np.where(fit, fitted["overhead"], a * scale))
        if changed.any():                    # forget the steps of the old speed, keep the new one's
            same = recent & (np.abs(np.log(ratio / level)) < threshold)
            stale = ~same & changed
            self.batches[rows] = np.where(stale, np.nan, b)
            self.seconds[rows] = np.where(stale, np.nan, t)
            self.count = np.where(changed, same.sum(axis=0), self.count)
        self._mirror()
        return changed

    def _threshold(self) -> np.ndarray:
        """Per rank, the smallest change of level (log) that is a change of speed: `follow`,
        or CHANGE_Z standard errors of a median of RECENT steps where the steps are noisier."""
        return np.maximum(math.log1p(self.follow), CHANGE_Z * MEDIAN_SE * self.sigma / math.sqrt(self.recent))

    def uncertainty(self) -> np.ndarray:
        """Per rank, the standard error of the model's level (log) from the window's noise."""
        return self.sigma / np.sqrt(np.maximum(self.count, 1))

    def state_dict(self) -> dict:
        self._flush()
        return {"model": self.model.state_dict(), "window": self.window, "recent": self.recent,
                "follow": self.follow, "batches": self.batches.copy(), "seconds": self.seconds.copy(),
                "next": int(self.next), "last_batches": np.array(self._last, dtype=float).T.copy(),
                "sigma": self.sigma.copy(), "count": self.count.copy()}

    @classmethod
    def from_state(cls, state: dict) -> "StepTimeEstimator":
        self = cls(SpeedModel.from_state(state["model"]), int(state["window"]), int(state["recent"]),
                   float(state["follow"]))
        self.batches = np.asarray(state["batches"], float).copy()
        self.seconds = np.asarray(state["seconds"], float).copy()
        self.next = int(state["next"])
        self._last = np.asarray(state["last_batches"], float).reshape(2, -1).T.tolist()
        self.sigma = np.asarray(state["sigma"], float).copy()
        self.count = np.asarray(state["count"], np.int64).copy()
        self._mirror()
        return self


@dataclass
class Proposal:
    """A new vector and the estimate that caused it."""
    vector: np.ndarray              # (R,) int
    per_sample: np.ndarray          # (R,) seconds per sample of the estimate
    overhead: np.ndarray            # (R,) seconds per step of the estimate
    predicted_before: float         # seconds: predicted step time (slowest rank) of the current vector
    predicted_after: float          # ... of the new one
    changed: np.ndarray             # (R,) bool: ranks whose speed changed (rather than drifted)


class StepPlanner:
    """The within-epoch DBS rule: observe() every step, plan() proposes a new vector (or
    None) at most every `interval` steps, scheduled() says from which step a proposal
    applies. Steps are counted over the whole run."""

    def __init__(self, model: SpeedModel, global_batch: int, min_local: int = 1, max_local: int | None = None, *,
                 interval: int = DEFAULT_INTERVAL, window: int = WINDOW, follow: float = 0.25,
                 min_gain: float = 0.03):
        self.estimator = StepTimeEstimator(model, window, RECENT, follow)
        self.global_batch, self.min_local, self.max_local = int(global_batch), int(min_local), max_local
        self.interval, self.min_gain = int(interval), float(min_gain)
        self.step = 0                   # steps observed
        self.capped = False             # the last move stopped short at a tiny batch's growth limit
        self.since_plan = 0             # steps observed since the last planning
        self.since_refit = 0            # steps observed since the window was last re-estimated
        self.hold_until = 2 * RECENT    # no planning before this step (the first steps; a move under way)
        self.settle_until = window      # re-estimate every REFIT steps before this step, then every REFIT_STEADY

    @property
    def model(self) -> SpeedModel:
        return self.estimator.model

    def observe(self, batches, seconds) -> None:
        self.estimator.observe(batches, seconds)
        self.step += 1
        self.since_plan += 1
        self.since_refit += 1

    def plan(self, current) -> Proposal | None:
        """A better vector than `current` (the vector of the steps to come), or None. Every
        `interval` steps the ranks' recent levels are checked (cheap); the whole window is
        re-estimated when one moved, or at least every REFIT steps (drift)."""
        if self.step < self.hold_until or self.since_plan < self.interval:
            return None
        self.since_plan = 0
        refit = REFIT if self.step < self.settle_until else REFIT_STEADY
        if self.since_refit < refit and not self.estimator.moved() and not self.capped:
            return None
        self.since_refit = 0
        changed = self.estimator.update()
        model = self.estimator.model
        current = np.asarray(current, dtype=np.int64)
        before = float(model.predict(current).max())
        gain = self.min_gain
        if not changed.any() and not self.capped:    # drift: a move must also beat the estimate's own noise
            gain = max(gain, -math.expm1(-GAIN_Z * float(self.estimator.uncertainty().max())))
        self.capped = False
        if best_step_time(model, self.global_batch) >= before * (1.0 - gain):
            return None                                    # no vector can pass the dead band
        limit = self._growth_limit(current, model)
        candidate = model.allocate(self.global_batch, self.min_local, limit)
        after = float(model.predict(candidate).max())
        if after > before * (1.0 - gain) or np.array_equal(candidate, current):
            return None
        # a move that a tiny batch's limit held back goes on after the next RECENT steps
        self.capped = limit is not self.max_local and not np.array_equal(
            candidate, model.allocate(self.global_batch, self.min_local, self.max_local))
        self.hold_until = self.step + 1                    # until the announcement says when it applies
        return Proposal(candidate, model.per_sample.copy(), model.overhead.copy(), before, after, changed)

    def _growth_limit(self, current: np.ndarray, model: SpeedModel):
        """Per-rank upper bounds: a rank at a tiny batch (mostly fixed cost) at most doubles
        (or grows by B/2n, if that is more); the others are bounded by max_local only."""
        per_sample = model.per_sample * current
        share = per_sample / np.maximum(model.overhead + per_sample, 1e-300)
        bound = np.inf if not self.max_local else float(self.max_local)
        lift = math.ceil(self.global_batch / (2 * len(current)))
        limit = np.minimum(np.where(share < TINY_SHARE, np.maximum(2 * current, current + lift), np.inf), bound)
        return limit if limit.sum() >= self.global_batch else self.max_local

    def scheduled(self, first_step: int) -> None:
        """A new vector applies from step `first_step` (of the run): plan again once RECENT
        steps have run with it, re-estimating often while the window fills with them."""
        self.hold_until = int(first_step) + RECENT
        self.settle_until = int(first_step) + self.estimator.window

    def state_dict(self) -> dict:
        return {"estimator": self.estimator.state_dict(), "global_batch": self.global_batch,
                "min_local": self.min_local, "max_local": self.max_local and int(self.max_local),
                "interval": self.interval, "min_gain": self.min_gain, "step": self.step, "capped": self.capped,
                "since_plan": self.since_plan, "since_refit": self.since_refit, "hold_until": self.hold_until,
                "settle_until": self.settle_until}

    @classmethod
    def from_state(cls, state: dict) -> "StepPlanner":
        self = cls.__new__(cls)
        self.estimator = StepTimeEstimator.from_state(state["estimator"])
        self.global_batch, self.min_local = int(state["global_batch"]), int(state["min_local"])
        self.max_local = state["max_local"] and int(state["max_local"])
        self.interval, self.min_gain = int(state["interval"]), float(state["min_gain"])
        self.step, self.since_plan, self.since_refit, self.hold_until, self.settle_until = (
            int(state[k]) for k in ("step", "since_plan", "since_refit", "hold_until", "settle_until"))
        self.capped = bool(state["capped"])
        return self


@dataclass
class Switch:
    """A new vector for the steps from `first_step` of the open epoch on, and what caused it."""
    vector: np.ndarray              # (R,) int
    first_step: int                 # step of the epoch from which it applies (may be past its end)
    proposal: Proposal | None       # this rank's estimate behind it (None: forced, or planned elsewhere)


class Replanner:
    """The within-epoch rule as every rank runs it, without MPI: every step each rank sends
    `outgoing()` (its slots, zeros elsewhere), the ranks' arrays are summed (the balancer
    puts them into the gradient allreduce's buffer), and `incoming()` reads the sum:

        [0, R)      every rank's pre-collective compute seconds of the step
        [R, 2R)     every rank's steps of the epoch handed out by its sampler
        [2R, 3R)    rank 0's proposal, announced (zeros: none)
        3R          1 from every rank: the sum is R, or the array is not the sum over all ranks


    Every rank then holds the same times and runs the same planner on them; the vector
    that counts is rank 0's, so that floating-point differences between ranks (other CPUs,
    other libraries) can never split them. A proposal made after step s is announced with
    step s + 1 and applies from switch_step(): the first step whose samples no rank has
    handed out yet, so a DataLoader that prefetched batches never mixes two vectors in
    one step. Values are float32: exact for vectors and step counts below 2**24."""

    def __init__(self, rank: int, world_size: int, global_batch: int, min_local: int = 1, max_local=None, *,
                 model: SpeedModel | None = None, interval: int = DEFAULT_INTERVAL, window: int = WINDOW,
                 follow: float = 0.25, min_gain: float = 0.03):
        self.rank, self.world_size, self.global_batch = int(rank), int(world_size), int(global_batch)
        self.settings = dict(min_local=int(min_local), max_local=max_local and int(max_local), interval=int(interval),
                             window=int(window), follow=float(follow), min_gain=float(min_gain))
        self.planner = None if model is None else self._planner(model)
        self.announce: np.ndarray | None = None     # rank 0: the vector to announce with the next step
        self.proposal: Proposal | None = None       # the last proposal of this rank's planner
        self._out = np.zeros(self.size, dtype=np.float32)
        self._out[-1] = 1.0                         # every rank's count: the sum is the world size
        self._announced = False

    def _planner(self, model: SpeedModel) -> StepPlanner:
        s = self.settings
        return StepPlanner(model, self.global_batch, s["min_local"], s["max_local"], interval=s["interval"],
                           window=s["window"], follow=s["follow"], min_gain=s["min_gain"])

    def start_from(self, model: SpeedModel) -> None:
        """Begin from a calibrated model (else the first step's measurement is the start)."""
        self.planner = self._planner(model)

    @property
    def size(self) -> int:
        return 3 * self.world_size + 1

    def propose(self, vector) -> None:
        """Ask for `vector` (rank 0's request is the one all ranks follow)."""
        vector = np.asarray(vector, dtype=np.int64)
        if vector.shape != (self.world_size,) or vector.sum() != self.global_batch or vector.min() < 0:
            raise ValueError(f"propose: {vector.tolist()} is not {self.world_size} local batches summing to the "
                             f"global batch {self.global_batch}")
        self.proposal = None
        if self.rank == 0:
            self.announce = vector.copy()

    def outgoing(self, seconds: float, handed: int) -> np.ndarray:
        """This rank's slots of the step's sum (one array, reused: the others stay zero)."""
        out, n = self._out, self.world_size
        out[self.rank] = seconds
        out[n + self.rank] = handed
        if self.announce is not None:
            out[2 * n:3 * n] = self.announce
            self.announce = None
            self._announced = True
        elif self._announced:                      # last step's proposal went out: zeros again
            out[2 * n:3 * n] = 0.0
            self._announced = False
        return out

    def incoming(self, summed, row, current, next_step: int, run_step: int) -> Switch | None:
        """The step's sum arrived. row: the step's local batches; current: the vector of the
        steps to come; next_step: the epoch's next step; run_step: steps of the run done.
        Returns the switch announced with this step (None if none), then observes the step
        and plans."""
        summed = summed.tolist() if hasattr(summed, "tolist") else list(summed)   # plain numbers: cheap to read
        n = self.world_size
        seconds, handed, announced = summed[:n], summed[n:2 * n], summed[2 * n:3 * n]
        if len(summed) != self.size or summed[-1] != n:
            raise RuntimeError(
                f"rank {self.rank}: the step's telemetry counts {summed[-1] if summed else 0:g} of the {n} ranks: "
                f"record_step(telemetry=...) takes the sum over all ranks of balancer.telemetry() that the step's "
                f"exchange carried, not this rank's own array")
        switch = None
        if any(announced):
            vector = np.rint(announced).astype(np.int64)
            if vector.sum() != self.global_batch or vector.min() < 0:
                raise RuntimeError(f"the announced batch vector {vector.tolist()} does not sum to the global batch "
                                   f"{self.global_batch}: the step's exchange was corrupted")
            first = switch_step(next_step, handed)
            switch = Switch(vector, first, self.proposal)
            self.proposal = None
            if self.planner is not None:
                self.planner.scheduled(run_step + first - next_step)
        if self.planner is None:                    # not calibrated: start from the first step's measurement
            self.planner = self._planner(SpeedModel.measured(row, np.asarray(seconds)))
        self.planner.observe(row, seconds)
        proposal = self.planner.plan(switch.vector if switch is not None else current)
        if proposal is not None:
            self.proposal = proposal
            if self.rank == 0:
                self.announce = proposal.vector.copy()
        return switch

    def state_dict(self) -> dict:
        proposal = None if self.proposal is None else {
            "vector": self.proposal.vector.copy(), "per_sample": self.proposal.per_sample.copy(),
            "overhead": self.proposal.overhead.copy(), "predicted_before": float(self.proposal.predicted_before),
            "predicted_after": float(self.proposal.predicted_after), "changed": self.proposal.changed.copy()}
        return {"rank": self.rank, "world_size": self.world_size, "global_batch": self.global_batch,
                "settings": dict(self.settings), "planner": None if self.planner is None else self.planner.state_dict(),
                "announce": None if self.announce is None else self.announce.copy(), "proposal": proposal}

    @classmethod
    def from_state(cls, state: dict) -> "Replanner":
        self = cls(int(state["rank"]), int(state["world_size"]), int(state["global_batch"]), **state["settings"])
        self.planner = None if state["planner"] is None else StepPlanner.from_state(state["planner"])
        self.announce = None if state["announce"] is None else np.asarray(state["announce"], np.int64).copy()
        p = state["proposal"]
        self.proposal = None if p is None else Proposal(
            np.asarray(p["vector"], np.int64).copy(), np.asarray(p["per_sample"], float).copy(),
            np.asarray(p["overhead"], float).copy(), float(p["predicted_before"]), float(p["predicted_after"]),
            np.asarray(p["changed"], bool).copy())
        return self


# --- the per-epoch rule (the DBS paper's granularity) -----------------------------------

@dataclass
class DBSController:
    """Dynamic batch size once per epoch: re-plans the vector after every epoch from that
    epoch's measured compute time.

    Rule (docs/method.md, section 11):
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
