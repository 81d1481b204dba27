"""What the start-up calibration times on each rank, and the times it reads off instead.

The calibration (training/balancer.py, calibrate) times every rank at a small and a
large local batch (allocation.calibration_batches) and fits t_i(b) = a_i + c_i b. No rank
should wait long for a slower one, so every rank first times a tiny batch of TINY
samples, and its ratio r to the fastest rank's time there decides:

  slow     r > SLOW_START: not timed further (at 1:0.02 its two batches took 17 s of a
           short run). Its times are read off the line through its own tiny time with
           the fastest rank's cost per sample at the two batches, times r: its fixed cost
           is the one it showed. (The fastest's times times r had lost it: a line fitted
           at 128 and 512 samples says little of 2, and at 1:0.02 the plan gave the slow
           rank 4 samples, whose steps took 100-130 ms against the fast rank's 46 for the
           first 11 steps.) It then sits out or takes a few samples, and the steps
           measure it from then on
  timed    the rest: both batches (a slower one fewer steps: balancer.calibration_steps)

A rank 2-8x slower still times both batches, though its steps of the large one may
outlast the fastest rank's whole calibration (at 1:0.25, 0.9 s against 0.5 s): it then
computes while the fastest ranks time theirs, as it will while they train, so a rank
slowed by the others of its host is timed so (coupling.py compares that with its time
alone); and a tiny batch says little of a GPU's cost per sample, which a line through it
would extrapolate. The times read off are recorded like measured ones (startup/step_time),
so a launch that reuses a recorded calibration fits the same model. The simulator
(tools/simulator/sync.py) fills in its simulated calibration by the same rule. Pure
code, no MPI: every rank decides alike from the gathered tiny times.
"""
from __future__ import annotations

import numpy as np

TINY = 2              # samples of the tiny batch ...
TINY_STEPS = 3        # ... and its timed steps (their median: one step of a busy machine's noise fooled it)
SLOW_START = 8.0      # a rank this many times slower than the fastest at the tiny batch is not timed further


def tiny_batch(small: int) -> int:
    """The tiny batch's samples where the small calibration batch is `small`."""
    return min(int(small), TINY)


def ratios(tiny) -> np.ndarray:
    """Every rank's tiny-batch seconds over the fastest rank's (a clock that read 0: 1e-9 s)."""
    tiny = np.asarray(tiny, float)
    return tiny / max(float(np.min(tiny)), 1e-9)


def slow(tiny) -> np.ndarray:
    """The ranks (bool) that time nothing more (see the module docstring)."""
    return ratios(tiny) > SLOW_START


def completed(tiny, times, small: int, large: int) -> np.ndarray:
    """The (ranks x 2) calibration times at (small, large) with the slow ranks' filled in:
    t(b) = tiny + r c (b - TINY), c the fastest rank's seconds per sample between the two
    batches (none: 0)."""
    tiny, times = np.asarray(tiny, float), np.array(times, float)
    late = slow(tiny)
    fastest = int(np.argmin(tiny))
    per_sample = max((times[fastest, 1] - times[fastest, 0]) / (large - small), 0.0)
    beyond = np.array([small, large], float) - tiny_batch(small)
    times[late] = tiny[late, None] + np.outer(ratios(tiny)[late] * per_sample, beyond)
    return times
