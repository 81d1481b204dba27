"""Allocation: pure functions, no MPI."""
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dbs_mpi.planning import allocation
from dbs_mpi.planning.allocation import AllocationError, SpeedModel
from dbs_mpi.planning.dynamic import DBSController
from dbs_mpi.planning.participation import allocate_for


@given(B=st.integers(1, 5000), speeds=st.lists(st.floats(0.01, 100), min_size=1, max_size=16),
       min_local=st.integers(0, 8), max_local=st.integers(0, 2000))
@settings(max_examples=300, deadline=None)
def test_proportional_sums_and_bounds(B, speeds, min_local, max_local):
    n = len(speeds)
    feasible = B >= n * min_local and (max_local == 0 or B <= n * max_local) and (max_local == 0 or max_local >= min_local)
    if not feasible:
        with pytest.raises(AllocationError):
            allocation.proportional(B, speeds, min_local, max_local or None)
        return
    b = allocation.proportional(B, speeds, min_local, max_local or None)
    assert b.dtype == np.int64 and b.sum() == B
    assert b.min() >= min_local
    if max_local:
        assert b.max() <= max_local


def test_proportional_is_proportional():
    assert allocation.proportional(512, [1, 0.25]).tolist() == [410, 102]
    assert allocation.proportional(100, [3, 1]).tolist() == [75, 25]
    assert allocation.proportional(10, [1, 1, 1]).tolist() == [4, 3, 3]  # largest remainders, ties to low rank
    assert allocation.equal(97, 3).tolist() == [33, 32, 32]


def test_minimum_and_maximum_are_respected():
    b = allocation.proportional(97, [1, 0.3, 0.001], min_local=5)
    assert b.sum() == 97 and b[2] == 5
    b = allocation.proportional(100, [10, 1], max_local=60)
    assert b.tolist() == [60, 40]


@pytest.mark.parametrize("args", [
    dict(global_batch=2, weights=[1, 1, 1]),                 # fewer samples than ranks
    dict(global_batch=0, weights=[1]),                        # zero batch
    dict(global_batch=-5, weights=[1]),                       # negative batch
    dict(global_batch=10, weights=[1, 0]),                    # zero speed
    dict(global_batch=10, weights=[1, -1]),                   # negative speed
    dict(global_batch=10, weights=[1, float("nan")]),         # nonsense speed
    dict(global_batch=100, weights=[1, 1], max_local=40),     # cannot fit under the maximum
])
def test_impossible_inputs_are_rejected(args):
    with pytest.raises(AllocationError):
        allocation.proportional(**args)


_any_float = st.floats(allow_nan=True, allow_infinity=True)


@given(B=st.integers(-10, 10**6), speeds=st.lists(_any_float, max_size=8),
       overheads=st.none() | st.lists(_any_float, max_size=8),
       min_local=st.integers(-3, 50), max_local=st.none() | st.integers(0, 10**5))
