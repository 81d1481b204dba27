"""Profiling: what each rank spends its time on, and how fast it computes.

Per step and rank we time four phases with perf_counter:

  data      indexing the step's local batch out of the in-memory dataset;
  compute   forward, backward and the emulated slow-down, measured *before* any
            collective (a collective equalises wall time and would hide the straggler),
            plus the optimiser's update after it;
  wait      idle time in the step's collective, waiting for slower ranks;
  comm      the rest of the collective: moving and summing bytes.

A collective's time on rank i is wait_i + comm_i. wait_i is not observable alone
without an extra barrier per step (which would cost latency and break overlap), so it
is derived at the end of the epoch from everybody's pre-collective times:
wait_i = max_j pre_j - pre_i (all ranks leave the previous step's collective at about
the same time), capped by the collective's time; comm_i = collective_i - wait_i.

`benchmark_speed` is the start-up benchmark: timed training steps on this rank at two
local batch sizes, from which allocation.SpeedModel fits t(b) = a + c * b.
"""
from __future__ import annotations

import copy
import statistics
import time

import numpy as np
import torch

PHASES = ("data", "compute", "collective", "update")


class StepTimes:
    """Per-step phase times of one rank over one epoch (seconds)."""

    def __init__(self, steps: int):
        self.table = np.zeros((len(PHASES), steps))
        self.pre = np.zeros(steps)   # compute before the collective (forward+backward+emulation)

    def record(self, step: int, data: float, pre: float, collective: float, update: float) -> None:
        self.table[:, step] = (data, pre + update, collective, update)
        self.pre[step] = pre

    def snapshot(self, steps: int) -> dict:
        """The first `steps` columns, for a checkpoint taken in the middle of an epoch."""
        return {"table": self.table[:, :steps].copy(), "pre": self.pre[:steps].copy()}

    def restore(self, snap: dict) -> None:
        k = snap["pre"].shape[0]
        self.table[:, :k] = snap["table"]
        self.pre[:k] = snap["pre"]

    def as_array(self) -> np.ndarray:
        """(5, steps): data, compute, collective, update, pre-collective compute."""
        return np.vstack([self.table, self.pre[None]])


def split_wait(pre: np.ndarray, collective: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """pre, collective: (ranks x steps) seconds. Returns (wait, comm), same shape."""
    wait = pre.max(axis=0, keepdims=True) - pre
    wait = np.clip(wait, 0.0, collective)
    return wait, collective - wait


def time_steps(model, loss_fn, x, y, steps: int, warmup: int, emulator=None) -> float:
    """Median seconds of a forward+backward step on (x, y), emulated slow-down included."""
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        model.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        if emulator is not None:
            emulator.stretch(time.perf_counter() - start)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def benchmark_speed(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, small: int, large: int,
                    steps: int = 5, warmup: int = 2, emulator=None) -> tuple[float, float]:
    """Step times (seconds) at local batches `small` and `large` on a copy of the model
    (the real model is not touched). x, y must hold at least `large` samples."""
    probe = copy.deepcopy(model)
    probe.train()
    loss_fn = torch.nn.CrossEntropyLoss()
    t_small = time_steps(probe, loss_fn, x[:small], y[:small], steps, warmup, emulator)
    t_large = time_steps(probe, loss_fn, x[:large], y[:large], steps, warmup, emulator)
    return t_small, t_large
