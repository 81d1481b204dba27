"""A GPU step's clock that never waits: CUDA events, read one or more steps late.

CUDA runs asynchronously, so a wall clock read when the host has launched a step's
kernels measures the launches. Waiting for the device before every reading (what
StepClock does on the CPU's terms) measures the compute, but each wait drains the
device's queue: the GPU idles while the host launches the next kernels. A plain PyTorch
loop waits at most once a step (`loss.item()`); dbs-mpi's step waited up to four times.

Here a step records CUDA events on the compute stream at its phase boundaries

    compute start (the first training forward) -> compute end (the exchange begins)
    -> collective end -> update end

and, where the loop gave its loss, an asynchronous copy of the step's global loss into
a pinned host slot, ordered before the last event. Nothing waits: a later step (usually
the next) finds the events complete (`Event.query`, which does not block) and hands the
device's own times and the loss to whoever records them. At most `depth` steps wait to
be read; past that the oldest is waited for, so memory and lag stay bounded. Before
anything reads the records (the end of an epoch, a checkpoint), `settle()` waits for
the rest.

No MPI here, and nothing that needs a GPU to be tested: the events come from `events`,
torch.cuda's by default (tests pass a fake with the same three methods).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

DEPTH = 8       # steps whose events may wait to be read before the oldest is waited for


@dataclass
class Reading:
    """One step's device times (seconds between consecutive marks) and its loss."""
    key: object                 # what the step was pushed with (the balancer's (epoch, step))
    seconds: list               # len(marks) - 1 durations
    loss: float                 # NaN where the step gave none


class _Pending:
    def __init__(self, key, marks: list, slot):
        self.key, self.marks, self.slot = key, marks, slot


class EventClock:
    """Marks on the compute stream of `device`, read late (see the module docstring).

    mark() -> an event recorded now; push(key, marks, loss) closes a step whose marks
    were taken in order (loss: a 1-element device tensor, or None); harvest(block)
    returns the Readings of the steps the device has finished, oldest first."""

    def __init__(self, device, depth: int = DEPTH, events=None):
        self.device = torch.device(device)
        self.depth = int(depth)
        self.events = events if events is not None else _CudaEvents(self.device)
        self.pending: deque[_Pending] = deque()
        # Every event and pinned slot the backlog can hold, made now: making a pinned slot
        # on the step path (cudaHostAlloc) waited for the device, as a sync would.
        self._free_events = [self.events.new() for _ in range(5 * (self.depth + 2))]
        self._free_slots = [self.events.host_slot() for _ in range(self.depth + 2)]

    def mark(self):
        event = self._free_events.pop() if self._free_events else self.events.new()
        self.events.record(event)
        return event

    def push(self, key, marks: list, loss=None) -> None:
        """A step is launched: `marks` in order (the last one is taken here, after the
        loss's copy, so that a complete last mark means the slot holds the loss)."""
        slot = None
        if loss is not None:
            slot = self._free_slots.pop() if self._free_slots else self.events.host_slot()
            slot.copy_(loss.detach().reshape(1), non_blocking=True)
        self.pending.append(_Pending(key, [*marks, self.mark()], slot))

    def harvest(self, block: bool = False) -> list[Reading]:
        """The readings of every finished step, oldest first; block: wait for all of them.
        Past `depth` unread steps, the oldest ones are waited for."""
        out = []
        while self.pending:
            oldest = self.pending[0]
            must_wait = block or len(self.pending) > self.depth
            if not must_wait and not self.events.done(oldest.marks[-1]):
                break
            if must_wait:
                self.events.wait(oldest.marks[-1])
            out.append(self._read(self.pending.popleft()))
        return out

    def _read(self, step: _Pending) -> Reading:
        marks = step.marks
        seconds = [self.events.seconds(a, b) for a, b in zip(marks, marks[1:])]
        loss = float("nan")
        if step.slot is not None:
            loss = float(step.slot[0])
            self._free_slots.append(step.slot)
        self._free_events.extend(marks)
        return Reading(step.key, seconds, loss)

    def __len__(self) -> int:
        return len(self.pending)


class _CudaEvents:
    """torch.cuda's events and pinned slots, on `device`'s current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        # torch.cuda.current_stream() costs tens of microseconds of Python, four times a
        # step; the raw handle of the current stream is one C call: the Stream object is
        # looked up again only when the loop switched streams.
        self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.handle, self.stream = None, None

    @staticmethod
    def new():
        return torch.cuda.Event(enable_timing=True)

    def record(self, event) -> None:
        handle = self.raw_stream(self.index) if self.raw_stream is not None else None
        if handle is None or handle != self.handle:
            self.handle, self.stream = handle, torch.cuda.current_stream(self.device)
        event.record(self.stream)

    @staticmethod
    def done(event) -> bool:
        return event.query()

    @staticmethod
    def wait(event) -> None:
        event.synchronize()

    @staticmethod
    def seconds(start, end) -> float:
        return start.elapsed_time(end) / 1e3

    @staticmethod
    def host_slot() -> torch.Tensor:
        return torch.empty(1, dtype=torch.float32, pin_memory=True)


class LateSteps:
    """A balancer's steps timed by an EventClock: each is recorded at once with the host's
    provisional times (balancer.record_step) and amended with the device's own and its
    loss once read (balancer.amend_step); the balancer settles the rest before it reads
    its records. DistributedOptimizer's clock and the DDP hook's use it alike."""

    def __init__(self, balancer, device, clock: EventClock | None = None):
        self.balancer = balancer
        self.clock = clock if clock is not None else EventClock(device)
        balancer.settle_with(self.settle)

    def mark(self):
        return self.clock.mark()

    def push(self, marks: list, loss=None) -> None:
        """The step about to be recorded (the balancer's open step), its marks and loss."""
        self.clock.push((self.balancer.open_epoch, self.balancer.step), marks, loss)

    def amend(self, readings=None) -> int:
        """Amend the steps read now (or `readings`); returns how many."""
        readings = self.clock.harvest() if readings is None else readings
        for reading in readings:
            epoch, step = reading.key
            compute, collective, *update = reading.seconds      # the DDP hook has no update phase
            self.balancer.amend_step(epoch, step, compute, collective, update[0] if update else 0.0, reading.loss)
        return len(readings)

    def settle(self) -> int:
        """Wait for every step still to be read and amend it."""
        return self.amend(self.clock.harvest(block=True))

    def close(self) -> None:
        self.settle()
        self.balancer.settle_with(self.settle, remove=True)
