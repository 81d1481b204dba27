"""The step-time estimate of every rank, from the steps it actually ran (the first idea
of dynamic batch size: know each rank's speed now, robustly).

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
          steps, or NOISE_FLOOR while the steps' noise is not known yet) and the line
          does not explain the recent steps either: the rank's speed
          changed. a and c are scaled by L at once; only the recent steps at the new
          speed stay in the window.
  steady  otherwise: a and c are the line's, or scaled by the inliers' mean ratio.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from ...options import UserError
from ..allocation import SpeedModel


RECENT = 5            # steps: a rank's current level is the median of its last RECENT ratios


WINDOW = 32           # steps of history per rank for the fit (dbs_window)


OUTLIER = 3.0         # a step further than this many (normal-scaled) MADs from the median is an outlier


NOISE_FLOOR = 0.05    # relative deviation never called an outlier (a very quiet window rejects nothing normal)


SPREAD = 1.5          # the fit needs local batches a factor SPREAD apart among the inliers


FIXED_MAX = 0.9       # a fitted fixed cost is at most this share of the smallest step time


TINY_SHARE = 0.5      # a rank whose per-sample share of its step time is below this is at a tiny batch


REFIT = 8             # steps: the whole window is re-estimated at least this often after a move ...


REFIT_STEADY = 32     # ... and this often once WINDOW steps have run since (drift; a re-estimate costs
                      # some 0.7 ms right after a training step's backward, with cold caches: numpy
                      # over the whole window, where observe() and moved() are plain Python)


MAD_SIGMA = 1.4826    # MAD of a normal distribution, in standard deviations


MEDIAN_SE = 1.2533    # standard error of a median of k normal values, in sigma / sqrt(k)


SIGMA_WEIGHT = 0.25   # weight of a new window's spread in the smoothed spread of a rank's steps


CHANGE_Z = 5.0        # a change of level is at least this many standard errors of the recent median


def _median(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Column medians of x where mask holds and x is a number (NaN for a column without
    any). A sort with NaN last: much faster than numpy's masked nanmedian for short columns."""
    keep = mask & ~np.isnan(x)
    ordered = np.sort(np.where(keep, x, np.nan), axis=0)
    count = keep.sum(axis=0)
    columns = np.arange(x.shape[1])
    low, high = ordered[np.maximum((count - 1) // 2, 0), columns], ordered[np.maximum(count // 2, 0), columns]
    return np.where(count > 0, 0.5 * (low + high), np.nan)


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


def change_bound(follow: float, sigma, recent: int = RECENT) -> np.ndarray:
    """Per rank, the smallest change of level (log) that is a change of speed: `follow`, or
    CHANGE_Z standard errors of a median of `recent` steps of spread `sigma` where the
    steps are noisier; NOISE_FLOOR where sigma is 0 (steps without noise, or not measured
    yet: with follow 0 every step then read as a change, which wiped the window before
    sigma could be measured)."""
    noise = CHANGE_Z * MEDIAN_SE * np.asarray(sigma, float) / math.sqrt(recent)
    return np.maximum(math.log1p(follow), np.where(noise > 0, noise, math.log1p(NOISE_FLOOR)))


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
        self.next_row = 0                                            # the ring row the next step goes to
        self.sigma = np.zeros(ranks)                             # robust spread of log(t / model(b)) per rank
        self.count = np.zeros(ranks, dtype=np.int64)             # steps in the window per rank
        self._last = [[math.nan, math.nan] for _ in range(ranks)]   # every rank's last two local batches
        self._pending = []                                       # steps observed, not in the ring yet
        self._refresh_plain_copies()

    def _refresh_plain_copies(self) -> None:
        """The per-step path's plain-Python copies: the model, the bound (log) of a change
        of level, and every rank's sides (+1 / -1 / 0: beyond the bound above, below, or
        not) of its last RECENT steps, recomputed from the window."""
        self._a, self._c = self.model.overhead.tolist(), self.model.per_sample.tolist()
        self.bound = self._threshold()
        self._change_bound = self.bound.tolist()
        order = (self.next_row - 1 - np.arange(self.window)) % self.window          # newest first
        b, t = self.batches[order], self.seconds[order]
        valid = np.isfinite(t)
        kept = valid & (np.cumsum(valid, axis=0) <= self.recent)
        with np.errstate(invalid="ignore", divide="ignore"):
            log_ratio = np.log(t / (self.model.overhead + self.model.per_sample * b))
        sides = (log_ratio >= self.bound).astype(np.int8) - (log_ratio <= -self.bound).astype(np.int8)
        self._recent_sides = [deque(sides[kept[:, i], i][::-1].tolist(), maxlen=self.recent) for i in range(len(self._a))]

    def observe(self, batches, seconds, warm=None) -> None:
        """One step: every rank's local batch and its measured compute seconds. Not a
        measurement: a rank without samples or without a time, and a rank's first step at
        a local batch other than its last two steps' (one-off costs: the allocator maps
        memory for the new sizes, which made that step up to twice as slow here; two, so
        that an epoch's last, partial step does not cost the next epoch's first), unless
        `warm` (bool per rank) says the time was taken after a pass at that size (a probe)."""
        b = batches.tolist() if hasattr(batches, "tolist") else list(batches)
        t = seconds.tolist() if hasattr(seconds, "tolist") else list(seconds)
        warm = [False] * len(b) if warm is None else warm
        row_b, row_t = [], []
        for i, (bi, ti) in enumerate(zip(b, t)):
            last = self._last[i]
            ok = bi > 0 and ti > 0 and ti < math.inf and (bi == last[0] or bi == last[1] or bool(warm[i]))
            last[1], last[0] = last[0], bi
            if ok:
                log_ratio = math.log(ti / (self._a[i] + self._c[i] * bi))
                bound = self._change_bound[i]
                self._recent_sides[i].append(1 if log_ratio >= bound else (-1 if log_ratio <= -bound else 0))
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
        rows = (self.next_row + np.arange(len(pending))) % self.window      # fewer than `window` of them
        self.batches[rows] = np.array([p[0] for p in pending], dtype=float)
        self.seconds[rows] = np.array([p[1] for p in pending], dtype=float)
        self.next_row = (self.next_row + len(pending)) % self.window

    def _ordered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row indices, batches and seconds of the window, oldest first."""
        self._flush()
        rows = (np.arange(self.window) + self.next_row) % self.window
        return rows, self.batches[rows], self.seconds[rows]

    def moved(self) -> bool:
        """Cheap, every step: has some rank's level (the median ratio of its last RECENT
        steps) moved by the bound from its model? That is: more than half of those steps
        beyond it on the same side. (update() then tells a change from a shape.)"""
        for sides in self._recent_sides:
            if len(sides) == self.recent and max(sides.count(1), sides.count(-1)) > self.recent / 2:
                return True
        return False

    def update(self) -> np.ndarray:
        """Re-estimate every rank's model from the window; returns the ranks whose speed changed."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._update()

    def _update(self) -> np.ndarray:
        rows, b, t = self._ordered()
        a, c = self.model.overhead, self.model.per_sample
        ratio = t / (a + c * b)
        valid = np.isfinite(ratio) & (ratio > 0)
        from_end = np.cumsum(valid[::-1], axis=0)[::-1]           # valid steps from this one to the newest
        last_steps = valid & (from_end <= self.recent)             # each rank's last RECENT valid steps
        level = _median(ratio, last_steps)
        fitted = robust_fit(b, t, ratio, valid, self.recent)
        self.count = valid.sum(axis=0)
        # the steps' spread, smoothed over re-estimates (a window's own is itself noisy); a
        # rank with few steps in its window (after a change) keeps its last
        sigma = np.where(self.sigma > 0, (1 - SIGMA_WEIGHT) * self.sigma + SIGMA_WEIGHT * fitted["sigma"],
                         fitted["sigma"])
        self.sigma = np.where(self.count >= 2 * self.recent, sigma, self.sigma)
        threshold = self._threshold()
        changed = (last_steps.sum(axis=0) >= self.recent) & (np.abs(np.log(level)) >= threshold)
        if (changed & fitted["ok"]).any():
            # A step time that moved with the local batch is the line's shape, not a new
            # speed: a change is one that neither the model nor the window's line explains.
            level_fit = _median(t / (fitted["overhead"] + fitted["per_sample"] * b), last_steps)
            changed &= ~(fitted["ok"] & (np.abs(np.log(level_fit)) < threshold))
        scale = np.where(changed, level, fitted["scale"])
        fit = fitted["ok"] & ~changed
        self.model = SpeedModel(per_sample=np.where(fit, fitted["per_sample"], c * scale),
                                overhead=np.where(fit, fitted["overhead"], a * scale))
        if changed.any():                    # forget the steps of the old speed, keep the new one's
            same = last_steps & (np.abs(np.log(ratio / level)) < threshold)
            stale = ~same & changed
            self.batches[rows] = np.where(stale, np.nan, b)
            self.seconds[rows] = np.where(stale, np.nan, t)
            self.count = np.where(changed, same.sum(axis=0), self.count)
        self._refresh_plain_copies()
        return changed

    def _threshold(self) -> np.ndarray:
        """Per rank, the smallest change of level (log) that is a change of speed (change_bound)."""
        return change_bound(self.follow, self.sigma, self.recent)

    def flat(self) -> np.ndarray:
        """Per rank, whether the steps in its window lack local batches SPREAD apart (or it
        has none): its per-sample cost is not being measured, only its level."""
        low, high = self.measured_range()
        return ~(high >= SPREAD * low)

    def measured_range(self) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, the smallest and the largest local batch among its window's steps (inf and 0: none)."""
        _, b, t = self._ordered()
        kept = np.isfinite(t)
        return np.where(kept, b, np.inf).min(axis=0, initial=np.inf), np.where(kept, b, 0.0).max(axis=0, initial=0.0)

    def uncertainty(self) -> np.ndarray:
        """Per rank, the standard error of the model's level (log) from the window's noise."""
        return self.sigma / np.sqrt(np.maximum(self.count, 1))

    def state_dict(self) -> dict:
        self._flush()
        return {"model": self.model.state_dict(), "window": self.window, "recent": self.recent,
                "follow": self.follow, "batches": self.batches.copy(), "seconds": self.seconds.copy(),
                "next": int(self.next_row), "last_batches": np.array(self._last, dtype=float).T.copy(),
                "sigma": self.sigma.copy(), "count": self.count.copy()}

    @classmethod
    def from_state(cls, state: dict) -> "StepTimeEstimator":
        self = cls(SpeedModel.from_state(state["model"]), int(state["window"]), int(state["recent"]),
                   float(state["follow"]))
        self.batches = np.asarray(state["batches"], float).copy()
        self.seconds = np.asarray(state["seconds"], float).copy()
        self.next_row = int(state["next"])
        self._last = np.asarray(state["last_batches"], float).reshape(2, -1).T.tolist()
        self.sigma = np.asarray(state["sigma"], float).copy()
        self.count = np.asarray(state["count"], np.int64).copy()
        self._refresh_plain_copies()
        return self
