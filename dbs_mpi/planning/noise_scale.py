"""The gradient noise scale, estimated from the uneven local batches themselves.

Let G be the gradient of the loss over the whole data and Sigma the covariance of one
sample's gradient. The mean gradient g_b of b samples drawn at random then has

    E |g_b|^2 = |G|^2 + tr(Sigma) / b

Every step measures this at several b at once: each rank i that took part knows
|g_i|^2 at its local batch b_i before the exchange, and every rank knows |g|^2 of the
step's gradient g = sum_i b_i g_i / B at the global batch B. A line through the points
(1/b, |g_b|^2) has |G|^2 as its intercept and tr(Sigma) as its slope. Uneven local
batches spread the points along the line; equal ones (ssgd) leave two abscissae, 1/b
and 1/B, and the line is the two-batch estimate of McCandlish et al. (2018). Ranks
that sat out (b_i = 0) are left out; a step with one rank taking part (b_i = B) has one
abscissa and gives no estimate.

The line is fitted by least squares weighted by b^2: where the noise dominates, the
spread of |g_b|^2 is about sqrt(2 tr(Sigma^2)) / b. Each step's pair is still noisy
(one |g_b|^2 has a relative spread of order 1), so both are smoothed over steps by an
exponential moving average (bias-corrected, as Adam's), and the noise scale is the
ratio of the two averages:

    B_noise = tr(Sigma) / |G|^2

It is the batch at which a step's noise equals its signal: below it, doubling the batch
nearly halves the steps needed; above it, it saves few. Relative to a batch B0,

    efficiency(B) = (B_noise + B0) / (B_noise + B)      progress per sample at B
    gain(B)       = (B / B0) efficiency(B)              progress of a step at B, in steps at B0

(gain is AdaScale's r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2) with S = B / B0,
sigma^2 = tr(Sigma) / B0, mu^2 = |G|^2.) goodput.py chooses the global batch from
them. Pure code: the training layer feeds it the norms the step's collective carried.
"""
from __future__ import annotations

import math

import numpy as np


SMOOTHING = 0.95      # the EMA's decay per step (about 20 steps' memory)
MIN_STEPS = 10        # steps with an estimate before the noise scale is given


def fit_step(batches, local_sq_norms, global_sq_norm: float, global_batch: float) -> tuple[float, float] | None:
    """One step's (|G|^2, tr(Sigma)) from every rank's local batch and squared gradient
    norm (0 batch: sat out, ignored) and the summed gradient's squared norm at the global
    batch; None where the points have one abscissa."""
    if not global_batch > 0:
        return None
    b = np.asarray(batches, float)
    s = np.asarray(local_sq_norms, float)
    taking_part = (b > 0) & np.isfinite(s)
    x = np.concatenate([1.0 / b[taking_part], [1.0 / global_batch]])
    y = np.concatenate([s[taking_part], [float(global_sq_norm)]])
    w = np.concatenate([b[taking_part], [float(global_batch)]]) ** 2
    if not np.isfinite(y).all() or np.ptp(x) <= 1e-12 * x.max():
        return None
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    slope = float(np.sum(w * (x - xm) * (y - ym)) / np.sum(w * (x - xm) ** 2))
    return ym - slope * xm, slope


class NoiseScale:
    """The smoothed |G|^2 and tr(Sigma) of the steps observed, and the noise scale."""

    def __init__(self, smoothing: float = SMOOTHING, min_steps: int = MIN_STEPS):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"noise scale: smoothing must be in [0, 1); got {smoothing}")
        self.smoothing, self.min_steps = float(smoothing), int(min_steps)
        self.grad_sq = self.trace = 0.0     # the EMAs, not yet bias-corrected
        self.steps = 0                      # steps that gave an estimate
        self.last: float | None = None      # the last noise scale the EMAs gave (value() holds it)

    def observe(self, batches, local_sq_norms, global_sq_norm: float, global_batch: float):
        """One step's norms (see fit_step); returns its (|G|^2, tr(Sigma)), or None."""
        pair = fit_step(batches, local_sq_norms, global_sq_norm, global_batch)
        if pair is None:
            return None
        beta = self.smoothing
        self.grad_sq = beta * self.grad_sq + (1.0 - beta) * pair[0]
        self.trace = beta * self.trace + (1.0 - beta) * pair[1]
        self.steps += 1
        grad_sq, trace = self.smoothed()
        if self.steps >= self.min_steps and grad_sq > 0.0 and trace > 0.0:
            self.last = trace / grad_sq
        return pair

    def smoothed(self) -> tuple[float, float]:
        """The bias-corrected (|G|^2, tr(Sigma)) (0, 0 before any estimate)."""
        if not self.steps:
            return 0.0, 0.0
        correction = 1.0 - self.smoothing ** self.steps
        return self.grad_sq / correction, self.trace / correction

    def value(self) -> float | None:
        """B_noise, in samples: the smoothed tr(Sigma) / |G|^2 once MIN_STEPS steps gave an
        estimate; where one of them is not positive since (the noise swamps the signal for a
        while), the last value they gave (an adaptive batch's lr keeps its scale); None
        before any."""
        return self.last

    def state_dict(self) -> dict:
        return {"smoothing": self.smoothing, "min_steps": self.min_steps, "grad_sq": self.grad_sq,
                "trace": self.trace, "steps": self.steps, "last": self.last}

    @classmethod
    def from_state(cls, state: dict) -> "NoiseScale":
        estimator = cls(float(state["smoothing"]), int(state["min_steps"]))
        estimator.grad_sq, estimator.trace = float(state["grad_sq"]), float(state["trace"])
        estimator.steps = int(state["steps"])
        last = state.get("last")
        if "last" not in state:                    # (saved before it was kept: what value() gave then)
            grad_sq, trace = estimator.smoothed()
            ok = estimator.steps >= estimator.min_steps and grad_sq > 0 and trace > 0
            last = trace / grad_sq if ok else None
        estimator.last = None if last is None else float(last)
        return estimator


def efficiency(global_batch: float, noise: float, start: float) -> float:
    """Progress per sample at `global_batch` relative to the batch `start` (1 at start)."""
    if math.isinf(noise):
        return 1.0
    return (noise + start) / (noise + global_batch)


def gain(global_batch: float, noise: float, start: float) -> float:
    """Progress of one step at `global_batch`, in steps at `start` (AdaScale's gain)."""
    return global_batch / start * efficiency(global_batch, noise, start)
