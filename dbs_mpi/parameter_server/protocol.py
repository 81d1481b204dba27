"""The parameter server's messages, and the parameters and gradients that live in them.

Messages (on a duplicate of comm, so that the tags cannot meet any other traffic).
Every message is one flat float32 buffer sent with the uppercase calls (no pickling):
HEADER float64 slots first (2*HEADER float32 words), then the P parameters or
gradients (absent in a stop message).
  TAG_WORK  server -> worker: [command, version, epoch, start, count, held] + weights.
            command WORK: compute on these weights, version = their timestamp; STOP:
            header only, the worker leaves. held = seconds the server kept the worker's
            last gradient before this reply (the worker's wait time).
  TAG_GRAD  worker -> server: [version, count, loss, compute seconds] + gradient.
The protocol is strictly request-reply per worker: the server sends WORK, the worker
answers with exactly one GRAD, the server answers that with WORK or STOP. So a worker
has at most one message in flight each way, and the server posts one receive per
worker exactly when it sends that worker WORK (its own buffer, so transfers of
several workers overlap); workers post the receive for the reply before pushing.
Shutdown: once no work is left (budget or time), every push is answered with STOP
(after the server applied it); the server leaves when every worker has had its STOP.
A group that can no longer fill (nobody is computing) is applied as it is. Every
message sent is received, so nothing is left unmatched (checked at the end: no
receive or send pending, and no stray message on the communicator after a barrier).

Waiting: the server polls its receives with MPI_Test (Testsome) and sleeps between
polls (20 to 100 us), the workers wait with waits.wait (the same), so with more ranks
than cores a waiting rank leaves its core to a computing one. Every wait is bounded by
cfg.comm_timeout (no progress for that long raises CommTimeout, which aborts the job).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from ..mpi.waits import CommTimeout, wait

TAG_WORK = 1    # server -> worker: header + weights (WORK), or header only (STOP)
TAG_GRAD = 2    # worker -> server: header + gradient

HEADER = 8                                                  # float64 slots at the front of every message
W_COMMAND, W_VERSION, W_EPOCH, W_START, W_COUNT, W_HELD = range(6)   # TAG_WORK header
G_VERSION, G_COUNT, G_LOSS, G_COMPUTE, G_SIGNAL = range(5)            # TAG_GRAD header
CMD_STOP, CMD_WORK = 0.0, 1.0
# Why a segment of the protocol ended (Server.run's answer; trainer.py, "Checkpoints").
END_DONE, END_CHECKPOINT, END_STOP = 1, 2, 3


class Message:
    """One flat float32 message: `header` (float64 view of the front) and `body` (a torch
    view of the P values after it). `whole` and `head` are what Send/Recv take."""

    def __init__(self, numel: int, pinned: bool = False):
        self.tensor = torch.zeros(2 * HEADER + numel, dtype=torch.float32, pin_memory=pinned)
        self.array = self.tensor.numpy()
        self.header = self.array[:2 * HEADER].view(np.float64)
        self.body = self.tensor[2 * HEADER:]
        self.whole = [self.array, MPI.FLOAT]
        self.head = [self.array[:2 * HEADER], MPI.FLOAT]


def bind_parameters(params, flat: torch.Tensor) -> None:
    """Make every parameter a view of its place in `flat` (keeping its values)."""
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.data.reshape(-1))
        p.data = flat[offset:offset + n].view_as(p)
        offset += n


def bind_gradients(params, flat: torch.Tensor) -> None:
    """Make every parameter's .grad a view of its place in `flat` (autograd accumulates there)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p)
        offset += n


@dataclass
class Assignment:
    """A piece of work the server handed out and waits for."""
    epoch: int
    start: int
    count: int
    version: int       # server version of the weights sent with it


class ServerChannels:
    """The server's end of the protocol with every worker w (rank w + 1): a buffer its
    gradient arrives in, with the receive posted for it, and a buffer for the reply, with
    that reply's send; the work each worker holds (outstanding) and since when."""

    def __init__(self, comm, workers: int, numel: int, timeout: float):
        self.comm, self.timeout = comm, timeout
        self.grads = [Message(numel) for _ in range(workers)]
        self.replies = [Message(numel) for _ in range(workers)]
        self.recvs = [MPI.REQUEST_NULL] * workers
        self.sends = [MPI.REQUEST_NULL] * workers
        self.outstanding: list[Assignment | None] = [None] * workers
        self.sent_at = [0.0] * workers               # when each worker's outstanding work was sent

    def check_late(self, now: float) -> None:
        """A worker that holds work longer than the timeout is stuck or dead, even while the
        others keep the server busy: fail (CommTimeout) naming it."""
        late = [w + 1 for w, a in enumerate(self.outstanding) if a is not None and now - self.sent_at[w] > self.timeout]
        if late:
            raise CommTimeout(f"parameter server: worker(s) {late} sent no gradient for more than "
                              f"{self.timeout:g} s after being given work: stuck or dead (raise comm_timeout "
                              f"if a step can take that long)")

    def send_stop(self, w: int, held: float) -> None:
        msg = self._reply(w, held)
        msg.header[W_COMMAND] = CMD_STOP
        self.sends[w] = self.comm.Isend(msg.head, w + 1, TAG_WORK)

    def send_work(self, w: int, held: float, work: Assignment, weights, now: float) -> None:
        self.outstanding[w], self.sent_at[w] = work, now
        version, epoch, start, count = work.version, work.epoch, work.start, work.count
        msg = self._reply(w, held)
        msg.header[W_COMMAND] = CMD_WORK
        msg.header[W_VERSION], msg.header[W_EPOCH] = version, epoch
        msg.header[W_START], msg.header[W_COUNT] = start, count
        msg.body.copy_(weights)
        # The receive for the answer is posted before the work leaves: one receive per
        # WORK message, none after a STOP.
        self.recvs[w] = self.comm.Irecv(self.grads[w].whole, w + 1, TAG_GRAD)
        self.sends[w] = self.comm.Isend(msg.whole, w + 1, TAG_WORK)

    def gradient(self, w: int) -> tuple[Assignment, int, int, float, float, int]:
        """Worker w's gradient message, checked against the work it was given (no longer
        outstanding): (that work, version, count, loss, compute seconds, stop signal); its
        body holds the gradient."""
        given, self.outstanding[w] = self.outstanding[w], None
        h = self.grads[w].header
        timestamp, count = int(h[G_VERSION]), int(h[G_COUNT])
        if given is None or timestamp != given.version or count != given.count:
            raise RuntimeError(f"parameter server: worker {w + 1} sent (version {timestamp}, {count} samples) "
                               f"but was given {given}")
        return given, timestamp, count, float(h[G_LOSS]), float(h[G_COMPUTE]), int(h[G_SIGNAL])

    def _reply(self, w: int, held: float) -> Message:
        wait(self.sends[w], self.timeout, "parameter server: previous reply")   # reply buffer free again
        msg = self.replies[w]
        msg.header[:] = 0.0
        msg.header[W_HELD] = held
        return msg

    def arrived(self) -> list[int]:
        """The workers whose gradient has arrived since the last call (their receives done)."""
        done = MPI.Request.Testsome(self.recvs) or []
        for w in done:
            self.recvs[w] = MPI.REQUEST_NULL
        return sorted(done)

    def none_posted(self) -> bool:
        return all(r == MPI.REQUEST_NULL for r in self.recvs)

    def finish(self) -> None:
        """Wait until every reply has left (bounded)."""
        for send in self.sends:
            wait(send, self.timeout, "parameter server: last reply")
