"""What the start-up calibration times on each rank, and the times it reads off instead.

The calibration (training/balancer.py, calibrate) times every rank at a small and a
large local batch (allocation.calibration_batches) and fits t_i(b) = a_i + c_i b. No rank
should wait long for a slower one, so every rank first times a tiny batch of TINY
samples, and its ratio r to the fastest rank's time there decides:

  slow     r > SLOW_START: it does not time the two batches (at 1:0.02 they took 17 s of
           a short run). While the others time theirs, it times one batch of its own,
           about SECOND x small / r samples (second_batch), 1 untimed step and 3 timed.
           Its times at the two batches are read off the line through its tiny and its
           second time: its fixed cost and its cost per sample are the ones it showed.
           Where that batch would be under SECOND_LEAST samples (r above about 68 where
           small is 128; at 1:0.02 r is about 93), too close to the tiny one to show a
           slope, it times nothing more; there, and where its second time shows a cost
           per sample no larger than the fastest rank's (noise), its cost per sample is
           the fastest rank's times r. It then sits out or takes a few samples, and the
           steps measure it from then on. Such a rank stops timing the tiny batch after
           its first timed step (stops_early): every rank takes two tiny steps first,
           the shorter of each rank's two (a one-off cost or one spike does not stop a
           rank) is all-gathered, and the rest take TINY_STEPS - 1 more
  timed    the rest: both batches (a slower one fewer steps: balancer.calibration_steps),
           the large one scaled down where it is slower at the small one (below)

Why a slow rank's own slope. Its tiny ratio overstates its cost per sample wherever the
fastest rank's tiny step is cheaper than its line says (a line fitted at 128 and 512
samples says little of 2): at 1:0.1 (LeNet-5) the ratio was 20 and the cost per sample
about 9x, so the first plan gave the slow rank 11-19 samples where its balance is about
34. (Before, the fastest's times were scaled by r, which lost the slow rank's fixed cost
too: at 1:0.02 the first plan gave it 4 samples, whose steps took 100-130 ms against the
fast rank's 46 for the first 11 steps.) What the second batch costs: its 4 steps take
about 4 of the rank's tiny steps plus, with a cost per sample near r times the fastest's,
about 4 x SECOND of the fastest's small steps' per-sample work; the fastest times at
least 5 steps of each batch, the large one 4x the small. Where the fastest ranks'
calibration is shorter than that (a step of theirs mostly fixed cost), they wait for the
rest, as they wait for the slow rank's tiny steps.

A rank 2-8x slower at the tiny batch still times both batches: it then computes while
the fastest ranks time theirs, as it will while they train, so a rank slowed by the
others of its host is timed so (coupling.py compares that with its time alone); and a
tiny batch says little of a GPU's cost per sample, which a line through it would
extrapolate. But the larger batch of every rank that times both is its own
(large_batches): the small batch's times are all-gathered, and a rank r_s times slower
than the fastest there (any r_s above 1, up to SLOW_START) times small + (large - small)
/ r_s samples: its samples beyond the small batch then take about as long as the
fastest's, and its fewer steps (at r_s = 4, 4 of 1.75x the fastest's step against 5-7)
about as long as the fastest's timing there. Its time at the large batch is read off
the line through its two (read_off). Before, its steps of the large batch outlasted the
fastest rank's whole calibration: at 1:0.25 with the fast rank coupled (`--couple 0:2`;
LeNet-5, B = 512), the slow rank's 4 steps of 512 samples took 0.83-0.91 s against the
fast rank's 0.52-0.77 s at 512; now it times about 320 samples in 0.59-0.69 s. The
ratio at the small batch, not the tiny one, decides: a GPU can be slower than a CPU at
2 samples (its kernels' launches) and faster at the small batch, and then times the
whole large one.

The times read off are recorded like measured ones (startup/step_time; startup/tiny_time
tells the slow ranks, startup/timed_large the larger batch each rank timed), so a launch
that reuses a recorded calibration fits the same model. The simulator
(tools/simulator/sync.py) fills in its simulated calibration by the same rule. Pure
code, no MPI: every rank decides alike from the gathered times.
"""
from __future__ import annotations

import numpy as np

TINY = 2              # samples of the tiny batch ...
TINY_STEPS = 3        # ... and its timed steps (their median: one step of a busy machine's noise fooled it)
SLOW_START = 8.0      # a rank this many times slower than the fastest at the tiny batch is not timed further
SECOND = 4.0          # a slow rank's own second batch: SECOND x small / r samples ...
SECOND_LEAST = 4 * TINY   # ... where that is at least this many (fewer: too close to TINY for a slope)


def tiny_batch(small: int) -> int:
    """The tiny batch's samples where the small calibration batch is `small`."""
    return min(int(small), TINY)


def ratios(tiny) -> np.ndarray:
    """Every rank's tiny-batch seconds over the fastest rank's (a clock that read 0: 1e-9 s)."""
    tiny = np.asarray(tiny, float)
    return tiny / max(float(np.min(tiny)), 1e-9)


