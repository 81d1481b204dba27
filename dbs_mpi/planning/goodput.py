"""Goodput: the global batch that trains fastest per second, not per sample.

A step at global batch B takes T(B) seconds on the ranks there are (the planner's
prediction: its best vector for B, participation included) and makes gain(B) steps' worth
of progress at the starting batch B0 (noise_scale.py). Progress per second, the goodput,

    goodput(B) = gain(B) / T(B) = (B / T(B)) efficiency(B) / B0

is throughput times statistical efficiency, as Pollux (OSDI'21) puts it. Throughput
grows with B while each step's fixed costs (the exchange, a rank's a_i) are spread over
more samples; efficiency falls once B passes the noise scale. The choice is the best of
CANDIDATES batches spaced evenly in log B between the bounds, kept only where it is
predicted at least MIN_GAIN faster than the current batch (a change costs a re-plan, and
a prediction has errors); an adaptive run (AdaptiveBatch) moves B at most MAX_GROWTH
times up or down per decision, since the learning rate follows it. Pure code: the
training layer calls it with its planner's prediction, on every rank alike.

The learning rate follows the batch by one of three rules (LR_SCALING): `adascale`
multiplies it by gain(B), `sqrt` by sqrt(B / B0), `linear` by B / B0.
"""
from __future__ import annotations

import math

import numpy as np

from ..options import DEFAULT_START, DEFAULT_UPPER, LR_SCALING, UserError
from .noise_scale import efficiency, gain


CANDIDATES = 48       # batches tried between the bounds (log-spaced)
MIN_GAIN = 0.05       # a new batch must be predicted this much more goodput
MAX_GROWTH = 2.0      # ... and at most this many times the current one (the lr moves with it: a run at lr 0.05,
                      # momentum 0.9 that jumped from B = 128 to 2,444 in one decision, lr x 13, diverged)
BELOW = 2.0           # by default B may go down to the start over this (the user's batch halved once)




def candidates(lower: int, upper: int, count: int = CANDIDATES) -> np.ndarray:
    """Distinct integer batches from lower to upper, log-spaced (both ends included)."""
    if not 1 <= lower <= upper:
        raise ValueError(f"goodput: the bounds must satisfy 1 <= lower <= upper; got {lower}, {upper}")
    return np.unique(np.round(np.geomspace(lower, upper, count)).astype(np.int64))


def goodput(global_batch: int, seconds: float, noise: float, start: int) -> float:
    """Progress per second, in steps at the starting batch (0 where the step cannot run)."""
    if not math.isfinite(seconds) or seconds <= 0:
        return 0.0
    return gain(global_batch, noise, start) / seconds


def choose(step_time, noise: float | None, current: int, start: int, lower: int, upper: int,
           min_gain: float = MIN_GAIN) -> int | None:
    """The batch in [lower, upper] with the most goodput, where it beats the current one's
    by min_gain; None if none does or there is no noise scale yet. step_time(B): the
    predicted seconds of a step at B (inf where B cannot run)."""
    if noise is None:
        return None
    tried = candidates(lower, upper)
    values = np.array([goodput(int(b), step_time(int(b)), noise, start) for b in tried])
    best = int(np.argmax(values))
    now = goodput(current, step_time(current), noise, start)
    if values[best] <= 0 or int(tried[best]) == current or values[best] < (1.0 + min_gain) * now:
        return None
    return int(tried[best])


def lr_factor(rule: str, global_batch: int, start: int, noise: float | None) -> float:
    """The factor on the learning rate at `global_batch` (1 at the starting batch).
    adascale without a noise scale yet: 1, as where the batch has not changed."""
    if rule == "linear":
        return global_batch / start
    if rule == "sqrt":
        return math.sqrt(global_batch / start)
    if rule == "adascale":
        return 1.0 if noise is None else gain(global_batch, noise, start)
    raise ValueError(f"lr scaling: must be one of {', '.join(LR_SCALING)}; got {rule!r}")


def predicted_step(model, global_batch: int, vector_at, fixed: float) -> float:
    """Seconds of a step at `global_batch`: the slowest taking-part rank's compute under
    `model` (allocation.SpeedModel) for the vector `vector_at(B)` gives (None: B cannot
    run, inf), plus the step's `fixed` seconds that do not grow with B (fixed_seconds)."""
    vector = vector_at(int(global_batch))
    if vector is None:
        return math.inf
    return float(np.max(model.predict(vector))) + float(fixed)


