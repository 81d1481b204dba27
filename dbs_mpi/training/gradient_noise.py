"""The gradient noise scale, measured as training runs (Balancer(noise_scale=True),
`dbs-mpi train --noise-scale`); planning/noise_scale.py fits it.

What rides the step's collective, R + 1 floats of the balancer's telemetry (no other
collective): slot i, rank i's squared norm of its own gradient in this step (its mean
over its local batch, before the weighting; the exchange writes it as the buckets start:
exchange.BucketSchedule.measure_into), and slot R, rank 0's squared norm of the summed
gradient of the step before. That one is known only once the sum is done, and rank 0
always takes part in it, so it travels one step late; every rank pairs it with the
local norms it kept from that step, and the estimator sees the same numbers on every
rank. With aggregation "mean" the summed gradient is (1/n') sum_i g_i, whose noise is
that of a batch of n'^2 / sum_i (1/b_i) samples: the fit uses that batch for it.
"""
from __future__ import annotations

import math

import numpy as np

from ..planning.noise_scale import NoiseScale


def effective_batch(row, aggregation: str) -> float:
    """The batch whose mean gradient has the summed gradient's noise."""
    b = np.asarray(row, float)
    b = b[b > 0]
    if aggregation == "mean":
        return len(b) ** 2 / float(np.sum(1.0 / b)) if len(b) else 0.0
    return float(b.sum())


class GradientNoise:
    """This rank's side of the measurement: its slots, the step kept for the late global
    norm, the estimator, and what each step recorded (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, aggregation: str = "weighted"):
        self.rank, self.world_size, self.aggregation = rank, world_size, aggregation
        self.estimator = NoiseScale()
        self.kept = None            # (row, local squared norms) of the last step, waiting for its global norm
        self.summed = 0.0           # rank 0: the squared norm of the last step's summed gradient

    @property
    def size(self) -> int:
        return self.world_size + 1

    def outgoing(self) -> np.ndarray:
        """This rank's slots before the exchange writes its own norm (slot `rank`)."""
        slots = np.zeros(self.size)
        slots[-1] = self.summed if self.rank == 0 else 0.0
        return slots

    def sum_done(self, squared: float) -> None:
        """Rank 0: the squared norm of the step's summed gradient (it rides the next step)."""
        self.summed = float(squared)

    def incoming(self, sums, row) -> tuple[float, float, float]:
        """The summed slots of a step with local batches `row`: the step before it is fitted
        now. Returns (B_noise or NaN, |G|^2, tr(Sigma)) of that fit (NaN: none), for the records."""
        sums = np.asarray(sums, float)
        fitted = None
        if self.kept is not None:
            before, local = self.kept
            fitted = self.estimator.observe(before, local, sums[-1], effective_batch(before, self.aggregation))
        self.kept = (np.asarray(row, np.int64).copy(), sums[:-1].copy())
        noise = self.estimator.value()
        grad_sq, trace = fitted if fitted is not None else (math.nan, math.nan)
        return (math.nan if noise is None else noise), grad_sq, trace

    def state_dict(self) -> dict:
        kept = None if self.kept is None else [self.kept[0].tolist(), self.kept[1].tolist()]
        return {"estimator": self.estimator.state_dict(), "kept": kept, "summed": self.summed}

    def load_state_dict(self, state: dict) -> None:
        """A state saved by any rank of a run on any number of ranks: the step kept is dropped
        where the number of ranks changed (its global norm rode a launch that is gone)."""
        self.estimator = NoiseScale.from_state(state["estimator"])
        kept = state.get("kept")
        self.kept = None if kept is None or len(kept[0]) != self.world_size else \
            (np.asarray(kept[0], np.int64), np.asarray(kept[1], float))
        self.summed = float(state.get("summed", 0.0)) if self.rank == 0 else 0.0
