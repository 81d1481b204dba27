"""Participation (planning/participation.py and the planner's probes): pure code, no MPI.

The best set and its vector on known models and against every subset, and the
within-epoch planner in a closed loop (tests/test_dynamic.py's) leaving a rank out while
its least share would slow every step, probing it, and taking it back once it pays."""
import itertools

import numpy as np
import pytest

from dbs_mpi.planning import allocation, dynamic, participation
from dbs_mpi.planning.allocation import AllocationError
from test_dynamic import Machine, closed_loop, first_step, model_of


def test_a_rank_whose_least_share_outlasts_the_others_whole_step_sits_out():
    """1:0.02 (LeNet-5-like: 1 ms + 20 us a sample against 50 ms + 1 ms): every rank
    taking part holds the step at the slow rank's 51 ms; without it the step is 11 ms."""
    c, a = np.array([2e-5, 1e-3]), np.array([1e-3, 5e-2])
    vector = participation.allocate_participating(512, c, a)
    assert vector.tolist() == [512, 0]
    assert allocation.step_time(vector, c, a).max() == pytest.approx(1e-3 + 512 * 2e-5)
    assert allocation.allocate(512, c, a).tolist() == [511, 1]
    # a larger global batch makes the slow rank's share pay again: it takes part
    assert participation.allocate_participating(100_000, c, a).min() > 0


def test_equal_ranks_and_a_memory_bound_keep_everyone():
    c, a = np.full(4, 1e-4), np.full(4, 1e-3)
    assert participation.allocate_participating(256, c, a).tolist() == [64, 64, 64, 64]
    c, a = np.array([1e-5, 1e-3]), np.array([1e-4, 5e-2])
    assert participation.allocate_participating(100, c, a).tolist() == [100, 0]
    vector = participation.allocate_participating(100, c, a, max_local=60)    # the fast rank cannot hold 100
    assert vector.tolist() == [60, 40]


@pytest.mark.parametrize("seed", range(40))
def test_the_chosen_set_is_as_fast_as_the_best_subset(seed):
    """Random models of 2 to 5 ranks: the vector is never slower than every rank taking
    part, and within 2% (rounding) of the best over every subset of ranks, or of every
    rank where no subset is LEAVE_GAIN faster."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    c = 1e-4 / rng.choice([1, 0.5, 0.2, 0.05, 0.02], n)
    a = rng.uniform(0.2e-3, 5e-3, n) * rng.choice([1, 1, 10, 50], n)
    B = int(rng.choice([64, 256, 512]))
    vector = participation.allocate_participating(B, c, a)
    assert vector.sum() == B and ((vector == 0) | (vector >= 1)).all()
    got = allocation.step_time(vector, c, a).max()
    assert got <= allocation.step_time(allocation.allocate(B, c, a), c, a).max() + 1e-12
    best = min(allocation.step_time(allocation.allocate(B, c[list(s)], a[list(s)]), c[list(s)], a[list(s)]).max()
               for k in range(1, n + 1) for s in itertools.combinations(range(n), k))
    everyone = allocation.step_time(allocation.allocate(B, c, a), c, a).max()
    assert got <= 1.02 * best or (vector.min() > 0 and best >= (1 - participation.LEAVE_GAIN) * everyone), \
        (vector.tolist(), got, best)


def test_a_bad_participation_is_one_line():
    with pytest.raises(AllocationError, match="participation: must be one of auto, all"):
        participation.check_participation("some")


def test_the_planner_leaves_a_rank_out_while_it_costs_more_than_it_brings_and_takes_it_back():
    """Two equal ranks; rank 1's steps get a 60 ms fixed cost (the others' whole step is
    about 27 ms) for steps 100 to 600: it sits out within a few steps of the change
    (it is not pinned at 1 sample, 2.3x the step), its probes cost the stretch at most 2%,
    and once the cost ends it is back within the probes' bound."""
    machine = Machine([1e-4, 1e-4], [2e-3, 2e-3], noise=0.03, seed=4)
    machine.slow(rank=1, start=100, stop=600, extra=0.06)
    vectors = closed_loop(machine, 1200)
    out = first_step(vectors, 100, lambda v: v[1] == 0)
    assert out is not None and out <= 12, out             # (two moves: the first scales c and a alike)
    stretch = range(150, 600)
    taken = [machine.times(s, vectors[s]).max() for s in stretch]
    alone = [machine.times(s, [512, 0])[0] for s in stretch]
    assert np.mean(taken) <= 1.02 * np.mean(alone)
    back = first_step(vectors, 600, lambda v: v[1] > 0.8 * 256)
    bound = dynamic.PROBE_MAX + dynamic.REFIT_STEADY + dynamic.PROBE_STEPS + dynamic.RECENT
    assert back is not None and back <= bound, (back, bound)


def test_with_participation_all_the_rank_keeps_one_sample():
    machine = Machine([1e-4, 1e-4], [2e-3, 2e-3], noise=0.03, seed=4)
    machine.slow(rank=1, start=100, stop=600, extra=0.06)
    vectors = closed_loop(machine, 400, participation="all")
    assert vectors[150:400, 1].min() >= 1


def test_a_costly_probe_waits_for_its_budget():
    """A rank at 1:0.02 that sits out for good: each probe step costs 3.6x the step, so
    the probes' predicted share of the steps stays within PROBE_BUDGET."""
    truth = model_of([2e-5, 1e-3], [1e-3, 5e-2])
    machine = Machine(truth.per_sample, truth.overhead, noise=0.02, seed=1)
    vectors = closed_loop(machine, 3000)
    probing = vectors[:, 1] > 0
    assert 0 < probing[200:].sum() <= 2 * dynamic.PROBE_BUDGET * 2800 / 3.6 + dynamic.PROBE_STEPS, probing.sum()
    steps = [truth.predict(v).max() for v in vectors[200:]]
    best = truth.predict([512, 0]).max()
    assert np.mean(steps) <= (1 + 1.5 * dynamic.PROBE_BUDGET) * best
