"""The noise-scale estimator (planning/noise_scale.py) on synthetic gradients whose noise
is known: every sample's gradient is G + z, z ~ N(0, diag(var)), so B_noise =
sum(var) / |G|^2 exactly, and a rank's mean gradient over b samples is G + N(0, var / b)."""
import numpy as np
import pytest

from dbs_mpi.planning import goodput
from dbs_mpi.planning.noise_scale import NoiseScale, efficiency, fit_step, gain

DIM = 200


def problem(noise_scale: float, rng):
    """G and the per-sample variances of a problem with the given noise scale."""
    grad = rng.normal(size=DIM)
    var = rng.uniform(0.5, 1.5, size=DIM)
    var *= noise_scale * float(grad @ grad) / var.sum()
    return grad, var


def step_norms(grad, var, batches, rng):
    """Every rank's squared local norm, and the squared norm of the weighted sum."""
    batches = np.asarray(batches)
    local = [grad + rng.normal(size=DIM) * np.sqrt(var / b) if b else np.full(DIM, np.nan) for b in batches]
    total = sum(b * g for b, g in zip(batches, local) if b) / batches.sum()
    return [float(g @ g) if b else 1e9 for b, g in zip(batches, local)], float(total @ total)


def estimate(noise_scale: float, batches, steps: int, seed: int) -> float:
    """The estimator's noise scale after `steps` steps at the vector `batches`."""
    rng = np.random.default_rng(seed)
    grad, var = problem(noise_scale, rng)
    batches = np.asarray(batches)
    local = {i: grad + rng.normal(size=(steps, DIM)) * np.sqrt(var / b) for i, b in enumerate(batches) if b}
    total = sum(b * local[i] for i, b in enumerate(batches) if b) / batches.sum()
    norms = np.stack([np.sum(local[i] ** 2, axis=1) if b else np.full(steps, 1e9) for i, b in enumerate(batches)], 1)
    totals = np.sum(total ** 2, axis=1)
    estimator = NoiseScale(smoothing=0.99)
    for step in range(steps):
        estimator.observe(batches, norms[step], totals[step], int(batches.sum()))
    return estimator.value()


@pytest.mark.parametrize("batches", [[40, 88], [64, 64], [96, 32, 0], [8, 16, 32, 72], [128, 0, 0, 0, 0, 0, 0, 1]],
                         ids=["uneven", "equal (ssgd)", "one sits out", "four uneven", "one nearly alone"])
@pytest.mark.parametrize("noise_scale", [30.0, 500.0])
def test_the_estimate_is_within_10_percent_of_the_known_noise_scale(batches, noise_scale):
    """At noise scales below and above the global batch (128), after 600 steps; a rank
    that sits out reports a nonsense norm, which must not enter the fit."""
    errors = [estimate(noise_scale, batches, 600, seed) / noise_scale - 1 for seed in range(3)]
    assert abs(float(np.median(errors))) < 0.10, errors


def test_one_rank_taking_part_gives_no_estimate():
    assert fit_step([0, 128], [1e9, 3.0], 3.0, 128) is None
    estimator = NoiseScale()
    for _ in range(50):
        assert not estimator.observe([128], [3.0], 3.0, 128)
    assert estimator.value() is None


def test_no_value_before_enough_steps_or_where_the_signal_is_not_positive():
    estimator = NoiseScale(min_steps=10)
    for _ in range(9):
        estimator.observe([32, 96], [5.0, 3.0], 2.5, 128)
    assert estimator.value() is None
    estimator.observe([32, 96], [5.0, 3.0], 2.5, 128)
    assert estimator.value() is not None
    swamped = NoiseScale(min_steps=1)
    swamped.observe([32, 96], [5.0, 3.0], 1.0, 128)        # the line's intercept is negative
    assert swamped.value() is None


def test_the_line_through_exact_points_is_exact():
    """Without noise in the norms, one step gives |G|^2 and tr(Sigma) exactly."""
    grad_sq, trace = 2.0, 300.0
    batches = np.array([16, 48, 64])
    pair = fit_step(batches, grad_sq + trace / batches, grad_sq + trace / 128, 128)
    assert pair == pytest.approx((grad_sq, trace))


def test_the_state_resumes_exactly():
    rng = np.random.default_rng(5)
    grad, var = problem(100.0, rng)
    one, two = NoiseScale(), None
    for step in range(40):
        local, total = step_norms(grad, var, [20, 44], rng)
        if step == 17:
            two = NoiseScale.from_state(one.state_dict())
        for estimator in (one, two):
            if estimator is not None:
                estimator.observe([20, 44], local, total, 64)
    assert one.state_dict() == two.state_dict()


def test_efficiency_and_gain():
    assert efficiency(64, 100.0, 64) == 1.0 and gain(64, 100.0, 64) == 1.0
    assert gain(128, 1e12, 64) == pytest.approx(2.0)          # all noise: twice the batch, twice the progress
    assert gain(128, 0.0, 64) == pytest.approx(1.0)           # no noise: a larger batch gains nothing
    assert goodput.lr_factor("adascale", 128, 64, 64.0) == pytest.approx(128 / 64 * 128 / 192)
    assert goodput.lr_factor("sqrt", 256, 64, None) == 2.0 and goodput.lr_factor("linear", 256, 64, None) == 4.0
    with pytest.raises(ValueError, match="lr scaling"):
        goodput.lr_factor("cubic", 128, 64, None)
