"""The start-up calibration's steps (training/balancer.py, calibrate): a rank slower than
the fastest at the tiny batch times fewer steps, so that nobody waits long for it; at
any number of ranks (run at 1, 2 and 4)."""
import time

import numpy as np
import pytest

from dbs_mpi.planning import allocation, calibration
from dbs_mpi.training import balancer, profiling


def test_a_slower_rank_times_fewer_steps_never_more_than_asked():
    assert balancer.calibration_steps(1.0, 5, 2) == (5, 2)
    assert balancer.calibration_steps(4.0, 5, 2) == (3, 1)           # at least LEAST_TIMED timed, one untimed
    assert balancer.calibration_steps(1.3, 10, 4) == (8, 3)
    assert balancer.calibration_steps(4.0, 2, 0) == (2, 0)           # a user's fewer steps stay as asked
    assert balancer.calibration_steps(float("nan"), 5, 2) == (5, 2)


def test_a_rank_much_slower_at_the_tiny_batch_is_read_off_its_time_there():
    """Ratios 3, 1, 10 and 15 at the tiny batch (the fastest is rank 1): the 10x and 15x
    ranks do not time the two batches, and without a second batch's time (NaN, as where
    it would be under SECOND_LEAST samples) their times at 128 and 512 samples are their
    tiny times plus the fastest's cost per sample (0.1 ms) times their ratio for the
    samples beyond 2, so the fixed cost they showed stays (the fastest's times scaled
    would give the 15x rank [0.15, 0.6] s, 25 ms less at a few samples); the others keep
    what they timed. A clock that read 0 does not make every rank slow."""
    tiny = np.array([0.006, 0.002, 0.020, 0.030])
    assert calibration.slow(tiny).tolist() == [False, False, True, True]
    times = np.array([[0.03, 0.09], [0.0126, 0.0510], [np.nan, np.nan], [np.nan, np.nan]])
    done = calibration.completed(tiny, times, 128, 512)
    assert done[2].tolist() == pytest.approx([0.020 + 10 * 1e-4 * 126, 0.020 + 10 * 1e-4 * 510])
    assert done[3].tolist() == pytest.approx([0.030 + 15 * 1e-4 * 126, 0.030 + 15 * 1e-4 * 510])
    assert done[:2].tolist() == times[:2].tolist()
    assert calibration.slow([0.0, 1e-10, 0.001]).tolist() == [False, False, True]


def test_a_slow_rank_is_read_off_its_own_line_through_its_tiny_and_second_batches():
    """A slow rank's tiny ratio (20) overstates its cost per sample (7.5x here): it
    times SECOND x small / r samples of its own, and its times at 128 and 512 are read off
    the line through that and its tiny time. A second time that shows no more cost per
    sample than the fastest rank's (noise), and a rank too slow for a second batch of
    SECOND_LEAST samples (r = 100: 5.12), read the fastest's cost times r."""
    tiny = np.array([0.001, 0.020, 0.100])
    assert calibration.second_batch(tiny, 128).tolist() == [0, 26, 0]
    assert calibration.second_batch([0.001, 0.007], 128).tolist() == [0, 0]          # 7x: not slow
    fastest = [0.0126, 0.0510]                                                          # 0.1 ms a sample
    done = calibration.completed(tiny, [fastest, [0.020 + 7.5e-4 * 24, np.nan], [np.nan, np.nan]], 128, 512)
    assert done[1].tolist() == pytest.approx([0.020 + 7.5e-4 * 126, 0.020 + 7.5e-4 * 510])
    assert done[2].tolist() == pytest.approx([0.100 + 100 * 1e-4 * 126, 0.100 + 100 * 1e-4 * 510])
    for noisy in (0.019, 0.020 + 0.9e-4 * 24):           # no cost per sample, or less than the fastest's
        done = calibration.completed(tiny, [fastest, [noisy, np.nan], [np.nan, np.nan]], 128, 512)
        assert done[1].tolist() == pytest.approx([0.020 + 20 * 1e-4 * 126, 0.020 + 20 * 1e-4 * 510])


def test_only_a_rank_too_slow_for_a_second_batch_stops_timing_the_tiny_batch_early():
    """By the shorter of every rank's first two tiny steps: a rank 100x slower than the
    fastest (small 128: a second batch of round(512 / 100) = 5 samples, under
    SECOND_LEAST) stops, as does one 70x slower (7 samples); one 15x slower times its
    second batch and one 68x slower one of 8 samples, so both time the tiny batch in
    full, as do the fast ones."""
    shorter = np.array([0.002, 0.2, 0.03, 0.0021, 0.136, 0.14])
    assert calibration.second_batch(shorter, 128).tolist() == [0, 0, 34, 0, 8, 0]
    assert calibration.stops_early(shorter, 128).tolist() == [False, True, False, False, False, True]
    assert not calibration.stops_early([0.5], 128).any()                   # one rank: never slow