def slow(tiny) -> np.ndarray:
    """The ranks (bool) that do not time the two batches (see the module docstring)."""
    return ratios(tiny) > SLOW_START


def stops_early(first, small: int) -> np.ndarray:
    """The ranks (bool) that time no more tiny steps than their first (see the module
    docstring): slow by `first`, every rank's first two tiny steps' shorter (the untimed
    and the first timed: a one-off cost or a spike in one of them does not stop a rank),
    and too slow for a second batch."""
    return slow(first) & (second_batch(first, small) == 0)


def second_batch(tiny, small: int) -> np.ndarray:
    """Per rank, the samples of the one batch a slow rank times besides the tiny one
    (0: a rank that is not slow, or one too slow for it; see the module docstring)."""
    tiny = np.asarray(tiny, float)
    with np.errstate(divide="ignore"):                           # (a clock that read 0: not slow)
        second = np.round(SECOND * int(small) / ratios(tiny))   # below small: SECOND < SLOW_START
    return np.where(slow(tiny) & (second >= SECOND_LEAST), second, 0).astype(int)


def completed(tiny, times, small: int, large: int) -> np.ndarray:
    """The (ranks x 2) calibration times at (small, large) with the slow ranks' filled in.
    times: what the ranks timed, a slow rank's first column its second batch's seconds
    (NaN: none). A slow rank's times are t(b) = tiny + c (b - TINY): c its own cost per
    sample between its tiny and second batches where that is more than the fastest
    rank's, else the fastest rank's between the two batches (none: 0) times its ratio."""
    tiny, times = np.asarray(tiny, float), np.array(times, float)
    late, second = slow(tiny), second_batch(tiny, small)
    fastest = int(np.argmin(tiny))
    spread = times[fastest, 1] - times[fastest, 0]       # (one batch, as at max_local_batch 1: none)
    per_sample = max(spread / (large - small), 0.0) if large > small else 0.0
    with np.errstate(invalid="ignore", divide="ignore"):
        own = (times[:, 0] - tiny) / (second - tiny_batch(small))
    slope = np.where((second > 0) & (own > per_sample), own, ratios(tiny) * per_sample)     # (NaN > x: False)
    beyond = np.array([small, large], float) - tiny_batch(small)
    times[late] = tiny[late, None] + np.outer(slope[late], beyond)
    return times


def large_batches(small_times, small: int, large: int) -> np.ndarray:
    """Per rank, the large batch it times (see the module docstring): small + (large -
    small) / r_s, r_s its time at the small batch over the fastest's, within 1 and
    SLOW_START; 0 for a rank that did not time the small one (NaN: a slow rank)."""
    t = np.asarray(small_times, float)
    timed = np.isfinite(t)
    if large <= small or not timed.any():
        return np.where(timed, large, 0).astype(int)
    ratio = np.clip(np.where(timed, t, 0.0) / max(float(np.min(t[timed])), 1e-9), 1.0, SLOW_START)
    beyond = np.maximum(1, np.round((large - small) / ratio))
    return np.where(timed, small + beyond, 0).astype(int)


def read_off(times, small: int, large: int, batches) -> np.ndarray:
    """The (ranks x 2) times with those at the large batch of the ranks that timed a
    smaller one (`batches`: large_batches) read off the line through their two times (a
    line that falls, noise: flat at the small batch's time)."""
    times = np.array(times, float)
    short = _shorter(batches, small, large)
    rise = np.maximum(times[short, 1] - times[short, 0], 0.0) / (np.asarray(batches)[short] - small)
    times[short, 1] = times[short, 0] + rise * (large - small)
    return times


def timed_large(tiny, times, small: int, large: int) -> np.ndarray:
    """Per rank, the larger batch the calibration timed (large_batches, found again from
    the times at the small batch that it all-gathered: a slow rank's, by `tiny`, none: 0),
    recorded as startup/timed_large."""
    times = np.asarray(times, float)
    return large_batches(np.where(slow(tiny), np.nan, times[:, 0]), int(small), int(large))


def timed(tiny, times, small: int, large: int, batches=None) -> np.ndarray:
    """(ranks x 2) bool: which of a calibration's recorded times (`times`, at `small` and
    `large`) were timed, not read off: none of a slow rank's (by `tiny`; recorded without
    it: none slow), and not a rank's at the large batch where it timed a smaller one
    (`batches`: startup/timed_large; a calibration recorded without it timed `large`)."""
    times = np.asarray(times, float)
    late = slow(tiny) if len(tiny) == len(times) else np.zeros(len(times), bool)
    batches = np.full(len(times), int(large)) if batches is None or len(batches) != len(times) else batches
    return np.stack([~late, ~late & ~_shorter(batches, small, large)], axis=1)


def _shorter(batches, small: int, large: int) -> np.ndarray:
    """The ranks whose larger batch (large_batches) was below `large`: their time there read off."""
    batches = np.asarray(batches)
    return (batches > small) & (batches < large)
