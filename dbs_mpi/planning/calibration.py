"""What the start-up calibration times on each rank, and the times it reads off instead.

The calibration (training/balancer.py, calibrate) times every rank at a small and a
large local batch (allocation.calibration_batches) and fits t_i(b) = a_i + c_i b. No rank
should wait long for a slower one, so every rank first times a tiny batch of 2 samples,
and its ratio r to the fastest rank's time there decides its role:

  slow     r > SLOW_START: not timed further. Its times are the fastest rank's scaled
           by r (it will sit out or take a few samples, and the steps measure it from
           then on; at 1:0.02 its two batches took 17 s of a short run)
  short    r >= SHORT_START, where the small batch is not too close to the tiny one
           (the line below reaches at most LINE_REACH times its measured span beyond
           it): the small batch only. Its time at the large batch is read off the line
           through its tiny and small times (their proportional reading where noise
           gives that line no positive slope). Its share lies near or below the small
           batch (B/2n): at most B/3 of two ranks at 1:0.5, B/5 at 1:0.25, and its 4
           steps of the large batch (2B/n) outlasted the fastest rank's whole calibration
  timed    the rest: both batches

The values read off are recorded like measured ones (startup/step_time), so a launch
that reuses a recorded calibration fits the same model. The simulator
(tools/simulator/sync.py) fills in its simulated calibration with the same rules. Pure
code, no MPI: every rank decides alike from the gathered tiny times.
"""
from __future__ import annotations

import numpy as np

TINY = 2              # samples of the tiny batch ...
TINY_STEPS = 3        # ... and its timed steps (their median: one step of a busy machine's noise fooled it)
SLOW_START = 8.0      # a rank this many times slower than the fastest at the tiny batch is not timed further
SHORT_START = 2.0     # ... this many times slower: the small batch only (its large read off a line)
LINE_REACH = 4.0      # the line reaches at most this many times (small - TINY) beyond the small batch


def roles(tiny, small: int, large: int) -> tuple[np.ndarray, np.ndarray]:
    """(slow, short): bool per rank, from every rank's tiny-batch seconds (see the module docstring)."""
    tiny = np.asarray(tiny, float)
    ratio = tiny / tiny.min()
    slow = ratio > SLOW_START
    reach = LINE_REACH * (small - TINY) >= large - small
    return slow, ~slow & (ratio >= SHORT_START) & bool(reach)


def completed(tiny, times, small: int, large: int) -> np.ndarray:
    """The (ranks x 2) calibration times with what `roles` left untimed filled in: a short
    rank's large batch off its line, a slow rank's both from the fastest rank's."""
    tiny, times = np.asarray(tiny, float), np.array(times, float)
    slow, short = roles(tiny, small, large)
    slope = (times[short, 0] - tiny[short]) / (small - TINY)
    times[short, 1] = np.where(slope > 0, times[short, 0] + slope * (large - small), times[short, 0] * large / small)
    fastest = int(np.argmin(tiny))
    times[slow] = np.outer(tiny[slow] / tiny[fastest], times[fastest])
    return times
