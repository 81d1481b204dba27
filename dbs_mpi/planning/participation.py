"""Participation: which ranks take part in a step, chosen with their local batches.

A rank's step costs its fixed cost a_i before its first sample. Where a_i (plus c_i for
its least local batch) exceeds the time the other ranks need for the whole global batch,
any share it takes makes every step slower: with the plain allocation (every local batch
at least min_local) a rank 50 times slower than the other holds the step at its own
a_i + c_i, twice the fast rank's whole step. Such a rank sits out: local batch 0, no
forward or backward, and its steps cost the others nothing but its part of the exchange.

The model. A step's time with the set S taking part and the vector b is

    T(S, b) = max over i in S of (a_i + c_i b_i)  +  e

where the planner takes e, the gradient exchange, as independent of S. It is not quite:
a rank that sits out leaves the step's gradient sum (training/participants.py), which
runs over S and rank 0 on a sub-communicator; every rank still sums the step's loss and
telemetry over the world, so stop requests and failed ranks reach everyone. A rank out
of the sum skips the update and falls behind: it takes rank 0's model and optimizer
state (one broadcast) before the first step it takes part in again, and after the
epoch's last step. (Where the exchange is not host MPI, or with SyncBatchNorm or a
GradScaler, it stays in the sum with weight 0 instead.) Leaving is decided on compute
alone: neither the smaller sum's saving nor a catch-up's broadcast is counted. So the
best set is the best vector with b_i in {0} or [min_local, max_local]:

    fill_i(t) = 0                                  if t < m_i = a_i + c_i min_local
              = clip((t - a_i) / c_i, min_local, max_local)   otherwise

is non-decreasing in t, so the least t* with sum_i fill_i(t*) >= B is found by
bisection, S = {i : m_i <= t*}, and the vector is allocation.allocate over S (rounded
so that it sums to B). Where rounding makes that no faster than every rank taking part,
every rank takes part. No MPI here: the planners (the start-up allocation, dynamic/)
call it with their models.
"""
from __future__ import annotations

import numpy as np

from ..options import PARTICIPATION
from .allocation import (AllocationError, SpeedModel, _bounds, allocate, check_feasible, equal, least_time,
                         step_time)


NEAR = 3              # sets tried on either side of the continuous optimum's


LEAVE_GAIN = 0.05     # a set without some ranks must be predicted this much faster than every rank


def members(vector) -> tuple:
    """The ranks that take part in `vector` (a hashable key of the set)."""
    return tuple(int(r) for r in np.flatnonzero(np.asarray(vector) > 0))


def check_participation(value: str) -> str:
    if value not in PARTICIPATION:
        raise AllocationError(f"participation: must be one of {', '.join(PARTICIPATION)}; got {value!r}")
    return value


