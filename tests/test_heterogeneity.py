"""Heterogeneity emulation: no MPI."""
import time

import pytest

from dbs_mpi.config import Config
from dbs_mpi.heterogeneity import Emulator


def test_speed_stretches_compute():
    e = Emulator(0, 0.25)
    e.start_epoch(0, 10)
    start = time.perf_counter()
    slept = e.stretch(0.01)
    assert slept == pytest.approx(0.03)
    assert time.perf_counter() - start >= 0.03


def test_speeds_are_relative_to_the_fastest():
    cfg = Config(speeds=(4.0, 2.0, 1.0))
    assert [Emulator.from_config(cfg, r).speed for r in range(3)] == [1.0, 0.5, 0.25]


def test_slowdown_window():
    e = Emulator(1, 1.0, slow_rank=1, slow_factor=3.0, slow_epochs=(2, 4))
    factors = []
    for epoch in range(6):
        e.start_epoch(epoch, 5)
        factors.append(e.factor)
    assert factors == [1, 1, 3, 3, 1, 1]
    other = Emulator(0, 1.0, slow_rank=1, slow_factor=3.0, slow_epochs=(2, 4))
    other.start_epoch(2, 5)
    assert other.factor == 1


def test_random_sleep_disturbance_is_seeded_and_bounded():
    def trace(seed):
        e = Emulator(0, 1.0, seed=seed, sleep_prob=0.3, sleep_seconds=(5, 10), sleep_epochs=(4, 20))
        out = []
        for epoch in range(60):
            e.start_epoch(epoch, 100)
            out.append(e.epoch_sleep)
        return out
    a = trace(1)
    assert a == trace(1) and a != trace(2)
    assert any(s > 0 for s in a) and any(s == 0 for s in a)
    assert all(s == 0 or 5 <= s <= 10 for s in a)
    runs, current = [], 0                      # lengths of disturbed stretches: 4..20 epochs (merged runs may be longer)
    for s in a + [0]:
        if s > 0:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    complete = runs[:-1] if a[-1] > 0 else runs   # a stretch cut off by the end of the trace may be shorter
    assert len(complete) >= 2 and min(complete) >= 4, (runs, a[-1])
