"""Profiling: what each rank spends its time on, and how fast it computes.

Per step and rank we time four phases with perf_counter (DistributedOptimizer does it,
the training loop needs no clocks of its own):

  data      from the end of the last step to the model's first forward of this one:
            waiting for the DataLoader (or indexing the in-memory dataset), copies;
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

`time_step` and `model_step` are the start-up calibration's clock: a training step at a
given local batch, timed with warm-up and a median (balancer.calibrate fits
t(b) = a + c * b from two local batch sizes).
"""
from __future__ import annotations

import copy
import statistics
import time

import numpy as np
import torch

from ..mpi.devices import in_format, memory_format, model_device, synchronize, to_device
from .sync_batchnorm import make_local

PHASES = ("data", "compute", "collective", "update")


class StepTimes:
    """Per-step phase times of one rank over one epoch (seconds), and every step's global
    mean loss (NaN where the loop did not give it)."""

    def __init__(self, steps: int):
        self.table = np.zeros((len(PHASES), steps))
        self.pre = np.zeros(steps)      # compute before the collective (forward+backward+emulation)
        self.loss = np.full(steps, np.nan)

    def record(self, step: int, data: float, pre: float, collective: float, update: float,
               loss: float = float("nan")) -> None:
        self.table[:, step] = (data, pre + update, collective, update)
        self.pre[step] = pre
        self.loss[step] = loss

    def amend(self, step: int, pre: float, collective: float, update: float, loss: float) -> None:
        """A recorded step's compute, collective, update and loss replaced by what was
        measured later (a GPU's events, event_clock.py); its data time stays."""
        self.table[1:, step] = (pre + update, collective, update)
        self.pre[step] = pre
        self.loss[step] = loss

    def snapshot(self, steps: int) -> dict:
        """The first `steps` columns, for a checkpoint taken in the middle of an epoch."""
        return {"table": self.table[:, :steps].copy(), "pre": self.pre[:steps].copy(),
                "loss": self.loss[:steps].copy()}

    def restore(self, snap: dict) -> None:
        k = np.asarray(snap["pre"]).shape[0]
        self.table[:, :k] = np.asarray(snap["table"])
        self.pre[:k] = np.asarray(snap["pre"])
        self.loss[:k] = np.asarray(snap["loss"])

    def as_array(self) -> np.ndarray:
        """(6, steps): data, compute, collective, update, pre-collective compute, loss."""
        return np.vstack([self.table, self.pre[None], self.loss[None]])


def split_wait(pre: np.ndarray, collective: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """pre, collective: (ranks x steps) seconds. Returns (wait, comm), same shape."""
    wait = pre.max(axis=0, keepdims=True) - pre
    wait = np.clip(wait, 0.0, collective)
    return wait, collective - wait


STEADY_SPREAD = 0.05  # timed steps whose range (largest less smallest) is within this share of their median: steady


def time_step(step, local_batch: int, steps: int, warmup: int, stretch=None, steady: int = 0) -> float:
    """Median seconds of `step(local_batch)` over `steps` calls after `warmup` untimed
    ones; `stretch(wall seconds, CPU seconds)` (the emulated slow-down) is applied to every
    call. steady: stop once that many timed steps or more are steady (STEADY_SPREAD: their
    median is then known within half that), else time all `steps` (0: always all)."""
    times = []
    for i in range(warmup + steps):
        start, cpu = time.perf_counter(), time.process_time()
        step(local_batch)
        if stretch is not None:
            stretch(time.perf_counter() - start, time.process_time() - cpu)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            if 0 < steady <= len(times) and max(times) - min(times) <= STEADY_SPREAD * statistics.median(times):
                break
    return statistics.median(times)


def model_step(model: torch.nn.Module, loss_fn, inputs, targets):
    """A calibration step for `model`: forward and backward of loss_fn on the first b
    samples of (inputs, targets), on a copy of the model (the real one is not touched),
    on the model's device, which is synchronised at the end of every step; the inputs in
    the model's memory order (channels-last as training gives them), and under the
    caller's autocast, if any (train.py calibrates under its --amp)."""
    probe = make_local(copy.deepcopy(model))    # each rank times itself: no SyncBatchNorm collectives
    probe.train()
    device = model_device(probe)
    inputs, targets = to_device((inputs, targets), device, non_blocking=False)
    inputs = in_format(inputs, memory_format(probe))

    def step(local_batch: int) -> None:
        probe.zero_grad(set_to_none=False)
        loss_fn(probe(inputs[:local_batch]), targets[:local_batch]).backward()
        synchronize(device)                  # a GPU step is over when its kernels are, not their launches
    return step
