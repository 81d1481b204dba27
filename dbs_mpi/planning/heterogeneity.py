"""Heterogeneity emulation: make a homogeneous machine behave like a heterogeneous cluster.

Speeds are relative: they are divided by the largest, so `--speeds 4,2,1` and
`--speeds 1,0.5,0.25` are the same and the fastest rank runs at the machine's own
speed. A rank with relative speed s (0 < s <= 1) behaves as if its device were s times as fast: after
it computed a step in c seconds it sleeps c * (1/s - 1) more, so its compute time is
c / s. Sleeping, not spinning, leaves the core to other ranks. Disturbances:

* slow-down: rank `slow_rank` is `slow_factor` times slower in epochs [start, stop),
  in the run's steps [start, stop) (counted over all epochs and across resumes), and
  from start to stop seconds of training (`slow_epochs`, `slow_steps`, `slow_seconds`; any of the three);
* random sleeps (the DBS paper's "irrelevant tasks"): at every epoch, each rank that
  is not disturbed yet starts, with probability `sleep_prob`, a disturbance lasting
  `sleep_epochs` (uniform) epochs, during which it sleeps `sleep_seconds` (uniform)
  extra seconds per epoch, spread evenly over that epoch's steps;
* coupling (`couple`, `--couple RANK:K`): a rank computes K times slower in a step where
  another rank of its node (its host) computes too, as a GPU does beside CPU ranks that
  share its node's cores and memory. The emulator is told per step whether others compute
  (`stretch(..., others_compute=)`; `others_compute` gives it from a step's local batches
  and the ranks' hosts). In the start-up calibration every rank computes at once, so a
  coupled rank is timed coupled there, and the planner starts from its coupled speed.

Real heterogeneity (a busy core, a slower node) is measured the same way and needs none
of this; to make some on purpose, `Contention` starts a real CPU hog on a rank's core
for a stretch of steps (nothing emulated: the operating system shares the core). No MPI
here: the draws are seeded by (seed, rank), so runs are reproducible.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time

import numpy as np

from ..options import parse_couple


def others_compute(hosts, row=None) -> np.ndarray:
    """For every rank, whether another rank of its host computes in a step whose local
    batches are `row` (None: every rank computes, as in the start-up calibration).
    hosts: any label of every rank's node (host names, or their indices)."""
    _, node = np.unique(np.asarray(hosts), return_inverse=True)
    computing = np.ones(len(node)) if row is None else (np.asarray(row) > 0).astype(float)
    return np.bincount(node, weights=computing)[node] - computing > 0