@example(B=100, speeds=[1e300, 1e-300], overheads=[0.0, 1e300], min_local=1, max_local=None)
@example(B=100, speeds=[], overheads=None, min_local=0, max_local=None)
@settings(max_examples=500, deadline=None)
def test_any_numbers_give_a_valid_vector_or_an_allocation_error(B, speeds, overheads, min_local, max_local):
    """Malformed and extreme inputs (NaN, infinities, 1e-300 next to 1e300, negative
    bounds) end in a valid vector or an AllocationError: never another exception,
    an overflow into garbage, or an endless rounding loop (an extreme speed ratio used to hang)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy overflow warning would mean garbage in the vector
        for call in (lambda: allocation.proportional(B, speeds, min_local, max_local),
                     lambda: allocation.allocate(B, speeds, overheads, min_local, max_local)):
            try:
                b = call()
            except AllocationError as e:
                assert str(e)
                continue
            assert b.dtype == np.int64 and len(b) == len(speeds) and b.sum() == B
            assert b.min() >= min_local and (not max_local or b.max() <= max_local)


def test_affine_model_equalises_step_time():
    # rank 1 is 4x slower in everything, fixed cost 0.7 ms, 0.11 ms per sample (the affine model of docs/method.md, section 1)
    c = np.array([0.11e-3, 0.44e-3])
    a = np.array([0.7e-3, 2.8e-3])
    b = allocation.allocate(128, c, a)
    t = a + c * b
    assert b.sum() == 128
    assert abs(t[0] - t[1]) <= c.max() + 1e-12           # equal within one sample's time
    # the proportional rule gives the slow rank more and is slower at this small batch
    p = allocation.proportional(128, 1 / c)
    assert (a + c * p).max() > t.max()


def test_a_missing_sample_goes_where_it_costs_least():
    """Rank 2's one sample is much of its step (30 ms, beside ranks at 43): at 1.43 samples
    it has the largest remainder, and largest remainders gave it 2 samples, a 60 ms step."""
    c, a = np.array([0.16e-3, 0.16e-3, 30e-3]), np.array([2e-3, 2e-3, 0.0])
    b = allocation.allocate(512, c, a)
    assert b.tolist() == [256, 255, 1] and np.max(a + c * b) < 0.044
    assert allocation.round_preserving_sum([255.3, 255.27, 1.43], 512).tolist() == [255, 255, 2]   # (the old rule)


def _least_longest_step(B, c, a, lo, hi):
    """By brute force: the shortest longest step of any integer vector of 2 or 3 ranks."""
    best = np.inf
    for head in np.ndindex(*[int(min(hi, B)) + 1] * (len(c) - 1)):
        b = np.array([*head, B - sum(head)])
        if b.min() >= lo and b.max() <= hi:
            best = min(best, float(np.max(a + c * b)))
    return best


@given(B=st.integers(1, 40), c=st.lists(st.floats(1e-3, 1.0), min_size=2, max_size=3),
       a=st.lists(st.floats(0.0, 10.0), min_size=3, max_size=3), min_local=st.integers(0, 3),
       max_local=st.integers(0, 30))
@settings(max_examples=200, deadline=None)
def test_no_integer_vector_has_a_shorter_longest_step(B, c, a, min_local, max_local):
    c, a = np.array(c), np.array(a[:len(c)])
    hi = max_local or B
    if B < len(c) * min_local or B > len(c) * hi or hi < min_local:
        return
    b = allocation.allocate(B, c, a, min_local, max_local or None)
    assert b.sum() == B and b.min() >= min_local and b.max() <= hi
    assert np.max(a + c * b) <= _least_longest_step(B, c, a, min_local, hi) * (1 + 1e-9), b


def test_fit_recovers_affine_model_and_survives_noise():
    m = SpeedModel.fit([32, 32], [0.7e-3 + 32 * 0.11e-3, 4 * (0.7e-3 + 32 * 0.11e-3)],
                       [128, 128], [0.7e-3 + 128 * 0.11e-3, 4 * (0.7e-3 + 128 * 0.11e-3)])
    np.testing.assert_allclose(m.per_sample, [0.11e-3, 0.44e-3])
    np.testing.assert_allclose(m.overhead, [0.7e-3, 2.8e-3], atol=1e-12)
    # a noisy benchmark where the small batch was slower than the large one
    m = SpeedModel.fit([32], [0.02], [128], [0.01])
    assert m.per_sample[0] > 0 and m.overhead[0] == 0
    m = SpeedModel.fit([32], [0.001], [128], [0.01], affine=False)
    assert m.overhead[0] == 0 and m.per_sample[0] == pytest.approx(0.01 / 128)


def _controller(speeds, B=512, **kw):
    model = SpeedModel(per_sample=1.0 / np.asarray(speeds, float), overhead=np.zeros(len(speeds)))
    return DBSController(model=model, global_batch=B, **kw)


def _measure(vector, true_speeds, steps=10, noise=None):
    t = steps * np.asarray(vector, float) / np.asarray(true_speeds, float)
    return t if noise is None else t * noise


def test_dbs_ignores_noise():
    ctl = _controller([1000, 500])
    vector = ctl.model.allocate(512)
    rng = np.random.default_rng(0)
    for _ in range(50):
        new, _ = ctl.update(vector, np.tile(vector, (10, 1)), _measure(vector, [1000, 500], noise=rng.uniform(0.97, 1.03, 2)))
        assert new.tolist() == vector.tolist()   # +-3% noise never moves the vector
        vector = new


def test_dbs_follows_a_real_change_within_one_epoch():
    ctl = _controller([1000, 1000])
    vector = ctl.model.allocate(512)
    assert vector.tolist() == [256, 256]
    # rank 1 becomes 3x slower
    new, ratio = ctl.update(vector, np.tile(vector, (10, 1)), _measure(vector, [1000, 1000 / 3]))
    assert ratio[1] == pytest.approx(3.0)
    assert new.tolist() == allocation.proportional(512, [3, 1]).tolist()
    # and comes back when the disturbance ends
    back, _ = ctl.update(new, np.tile(new, (10, 1)), _measure(new, [1000, 1000]))
    assert back.tolist() == [256, 256]


def test_dbs_paper_rule_is_the_special_case():
    # model=proportional, smoothing=1, follow=0, min_gain=0: r_i <- (r_i/t_i) / sum_j(r_j/t_j)
    ctl = _controller([1, 1, 1], B=300, smoothing=1.0, follow=0.0, min_gain=0.0)
    vector = np.array([100, 100, 100])
    t = np.array([1.0, 2.0, 4.0])
    new, _ = ctl.update(vector, np.tile(vector, (1, 1)), t)
    r = (vector / t) / (vector / t).sum()
    assert new.tolist() == allocation.round_preserving_sum(300 * r, 300).tolist()


def test_split_partial_and_rounding():
    assert allocation.split_partial(5, [410, 102]).tolist() == [4, 1]
    assert allocation.split_partial(1, [1, 1, 1]).tolist() == [1, 0, 0]
    assert allocation.split_partial(0, [3, 3]).tolist() == [0, 0]
    x = allocation.round_preserving_sum([0.5, 0.5, 2.0], 3)
    assert x.sum() == 3


def test_dbs_damps_an_oscillation():
    """A model that keeps mis-predicting in alternating directions cannot make the vector
    swing back and forth at full amplitude: every reversal goes half way."""
    ctl = _controller([1000, 1000], B=512)
    vector = np.array([256, 256])
    swings = []
    for epoch in range(8):
        slow = 1 if epoch % 2 == 0 else 0              # the measurement blames a different rank each epoch
        speeds = [1000, 1000]
        speeds[slow] = 250
        new, _ = ctl.update(vector, np.tile(vector, (10, 1)), _measure(vector, speeds))
        swings.append(abs(int(new[0]) - int(vector[0])))
        vector = new
    assert new.sum() == 512
    assert swings[1] >= swings[0] > 100                 # a change and its reversal: followed at once
    assert max(swings[3:]) <= 0.6 * swings[1], swings   # a third swing in a row and later: damped


def test_the_per_epoch_rule_keeps_the_set_it_has_and_balances_within_it():
    """A rank 50x slower with 0.1 s of fixed cost sits out ([64, 64, 0]). When rank 0
    turns 2x (then 10x) slower, the per-epoch rule re-balances between the two that take
    part; every rank back with at least one sample made it keep [64, 64, 0] (predicted
    1.5x the balanced step) or, at 10x, take the slow rank back for a step of 0.150 s
    against 0.117 s. Its damped swings keep the rank out too."""
    fit = SpeedModel(np.array([1e-3, 1e-3, 50e-3]), np.array([0.0, 0.0, 0.100]))
    vector = allocate_for(fit, 128)
    assert vector.tolist() == [64, 64, 0]
    for slow, expected in ((2, [43, 85, 0]), (10, [11, 117, 0])):
        ctl = DBSController(model=fit, global_batch=128)
        new, _ = ctl.update(vector, np.tile(vector, (100, 1)), np.array([slow * 64e-3 * 100, 64e-3 * 100, 0.0]))
        assert new.tolist() == expected
    ctl = DBSController(model=fit, global_batch=128)
    current = vector
    for epoch in range(8):                                 # the slow-down blamed on rank 0 and 1 in turn
        per_sample = np.array([4e-3, 1e-3, 0.0]) if epoch % 2 == 0 else np.array([1e-3, 4e-3, 0.0])
        new, _ = ctl.update(current, np.tile(current, (10, 1)), 10 * per_sample * current)
        assert new[2] == 0 and new.sum() == 128 and new.min(initial=1, where=new > 0) >= 1, (epoch, new)
        current = new


def test_benchmark_fit_cannot_starve_a_rank():
    # the small-batch timing was disturbed (nearly as slow as the large one)
    m = SpeedModel.fit([64, 64], [0.010, 0.039], [256, 256], [0.040, 0.040])
    b = m.allocate(512)
    assert b.min() > 100, b.tolist()
