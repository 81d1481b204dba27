"""The goodput choice of the global batch (planning/goodput.py) on step-time models whose
best batch is known: with T(B) = e + c B and noise scale N, goodput is proportional to
B / ((N + B)(e + c B)), largest at B* = sqrt(N e / c)."""
import math

import numpy as np
import pytest

from dbs_mpi.planning import goodput


def linear_time(fixed: float, per_sample: float):
    return lambda b: fixed + per_sample * b


@pytest.mark.parametrize("noise, fixed, per_sample, current",
                         [(400.0, 0.02, 1e-4, 32), (50.0, 0.005, 2e-4, 1024), (5000.0, 0.05, 1e-5, 32)])
def test_the_choice_is_the_best_batch_within_the_grid(noise, fixed, per_sample, current):
    best = math.sqrt(noise * fixed / per_sample)
    chosen = goodput.choose(linear_time(fixed, per_sample), noise, current, 32, 16, 8192)
    assert chosen is not None and abs(math.log(chosen / best)) < math.log(8192 / 16) / (goodput.CANDIDATES - 1), \
        (chosen, best)


def test_small_gains_unknown_noise_and_unrunnable_batches_keep_the_batch():
    step_time = linear_time(0.02, 1e-4)
    best = goodput.choose(step_time, 400.0, 32, 32, 16, 8192)
    assert goodput.choose(step_time, 400.0, best, 32, 16, 8192) is None           # already there
    assert goodput.choose(step_time, 400.0, int(best * 1.1), 32, 16, 8192) is None  # within MIN_GAIN
    assert goodput.choose(step_time, None, 32, 32, 16, 8192) is None                # no noise scale yet
    capped = goodput.choose(lambda b: step_time(b) if b <= 100 else math.inf, 400.0, 32, 32, 16, 8192)
    assert capped is not None and capped <= 100


def test_the_candidates_span_the_bounds():
    tried = goodput.candidates(64, 1024)
    assert tried[0] == 64 and tried[-1] == 1024 and (np.diff(tried) > 0).all()
    assert goodput.candidates(7, 7).tolist() == [7]
    with pytest.raises(ValueError, match="bounds"):
        goodput.candidates(0, 10)
