"""A step's phase clocks, for DistributedOptimizer and the DDP hook alike.

A step is data (from the end of the step before it to the model's first training
forward), compute (from there to the end of backward, when the exchange is complete
enough to begin), the collective (until the gradient is summed) and the update. The
compute is what dbs allocates from and what emulated speeds stretch. On a GPU it ends
when the device is done, not when its kernels were launched: the clock either waits for
the device at each boundary, or marks CUDA events there whose device times replace the
step's records one or more steps later (event_clock.LateSteps).
"""
from __future__ import annotations

import time

import torch

from ..mpi import devices
from .event_clock import LateSteps


class StepClock:
    """A step's phase clocks (profiling.py): data from the end of the last step to the
    model's first training forward, compute from there to the exchange, the collective
    after it. What SyncBatchNorm's collectives spent inside forward and backward, waiting
    for the slowest rank, is communication, not this rank's compute: it moves from
    compute to the collective, so that neither dbs nor the emulation sees it.

    On a GPU the compute ends when the device is done, not when its kernels were
    launched: either the clock waits for the device at each boundary (`late` None), or,
    where nothing else on the step needs the host to wait, it marks CUDA events there
    (`late`, an event_clock.LateSteps) whose device times replace the step's records
    one or more steps later (DistributedOptimizer's `_reads_late`)."""

    def __init__(self, channels, device: torch.device, late: LateSteps | None = None):
        self.channels = channels           # the model's SyncBatchNorm channels: their seconds in collectives
        self.device, self.cuda = device, device.type == "cuda"
        self.late = late
        self.restart(time.perf_counter())

    def restart(self, now: float) -> None:
        self.last_end = now                # end of the last step: data time runs from here
        self.last_cpu = time.process_time()
        self.compute_start = None          # the model's first training forward of this step
        self.compute_cpu = None            # the process's CPU time then
        self.sync_start = 0.0              # SyncBatchNorm seconds before this step's first forward
        self.marks = []                    # late: the step's events so far

    def forward(self) -> bool:
        """At a training forward: True if it is the step's first (its compute starts now)."""
        if self.compute_start is not None:
            return False
        self.compute_start, self.compute_cpu = time.perf_counter(), time.process_time()
        self.sync_start = self.sync_seconds()
        if self.late is not None:
            self.marks.append(self.late.mark())
        return True

    def compute(self, ran: bool = True) -> tuple[float, float | None, float]:
        """At the end of the step's compute: when it began, its CPU seconds, and the
        seconds SyncBatchNorm's collectives took of it. Where no forward was seen, the
        compute is empty if the rank had no samples (ran False), and otherwise (a
        torch.compile'd model runs without the hook) began at the end of the last step,
        data loading included."""
        if self.compute_start is None:
            if not ran:
                return time.perf_counter(), None, 0.0
            return self.last_end, time.process_time() - self.last_cpu, 0.0
        return self.compute_start, time.process_time() - self.compute_cpu, self.sync_seconds() - self.sync_start

    def phases(self, began: float, pre_end: float, in_sync: float) -> tuple[float, float, float]:
        """(data, compute, collective) seconds of a step whose exchange, begun at pre_end, ended now."""
        now = time.perf_counter() if self.late is None else self.boundary()     # late: the collective's end
        return began - self.last_end, pre_end - began - in_sync, now - pre_end + in_sync

    def boundary(self) -> float:
        """A phase boundary (compute end, collective end, update end): perf_counter() once
        the device has run everything launched so far, or, reading late, an event here and
        perf_counter() at once."""
        if self.late is None:
            return self.now()
        if not self.marks:                 # no forward was seen: the compute is empty
            self.marks.append(self.late.mark())
        self.marks.append(self.late.mark())
        return time.perf_counter()

    def now(self) -> float:
        """perf_counter() once the device has run everything launched so far."""
        if self.cuda:
            devices.synchronize(self.device)
        return time.perf_counter()

    def sync_seconds(self) -> float:
        """Seconds the model's SyncBatchNorm collectives have taken so far."""
        return sum(channel.seconds for channel in self.channels)

    def record(self, balancer, update_start: float, times: tuple, loss, telemetry, update: bool = True) -> None:
        """The step's (data, compute, collective) `times`, its update and loss into the
        balancer: now, or, reading late, provisional host times now and the device's own
        once its events have been passed (LateSteps). update False: the step has no update
        phase here (the DDP hook records from the collective's callback, before the loop's
        update): update_start is then the step's end, and push() marks the collective's."""
        late = self.late
        if not update:
            end = update_start
        else:
            end = self.now() if late is None else time.perf_counter()   # late: push() marks the update's end
        if late is not None:
            late.push(self.marks, loss if isinstance(loss, torch.Tensor) else None)
        balancer.record_step(*times, end - update_start if update else 0.0, loss if late is None else float("nan"),
                             telemetry)
        self.last_end = end
        if late is not None:
            late.amend()
