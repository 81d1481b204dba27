"""The global batch of every simulated epoch where it changes (`global_batch = auto`,
training/global_batch.py): a replay follows the B its run recorded for every epoch
(epoch/global_batch); a projection decides as the engine does after every epoch, with
the engine's AdaptiveBatch, from the planner's model and the epoch's simulated fixed
seconds (the exchange and the update), at a noise scale the user gives (a simulation has
no gradients to measure it: take it from a run's step/noise_scale). A new B gets the
engine's vector for it (participation.vector_at) and the planners are resized.
"""
from __future__ import annotations

import math

import numpy as np

from ...options import UserError
from ...planning import allocation, goodput, participation
from .job import Job


def vector_at(job: Job, global_batch: int, model: allocation.SpeedModel, n: int) -> np.ndarray:
    """The vector the engine runs at `global_batch` (participation.vector_at)."""
    return participation.vector_at(job.strategy, model, global_batch, n, job.min_local_batch,
                                   job.max_local_batch or None, job.participation)


def run_at(job: Job, global_batch: int, model, n: int, replanner, vector) -> np.ndarray:
    """The vector a new `global_batch` runs (as Balancer._run_at): vector_at's, not in a set
    the set check banned (Replanner.allowed, within the set of `vector`, the one running)."""
    new = vector_at(job, global_batch, model, n)
    return new if replanner is None else replanner.allowed(new, vector)


def next_batch(job: Job, epoch: int, current: int, model: allocation.SpeedModel, fixed: float, n: int,
               replanner=None, vector=None) -> int:
    """The B of epoch `epoch` (from 1 on) after an epoch at `current` (its `vector`): the
    recorded one, the engine's choice at the job's noise scale, or `current`."""
    if job.global_batches:
        return int(job.global_batches[min(epoch, len(job.global_batches) - 1)])
    if not job.adaptive:
        return current
    a = job.adaptive
    rule = goodput.AdaptiveBatch(a["start"], a["upper"], a.get("rule", "adascale"), a.get("lower", 0))
    upper = min(job.samples, n * job.max_local_batch) if job.max_local_batch else job.samples

    def step_time(b: int) -> float:
        try:
            return goodput.predicted_step(model, b, lambda x: run_at(job, x, model, n, replanner, vector), fixed)
        except UserError:
            return math.inf

    return rule.decide(current, a["noise"], step_time, upper)[0]


def resized(job: Job, global_batch: int, model, n: int, replanner, controller, exchange, current) -> np.ndarray:
    """The planners at a new B (as Balancer.set_global_batch); returns its vector (run_at,
    from `current`, the vector before)."""
    if controller is not None:
        controller.global_batch = global_batch
    exchange.global_batch = global_batch
    vector = run_at(job, global_batch, model, n, replanner, current)
    if replanner is not None:
        replanner.resize(global_batch)
    return vector