def test_a_slow_rank_of_a_calibration_at_one_batch_keeps_its_tiny_time():
    """max_local_batch 1: both calibration batches are 1 sample, so the fastest rank's
    times give no cost per sample (none: 0), and a slow rank's times are its tiny time,
    not NaN (a division by the batches' difference, 0)."""
    assert allocation.calibration_batches(64, 2, max_local=1) == (1, 1)
    done = calibration.completed([0.001, 0.02], [[0.0012, 0.0013], [np.nan, np.nan]], 1, 1)
    np.testing.assert_allclose(done, [[0.0012, 0.0013], [0.02, 0.02]])


def test_a_rank_slower_at_the_small_batch_times_a_smaller_large_one_read_off_its_line():
    """Ratios 1, 2, 4 and 20 at the small batch (128), large 512: the 2x rank times 128 +
    384 / 2 samples, the 4x 128 + 96, the 20x (beyond SLOW_START) 128 + 48; a slow rank
    (NaN: it timed no small batch) none. Their times at 512 are read off the line through
    their two, a line that falls (noise) flat at the small batch's time; a rank that timed
    the large batch keeps its time. One batch (max_local 1) or no rank timed: as asked."""
    small_times = [0.01, 0.02, 0.04, 0.2, np.nan]
    assert calibration.large_batches(small_times, 128, 512).tolist() == [512, 320, 224, 176, 0]
    assert calibration.large_batches([0.01, 0.05], 1, 1).tolist() == [1, 1]
    assert calibration.large_batches([np.nan, np.nan], 128, 512).tolist() == [0, 0]
    times = [[0.01, 0.04], [0.02, 0.05], [0.04, 0.03], [np.nan, np.nan]]
    done = calibration.read_off(times, 128, 512, [512, 320, 224, 0])
    assert done[0].tolist() == [0.01, 0.04]
    assert done[1].tolist() == pytest.approx([0.02, 0.02 + 0.03 * 384 / 192])
    assert done[2].tolist() == [0.04, 0.04]
    assert np.isnan(done[3]).all()


class FakeClock:
    """time.perf_counter and process_time of a process whose steps take what they say."""
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def process_time(self):
        return self.now


def test_a_timing_ends_once_its_steps_are_steady_and_never_runs_more_than_asked(monkeypatch):
    """Steps of 20 ms: the timing ends after STEADY timed steps; steps alternating between
    10 and 30 ms are never steady, and all 5 run; within 5% of their median, steady; without
    `steady`, all 5 always."""
    clock = FakeClock()
    monkeypatch.setattr(profiling, "time", clock)
    for seconds, steady, timed in (([0.02], balancer.STEADY, balancer.STEADY), ([0.01, 0.03], balancer.STEADY, 5),
                                   ([0.0200, 0.0209, 0.0201], balancer.STEADY, 3),
                                   ([0.0200, 0.0212, 0.0201], balancer.STEADY, 5), ([0.02], 0, 5)):
        calls = []

        def step(b):
            calls.append(b)
            clock.now += seconds[(len(calls) - 3) % len(seconds)]     # (the 2 untimed: the last two values)
        median = balancer.time_step(step, 4, 5, 2, steady=steady)
        assert len(calls) == 2 + timed, (seconds, steady, calls)
        assert min(seconds) - 1e-9 <= median <= max(seconds) + 1e-9


@pytest.mark.mpi
def test_every_rank_but_the_fastest_calls_its_step_less_often(comm, monkeypatch):
    """Rank 0's step takes 2 ms, every other rank's 12 ms (6x: below the 8x that skips
    timing), on a clock that reads what the steps say (FakeClock): rank 0 takes its 1 + 3
    tiny steps and 2 + 5 at each batch (2 + 3 where its steps were steady); the others
    1 + 3 at each (LEAST_TIMED, one untimed). All get the fitted model of every rank."""
    calls = []
    clock = FakeClock()
    monkeypatch.setattr(profiling, "time", clock)
    seconds = 0.002 if comm.Get_rank() == 0 else 0.012

    def step(b):
        calls.append(b)
        clock.now += seconds
    fit, times, _ = balancer.calibrate(comm, step, 8, 32, steps=5, warmup=2, timeout=60.0)
    tiny = 1 + calibration.TINY_STEPS
    if comm.Get_rank() == 0:
        assert tiny + 2 * (2 + balancer.STEADY) <= len(calls) <= tiny + 2 * 7, calls
    else:
        assert len(calls) == tiny + 2 * 4, calls
    assert times.shape == (comm.Get_size(), 2)
    assert (times[1:] > 3 * times[0]).all(), times