def precise_sleep(seconds: float) -> None:
    """time.sleep, finishing the last fraction of a millisecond by yielding."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    if seconds > 2e-3:
        time.sleep(seconds - 1e-3)
    while time.perf_counter() < end:
        time.sleep(0)


class Emulator:
    def __init__(self, rank: int, speed: float = 1.0, *, seed: int = 0, slow_rank: int = -1,
                 slow_factor: float = 1.0, slow_epochs=(0, 0), slow_steps=(0, 0), slow_seconds=(0.0, 0.0),
                 sleep_prob: float = 0.0, sleep_seconds=(5.0, 10.0), sleep_epochs=(4, 20),
                 contention_rank: int = -1, contention_steps=(0, 0), couple: float = 1.0):
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        if couple < 1:
            raise ValueError(f"couple must be at least 1, got {couple}")
        self.rank = rank
        self.speed = speed
        self.slow_factor = slow_factor if slow_rank == rank else 1.0
        self.slow_epochs = tuple(slow_epochs)
        self.slow_steps, self.slow_seconds = tuple(slow_steps), tuple(slow_seconds)
        self.run_step = 0              # training steps done over the run
        self.trained = 0.0             # seconds of training done (at the last step's end)
        self.epoch_slowed = False      # the open epoch is in slow_epochs
        self.contention = Contention(*contention_steps) if contention_rank == rank else None
        self.sleep_prob = sleep_prob
        self.sleep_seconds = tuple(sleep_seconds)
        self.sleep_epochs = tuple(sleep_epochs)
        self.rng = np.random.default_rng([seed, rank, 0x5EED])
        self.disturbed_until = -1      # last epoch (exclusive) of the current random-sleep disturbance
        self.epoch_sleep = 0.0         # extra seconds to sleep over this epoch
        self.step_sleep = 0.0          # ... per step
        self.factor = 1.0 / speed      # compute-time multiplier in this epoch
        self.couple = float(couple)    # compute x couple in a step where another rank of the node computes
        self.wall_clock = False        # a GPU rank: stretch wall time (its CPU time is not its device's work)

    @classmethod
    def from_config(cls, cfg, rank: int) -> "Emulator":
        speed = cfg.speeds[rank] / max(cfg.speeds) if cfg.speeds else 1.0
        return cls(rank, speed, seed=cfg.seed, slow_rank=cfg.slow_rank, slow_factor=cfg.slow_factor,
                   slow_epochs=cfg.slow_epochs, slow_steps=cfg.slow_steps, slow_seconds=cfg.slow_seconds,
                   sleep_prob=cfg.sleep_prob, sleep_seconds=cfg.sleep_seconds, sleep_epochs=cfg.sleep_epochs,
                   contention_rank=cfg.contention_rank, contention_steps=cfg.contention_steps,
                   couple=parse_couple(cfg.couple).get(rank, 1.0))

    def state_dict(self) -> dict:
        """The emulator's position (random stream, disturbance, this epoch's factors):
        plain types only, for checkpoints."""
        return {"rng": self.rng.bit_generator.state, "disturbed_until": int(self.disturbed_until),
                "factor": float(self.factor), "epoch_sleep": float(self.epoch_sleep),
                "step_sleep": float(self.step_sleep), "run_step": int(self.run_step), "trained": float(self.trained),
                "epoch_slowed": bool(self.epoch_slowed)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.disturbed_until = int(state["disturbed_until"])
        self.factor, self.epoch_sleep, self.step_sleep = (float(state[k]) for k in
                                                          ("factor", "epoch_sleep", "step_sleep"))
        self.run_step, self.trained = int(state.get("run_step", 0)), float(state.get("trained", 0.0))
        self.epoch_slowed = bool(state.get("epoch_slowed", self.factor != 1.0 / self.speed))
        self._set_factor()           # (a resume may change the speeds)

    def resume_at(self, run_step: int, trained_seconds: float) -> None:
        """Continue a run that another number of ranks began, `run_step` steps and
        `trained_seconds` of training in: the step and time windows count over the whole
        run, so a resumed run slows the same steps as one never stopped (the random sleeps
        start afresh: their draws are per rank)."""
        self.run_step, self.trained = int(run_step), float(trained_seconds)
        self._set_factor()

    @property
    def active(self) -> bool:
        return self.factor != 1.0 or self.step_sleep > 0

    @property
    def idle(self) -> bool:
        """True if this emulator can never slow its rank (full speed, no disturbance of its
        own): its stretch is always 0, and a GPU rank need not wait for its compute's end."""
        return self.speed == 1.0 and self.slow_factor == 1.0 and self.sleep_prob <= 0 and self.contention is None \
            and self.couple == 1.0

    def start_epoch(self, epoch: int, steps: int) -> None:
        lo, hi = self.slow_epochs
        self.epoch_slowed = lo <= epoch < hi
        self._set_factor()
        # One draw per epoch, whatever happens, so the stream does not depend on history.
        u, length, extra = self.rng.random(), self.rng.integers(self.sleep_epochs[0], self.sleep_epochs[1] + 1), \
            self.rng.uniform(*self.sleep_seconds)
        if epoch >= self.disturbed_until and self.sleep_prob > 0 and u < self.sleep_prob:
            self.disturbed_until = epoch + int(length)
        self.epoch_sleep = float(extra) if epoch < self.disturbed_until else 0.0
        self.step_sleep = self.epoch_sleep / max(steps, 1)

    def step_done(self, trained_seconds: float) -> None:
        """A training step ended, `trained_seconds` into training: the next step's factor
        (and the contention's start or end)."""
        self.run_step += 1
        self.trained = float(trained_seconds)
        self._set_factor()
        if self.contention is not None:
            self.contention.at(self.run_step)

    def _set_factor(self) -> None:
        (s0, s1), (t0, t1) = self.slow_steps, self.slow_seconds
        slowed = self.epoch_slowed or s0 <= self.run_step < s1 or t0 <= self.trained < t1
        self.factor = (self.slow_factor if slowed else 1.0) / self.speed

    def factor_with(self, others_compute: bool) -> float:
        """The compute-time multiplier of a step in which other ranks of the node compute or not."""
        return self.factor * (self.couple if others_compute else 1.0)

    def stretch(self, compute_seconds: float, cpu_seconds: float | None = None, others_compute: bool = False) -> float:
        """Sleep so that a step that computed for compute_seconds (wall) took as long as on
        the emulated device; returns the seconds slept. With cpu_seconds (the process's
        CPU time over the same interval) the slow-down stretches the smaller of the two:
        the work itself, not the time spent waiting for a core (other ranks on the same
        cores, other jobs), which a slower device would wait just as long, not 1/s times.
        On a GPU rank (wall_clock) the CPU time is launches and waits: the wall time is stretched.
        others_compute: another rank of this rank's node computes in the step (coupling)."""
        work = compute_seconds if cpu_seconds is None or self.wall_clock else min(compute_seconds, cpu_seconds)
        extra = work * (self.factor_with(others_compute) - 1.0) + self.step_sleep
        if extra > 0:
            precise_sleep(extra)
            return extra
        return 0.0


HOG = """
import os, time
parent = os.getppid()
while os.getppid() == parent:          # a busy loop that ends with its rank, whatever happens
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:
        pass
"""


class Contention:
    """Real contention for the run's steps [start, stop): a busy process on this rank's
    first core, the rank pinned to the same core meanwhile (so the operating system gives
    each about half of it); afterwards the process is stopped and the rank's affinity
    restored. The process also ends by itself when its rank is gone."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop = int(start), int(stop)
        self.process: subprocess.Popen | None = None
        self.affinity: set | None = None

    def at(self, step: int) -> None:
        """The next step is `step` (of the run): start or stop the hog if it is time."""
        if self.start <= step < self.stop and self.process is None:
            self._begin()
        elif not self.start <= step < self.stop and self.process is not None:
            self.end()

    def _begin(self) -> None:
        self.affinity = os.sched_getaffinity(0)
        core = {min(self.affinity)}
        os.sched_setaffinity(0, core)
        self.process = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL)
        os.sched_setaffinity(self.process.pid, core)
        atexit.register(self.end)

    def end(self) -> None:
        if self.process is not None:
            atexit.unregister(self.end)
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)
            self.affinity = None

    def __del__(self):
        try:
            self.end()
        except Exception:   # interpreter shutdown
            pass