def _threshold(global_batch: int, c: np.ndarray, a: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """The least common step time t* at which the ranks that can start a share by then
    (m_i <= t) hold the global batch between them (bisection on a non-decreasing sum)."""
    entry = a + c * lo

    def fill(t):
        return np.where(entry <= t, np.clip((t - a) / c, lo, hi), 0.0)

    return least_time(fill, global_batch, 0.0, float(np.max(a + c * np.minimum(hi, global_batch))))


def _entry_order(global_batch: int, c: np.ndarray, a: np.ndarray, min_local: int, max_local):
    """The ranks in the order of their least share's step time m_i (cheapest first), and
    how many of them the continuous optimum lets take part."""
    lo, hi = _bounds(len(c), min_local, max_local)
    unit = float(c.min())
    with np.errstate(over="ignore"):
        c, a = np.minimum(c / unit, 1e15), np.minimum(a / unit, 1e15)
    t = _threshold(global_batch, c, a, lo, hi)
    entry = a + c * lo
    return np.argsort(entry, kind="stable"), int(np.count_nonzero(entry <= t * (1 + 1e-12)))


def _allocate_set(global_batch: int, c, a, min_local: int, max_local, part: np.ndarray) -> np.ndarray | None:
    """The vector with only the ranks in `part` taking part (None: the bounds forbid it)."""
    hi = max_local if max_local is None or np.ndim(max_local) == 0 else np.asarray(max_local)[part]
    try:
        check_feasible(global_batch, int(part.sum()), min_local, hi)
    except AllocationError:
        return None
    vector = np.zeros(len(c), dtype=np.int64)
    vector[part] = allocate(global_batch, c[part], a[part], min_local, hi)
    return vector


def allocate_participating(global_batch: int, per_sample, overhead=None, min_local: int = 1,
                           max_local=None) -> np.ndarray:
    """Local batches that minimise the predicted step time when a rank may also take no
    samples (0); every rank that takes part gets at least min_local. Returns an int64
    vector summing to global_batch. The set is the continuous optimum's, or one of the
    NEAR sets beside it in the order of m_i (the least shares are whole samples, which
    the continuous optimum rounds), or every rank: whichever is predicted fastest; then,
    while it pays (at most 2 NEAR times), the rank that ends the step last leaves it (a
    rank whose few samples cost much each: its share rounds up to a slow step). A set
    without some ranks is taken only where it is predicted LEAVE_GAIN faster than every
    rank: near a tie, noise in the estimates would make ranks leave and return."""
    c = np.asarray(per_sample, float)
    a = np.zeros(len(c)) if overhead is None else np.asarray(overhead, float)
    everyone = best = allocate(global_batch, c, a, min_local, max_local)
    order, count = _entry_order(global_batch, c, a, min_local, max_local)
    fastest = step_time(best, c, a).max()
    every_time = fastest
    for k in range(max(1, count - NEAR), min(len(c) - 1, count + NEAR) + 1):
        part = np.zeros(len(c), bool)
        part[order[:k]] = True
        vector = _allocate_set(global_batch, c, a, min_local, max_local, part)
        if vector is not None and step_time(vector, c, a).max() < fastest:
            best, fastest = vector, step_time(vector, c, a).max()
    for _ in range(2 * NEAR):
        part = best > 0
        part[np.argmax(step_time(best, c, a))] = False
        vector = _allocate_set(global_batch, c, a, min_local, max_local, part) if part.any() else None
        if vector is None or step_time(vector, c, a).max() >= fastest:
            break
        best, fastest = vector, step_time(vector, c, a).max()
    return best if fastest < (1.0 - LEAVE_GAIN) * every_time else everyone


def allocate_for(model: SpeedModel, global_batch: int, min_local: int = 1, max_local=None,
                 participation: str = "auto", within=None) -> np.ndarray | None:
    """The vector of `model`: the best set and its local batches ("auto"), or every rank
    taking part ("all", allocation.allocate); within (bool per rank): only those ranks
    take part (None where the bounds forbid it)."""
    if within is not None:
        return _allocate_set(global_batch, np.asarray(model.per_sample, float), np.asarray(model.overhead, float),
                             min_local, max_local, np.asarray(within, bool))
    if participation == "auto":
        return allocate_participating(global_batch, model.per_sample, model.overhead, min_local, max_local)
    return model.allocate(global_batch, min_local, max_local)


def vector_at(policy: str, model: SpeedModel | None, global_batch: int, n: int, min_local: int = 1, max_local=None,
              participation: str = "auto") -> np.ndarray:
    """The vector a policy runs at `global_batch` on n ranks: equal shares for ssgd or
    without a model, else allocate_for (where the bounds allow none: equal). Raises
    AllocationError where no vector fits the bounds (the engine's Balancer and the
    simulator alike, where the global batch changes)."""
    check_feasible(global_batch, n, min_local, max_local)
    vector = None if policy == "ssgd" or model is None else \
        allocate_for(model, global_batch, min_local, max_local, participation)
    return equal(global_batch, n, min_local, max_local) if vector is None else vector


def least_step_time_sitting_out(per_sample, overhead, global_batch: int) -> float:
    """A lower bound of the step time of any vector in which ranks may sit out (take no
    samples, and pay no a_i): the continuous optimum with no bounds but b_i >= 0."""
    c, a = np.asarray(per_sample, float), np.asarray(overhead, float)
    n = len(c)
    return _threshold(global_batch, c, a, np.zeros(n), np.full(n, np.inf))