def device_step(per_sample: float):
    """A step on an emulated device: it sleeps per_sample seconds a sample, and the
    emulation stretches its wall time as on a GPU rank (`wall_clock`). Unlike a step that
    computes on the CPU, whose emulated slow-down stretches CPU time, a busy machine
    neither shrinks nor fakes the speeds and the coupling it times."""
    def step(b):
        time.sleep(per_sample * b)
    return step


def device_emulator(rank: int, speed: float, couple: float = 1.0):
    from dbs_mpi.planning.heterogeneity import Emulator
    emulator = Emulator(rank, speed, couple=couple)
    emulator.wall_clock = True
    return emulator


@pytest.mark.mpi
def test_a_rank_coupled_to_the_others_of_its_host_is_timed_alone_and_starts_alone(comm):
    """Rank 0 computes 3x slower while another rank of its host computes (`couple`), the
    others are 10x slower than it: dbs's calibration times rank 0 alone too, sees the
    coupling and starts with rank 0 alone (the others sit out). A launch that reuses the
    recorded calibration plans the same vector; static keeps its calibration's plan and
    times nothing alone. On one rank there is nobody to couple with."""
    from dbs_mpi import Balancer
    from dbs_mpi.planning.dynamic import set_check
    rank, size = comm.Get_rank(), comm.Get_size()
    emulator = device_emulator(rank, 1.0 if rank == 0 else 0.1, 3.0 if rank == 0 else 1.0)
    b = Balancer(comm, 64 * size, "dbs", emulator=emulator, timeout=60.0)
    vector = b.calibrate(device_step(5e-4), steps=3, warmup=1)
    if size == 1:
        assert "alone_time" not in b.startup and vector.tolist() == [64]
        return
    alone = b.startup["alone_time"]
    assert np.isfinite(alone[0]) and np.isnan(alone[1:]).all(), alone
    assert b.startup["step_time"][0, 1] > set_check.COUPLED * alone[0], (b.startup["step_time"], alone)
    assert vector.tolist() == [64 * size] + [0] * (size - 1), vector
    again = Balancer(comm, 64 * size, "dbs", emulator=device_emulator(rank, 1.0), timeout=60.0)
    assert again.use_calibration(b.startup).tolist() == vector.tolist()
    assert b.startup["tiny_time"].shape == (size,) and (b.startup["tiny_time"] > 0).all()
    assert np.array_equal(again.startup["tiny_time"], b.startup["tiny_time"])      # recorded again
    small, large = b.startup["local_batch"]
    assert b.startup["timed_large"][0] == large                     # the fastest: the whole batch; the others,
    assert ((small < b.startup["timed_large"][1:]) & (b.startup["timed_large"][1:] < large)).all()  # 3.3x: less
    assert np.array_equal(again.startup["timed_large"], b.startup["timed_large"])
    static = Balancer(comm, 64 * size, "static", emulator=emulator, timeout=60.0)
    static.calibrate(device_step(5e-4), steps=3, warmup=1)
    assert "alone_time" not in static.startup


@pytest.mark.mpi
def test_a_much_slower_rank_times_its_own_second_batch_and_is_read_off_its_line(comm, monkeypatch):
    """Rank 0's step sleeps 2 ms + 0.01 ms a sample, every other rank's 30 ms + 1 ms a
    sample (15x at the tiny batch, 100x a sample): those time their tiny batch and one of
    their own (round(4 x 64 / r) samples, 1 untimed step and 3 timed), never the two
    batches, and their times there are their own line's (30 ms + 1 ms b; the tiny ratio
    times the fastest's cost per sample would read 0.15 ms a sample). On a clock that
    reads what the steps say (FakeClock): with real sleeps, 4 ranks on 2 cores beside other
    suites woke late enough, in a tiny step or one of the 16-sample batch, to read the
    line 30% too shallow or 3x too steep."""
    calls = []
    rank = comm.Get_rank()
    clock = FakeClock()
    monkeypatch.setattr(profiling, "time", clock)
    fixed, per_sample = (0.002, 0.00001) if rank == 0 else (0.030, 0.001)

    def step(b):
        calls.append(b)
        clock.now += fixed + per_sample * b
    fit, times, tiny = balancer.calibrate(comm, step, 64, 256, steps=5, warmup=2, timeout=60.0)
    if rank > 0:
        second = [b for b in calls if b != calibration.TINY]
        assert len(second) == 1 + calibration.TINY_STEPS and len(set(second)) == 1, calls
        assert calibration.SECOND_LEAST <= second[0] < 64, calls
    else:
        assert 64 in calls and 256 in calls
    expected = 0.030 + 0.001 * np.array([64, 256])
    np.testing.assert_allclose(times[1:], np.tile(expected, (len(times) - 1, 1)))
    assert tiny.shape == (comm.Get_size(),) and calibration.slow(tiny)[1:].all() and not calibration.slow(tiny)[0]