def fixed_seconds(data, compute, comm, wait, pre) -> float:
    """The seconds of a step beyond its slowest rank's compute before the collective (the
    exchange, the update, the batch's loading): each (ranks x steps) array of an epoch's
    phases; the median over its steps of every rank's step less the slowest pre-collective
    compute (0 where nothing was measured)."""
    total = np.mean(np.asarray(data) + np.asarray(compute) + np.asarray(comm) + np.asarray(wait), axis=0)
    rest = total - np.max(np.asarray(pre), axis=0)
    rest = rest[np.isfinite(rest)]
    return max(float(np.median(rest)), 0.0) if len(rest) else 0.0


def per_step(global_batch: int, noise, start: int, seconds: float) -> np.ndarray:
    """An epoch's steps at `global_batch`: the gain at each step's noise scale (NaN where
    none is known) and the predicted goodput, that gain over the predicted step `seconds`.
    (S, 2)."""
    noise = np.asarray(noise, float)
    gains = np.array([gain(global_batch, n, start) if math.isfinite(n) and n > 0 else math.nan for n in noise])
    per_second = gains / seconds if math.isfinite(seconds) and seconds > 0 else np.full(len(noise), math.nan)
    return np.stack([gains, per_second], axis=1) if len(noise) else np.zeros((0, 2))


class AdaptiveBatch:
    """The settings of an adaptive global batch and its last decision (no MPI). lower:
    the smallest B it may choose (0: the start over BELOW, one halving). Below the start
    the lr stays the start's (`factor`)."""

    def __init__(self, start: int, upper: int, lr_scaling: str = "adascale", lower: int = 0):
        if lr_scaling not in LR_SCALING:
            raise UserError(f"lr_scaling: must be one of {', '.join(LR_SCALING)}; got {lr_scaling!r}")
        if not 1 <= int(start) <= int(upper):
            raise UserError(f"max_global_batch: must be at least global_batch_start ({start}); got {upper}")
        if not 0 <= int(lower) <= int(start):
            raise UserError(f"min_global_batch: must be from 0 (half the start) to global_batch_start ({start}); "
                            f"got {lower}")
        self.start, self.upper, self.rule = int(start), int(upper), lr_scaling
        self.lower_given = int(lower) > 0        # (a checkpoint from before the default bound keeps its own)
        self.lower = int(lower) or max(1, math.ceil(self.start / BELOW))

    @classmethod
    def of(cls, global_batch, start: int, upper: int, lr_scaling: str, lower: int = 0) -> "AdaptiveBatch | None":
        """Balancer's arguments: the adaptive batch of global_batch="auto" (None: B is fixed)."""
        if global_batch == "auto":
            start = start or DEFAULT_START
            return cls(start, upper or max(DEFAULT_UPPER, start), lr_scaling, lower)
        if start or upper or lower:
            raise UserError("global_batch_start / min_global_batch / max_global_batch: bounds of "
                            "global_batch=\"auto\" only")
        return None

    def factor(self, global_batch: int, noise: float | None) -> float:
        """The learning rate's factor at `global_batch`: the rule's above the start, 1 at
        and below it. Below the start the rules would scale the lr down (AdaScale's gain
        is below 1 there) to keep a step's progress per sample the start's, and a smaller
        B would then gain nothing; at the user's lr it trains as a smaller fixed B does,
        faster per sample where the run can take a larger lr per sample than the start's
        (docs/method.md, section 5.5)."""
        if global_batch <= self.start:
            return 1.0
        return lr_factor(self.rule, global_batch, self.start, noise)

    def decide(self, current: int, noise: float | None, step_time, upper: int) -> tuple[int, dict]:
        """The next epoch's B (the current one where none pays) and the epoch's records:
        within the bounds and within MAX_GROWTH times of the current B either way (a B
        set by hand outside the bounds moves at most MAX_GROWTH times toward them)."""
        lower = max(self.lower, math.ceil(current / MAX_GROWTH))
        upper = max(min(self.upper, upper, int(MAX_GROWTH * current)), lower)
        choice = choose(step_time, noise, current, self.start, lower, upper) or current
        now = step_time(current)
        g = math.nan if noise is None else gain(current, noise, self.start)
        return choice, {"global_batch": np.int64(current), "gain": g, "lr_factor": self.factor(current, noise),
                        "goodput": goodput(current, now, noise, self.start) if noise else math.nan,
                        "predicted_step": now}

    def state_dict(self) -> dict:
        """The settings a checkpoint must match (lower only where it is below the start,
        so that checkpoints from before the lower bound still match)."""
        bounds = {"lower": self.lower} if self.lower != self.start else {}
        return {"start": self.start, "upper": self.upper, "rule": self.rule, **bounds}
