"""The start-up calibration's steps (training/balancer.py, calibrate): a rank slower than
the fastest at the tiny batch times fewer steps, so that nobody waits long for it; at
any number of ranks (run at 1, 2 and 4)."""
import time

import pytest

from dbs_mpi.training import balancer


def test_a_slower_rank_times_fewer_steps_never_more_than_asked():
    assert balancer.calibration_steps(1.0, 5, 2) == (5, 2)
    assert balancer.calibration_steps(4.0, 5, 2) == (3, 1)           # at least LEAST_TIMED timed, one untimed
    assert balancer.calibration_steps(1.3, 10, 4) == (8, 3)
    assert balancer.calibration_steps(4.0, 2, 0) == (2, 0)           # a user's fewer steps stay as asked
    assert balancer.calibration_steps(float("nan"), 5, 2) == (5, 2)


@pytest.mark.mpi
def test_every_rank_but_the_fastest_calls_its_step_less_often(comm):
    """Rank 0's step sleeps 2 ms, every other rank's 12 ms (6x: below the 8x that skips
    timing): rank 0 takes its 1 + 3 tiny steps and 2 + 5 at each batch; the others 1 + 3
    at each (LEAST_TIMED, one untimed). All get the fitted model of every rank."""
    calls = []

    def step(b):
        calls.append(b)
        time.sleep(0.002 if comm.Get_rank() == 0 else 0.012)

    fit, times = balancer.calibrate(comm, step, 8, 32, steps=5, warmup=2, timeout=60.0)
    tiny = 1 + balancer.TINY_STEPS
    assert len(calls) == (tiny + 2 * 7 if comm.Get_rank() == 0 else tiny + 2 * 4), calls
    assert times.shape == (comm.Get_size(), 2)
    assert (times[1:] > 3 * times[0]).all(), times