@pytest.mark.mpi
def test_a_rank_slower_at_the_small_batch_times_fewer_samples_at_the_large_one(comm, monkeypatch):
    """On a clock that reads what the steps say (FakeClock: a busy machine cannot move it),
    rank 0's step takes 1 ms + 0.2 ms a sample, every other rank's 1 ms + 0.8 ms (3.78x
    at the small batch of 64, 1.86x at the tiny one: timed, not slow): they time the
    large batch at 64 + round(192 / 3.78) = 115 samples, not 256, and their time at 256 is
    read off their line (1 ms + 0.8 ms x 256); rank 0 times 64 and 256 as before."""
    clock = FakeClock()
    monkeypatch.setattr(profiling, "time", clock)
    calls = []
    rank = comm.Get_rank()
    per_sample = 0.0002 if rank == 0 else 0.0008

    def step(b):
        calls.append(b)
        clock.now += 0.001 + per_sample * b
    fit, times, tiny = balancer.calibrate(comm, step, 64, 256, steps=5, warmup=2, timeout=60.0)
    assert sorted(set(calls) - {calibration.TINY}) == ([64, 256] if rank == 0 or comm.Get_size() == 1 else [64, 115])
    assert times[0].tolist() == pytest.approx([0.001 + 0.0002 * 64, 0.001 + 0.0002 * 256])
    np.testing.assert_allclose(times[1:], np.tile([0.001 + 0.0008 * 64, 0.001 + 0.0008 * 256], (len(times) - 1, 1)))


def calibrated_last_slow(comm, monkeypatch, seconds_of):
    """balancer.calibrate at batches 128 and 512 on a clock that reads what the steps say
    (FakeClock), a step taking seconds_of(last, rank, call) (last: the last of 2 ranks or
    more; call: 1 for the first step); returns (this rank's step batches, last, calibrate's)."""
    clock = FakeClock()
    monkeypatch.setattr(profiling, "time", clock)
    calls = []
    rank, size = comm.Get_rank(), comm.Get_size()
    last = rank == size - 1 and size > 1

    def step(b):
        calls.append(b)
        clock.now += seconds_of(last, rank, len(calls))
    return calls, last, balancer.calibrate(comm, step, 128, 512, steps=5, warmup=2, timeout=60.0)


@pytest.mark.mpi
def test_a_rank_whose_first_two_tiny_steps_are_far_too_slow_times_no_more(comm, monkeypatch):
    """On a clock that reads what the steps say (FakeClock), rank 0's step takes 2 ms. The
    last rank's takes 200 ms (100x: too slow for a second batch): it takes its untimed and
    its first timed tiny step and nothing more, and its tiny time is that step's (at
    1:0.02 its 4 tiny steps made every rank wait 50x its step 4 times). A rank between
    them whose first step alone takes 200 ms (a one-off cost, as a GPU's first kernels)
    times the whole calibration; every rank reads the same times."""
    size = comm.Get_size()
    calls, last, (fit, times, tiny) = calibrated_last_slow(
        comm, monkeypatch, lambda last, rank, call: 0.2 if last or (rank > 0 and call == 1) else 0.002)
    if last:
        assert calls == [calibration.TINY] * 2, calls
    else:
        assert calls[:1 + calibration.TINY_STEPS] == [calibration.TINY] * (1 + calibration.TINY_STEPS), calls
        assert 128 in calls and 512 in calls, calls
    assert tiny.tolist() == pytest.approx([0.002] * (size - 1) + [0.2 if size > 1 else 0.002])
    gathered = comm.allgather(times.tolist())
    assert all(np.array_equal(g, gathered[0], equal_nan=True) for g in gathered)


@pytest.mark.mpi
def test_a_rank_that_stopped_early_times_no_second_batch_where_the_medians_read_it_less_slow(comm, monkeypatch):
    """Rank 0's first two tiny steps take 2 ms, its next two 2.5 ms; the last rank's take
    140 ms. By the shorter of the first two the last rank is 70x slower (too slow for a
    second batch: it stops); by rank 0's median, 56x, which would give it a second batch
    of 9 samples. It times no second batch: its 2 tiny steps are all it takes."""
    calls, last, (fit, times, tiny) = calibrated_last_slow(
        comm, monkeypatch, lambda last, rank, call: 0.140 if last else (0.0025 if call in (3, 4) else 0.002))
    if last:
        assert calls == [calibration.TINY] * 2, calls
        assert calibration.second_batch(tiny, 128)[-1] == 9                # (what the medians alone would give)
        assert np.isfinite(times[-1]).all() and times[-1, 1] > times[-1, 0] > 0.140
