"""Communication: everything that talks MPI, behind a few small functions and one object.

* `wait` completes a non-blocking request without burning the CPU: it polls with
  MPI_Test and sleeps between polls (backing off from 20 us to 100 us), so a rank that
  waits for slower ranks leaves its core to them (MPICH's blocking calls busy-poll).
  It is bounded: past `timeout` seconds the job is aborted instead of hanging.
  Sleeping costs latency: MPICH progresses a non-blocking allreduce only inside
  MPI_Test, and a 250 kB allreduce needs many rounds. So the gradient exchange has two
  wait policies: "sleep" waits for everybody's arrival in a sleeping Ibarrier, then
  runs a blocking Allreduce that spins only while bytes move; "spin" calls the blocking
  Allreduce at once (lowest latency). "auto" (default) sleeps only where a node runs
  more ranks than it has cores, i.e. where a spinning rank would steal a core.
* `GradientExchange` owns one flat float32 buffer that the model's .grad tensors are
  views of (autograd accumulates straight into it: no copies), plus one slot for the
  loss. A step's exchange scales the buffer by this rank's weight and does one
  in-place sum-allreduce: the sample-weighted gradient sum_i (b_i/B) g_i and the
  global mean loss in a single collective (RESEARCH.md section 1).
* `agree` runs a set-up function on every rank and lets all ranks fail together,
  cleanly, when any rank fails (one message, exit status 2, nobody left waiting).
* `abort_on_uncaught` makes an unexpected exception on any rank end the whole job.

Library code takes the communicator as an argument; only entry points pick COMM_WORLD.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback

import numpy as np
import torch
from mpi4py import MPI

from .config import UserError

POLL_SPIN = 20e-6       # seconds of plain polling before the first sleep
POLL_SLEEP_MIN = 20e-6  # first sleep between polls, seconds
POLL_SLEEP_MAX = 1e-4   # longest sleep between polls, seconds (bounds the added latency)
WAIT_POLICIES = ("auto", "spin", "sleep")


class CommTimeout(RuntimeError):
    pass


def wait(request: MPI.Request, timeout: float = 600.0, what: str = "collective") -> None:
    """Complete `request`, sleeping between tests; CommTimeout after `timeout` seconds."""
    if request.Test():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < POLL_SPIN:
        if request.Test():
            return
    pause = POLL_SLEEP_MIN
    while not request.Test():
        if time.perf_counter() - start > timeout:
            raise CommTimeout(f"waited more than {timeout:g} s in {what}: another rank is stuck or dead "
                              f"(raise comm_timeout if a step can legitimately take that long)")
        time.sleep(pause)
        pause = min(2 * pause, POLL_SLEEP_MAX)


def barrier(comm: MPI.Comm, timeout: float = 600.0) -> None:
    if comm.Get_size() > 1:
        wait(comm.Ibarrier(), timeout, "barrier")


def allreduce_sum(comm: MPI.Comm, array: np.ndarray, timeout: float = 600.0) -> np.ndarray:
    """In-place sum-allreduce of a contiguous numpy array; returns it."""
    if comm.Get_size() > 1:
        wait(comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), timeout, "allreduce")
    return array


def allgather_array(comm: MPI.Comm, array, timeout: float = 600.0) -> np.ndarray:
    """Stack every rank's equal-length float64 array: shape (world_size, *array.shape)."""
    local = np.ascontiguousarray(array, dtype=np.float64)
    out = np.empty((comm.Get_size(), *local.shape), dtype=np.float64)
    if comm.Get_size() == 1:
        out[0] = local
    else:
        wait(comm.Iallgather(local, out), timeout, "allgather")
    return out


def broadcast_parameters(comm: MPI.Comm, module: torch.nn.Module, root: int = 0) -> None:
    """Make every rank's parameters and buffers equal to root's."""
    if comm.Get_size() == 1:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        data = tensor.data
        if data.is_contiguous() and data.dtype in (torch.float32, torch.float64, torch.int64):
            comm.Bcast(data.numpy(), root=root)
        else:
            data.copy_(comm.bcast(data, root=root))


class GradientExchange:
    """Sample-weighted gradient allreduce over one flat buffer that .grad tensors view."""

    def __init__(self, comm: MPI.Comm, params, timeout: float = 600.0, sleep_while_waiting: bool = False):
        self.comm = comm
        self.timeout = timeout
        self.sleep_while_waiting = sleep_while_waiting
        self.params = [p for p in params if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        # Flat float32 buffer: gradients first, then one slot for the weighted loss.
        self.flat = torch.zeros(self.numel + 1, dtype=torch.float32)
        self._array = self.flat.numpy()
        offset = 0
        for p in self.params:
            if p.dtype != torch.float32:
                raise TypeError("GradientExchange supports float32 parameters only")
            n = p.numel()
            p.grad = self.flat[offset:offset + n].view_as(p)
            offset += n

    def zero_grad(self) -> None:
        self.flat.zero_()

    def check_views(self) -> None:
        """Fail loudly if something replaced a .grad (e.g. zero_grad(set_to_none=True))."""
        for p in self.params:
            if p.grad is None or p.grad.data_ptr() < self.flat.data_ptr() or \
                    p.grad.data_ptr() >= self.flat.data_ptr() + 4 * self.numel:
                raise RuntimeError("a parameter's .grad no longer views the exchange buffer; "
                                   "use exchange.zero_grad() instead of optimizer.zero_grad()")

    def allreduce(self, weight: float, loss_share: float) -> float:
        """flat <- sum over ranks of weight_r * grad_r; returns sum_r loss_share_r.

        weight is b_i/B for sample-weighted aggregation (1/n for plain averaging);
        loss_share is loss_i * b_i/B, so the returned value is the global mean loss."""
        if weight != 1.0:
            self.flat[:self.numel].mul_(weight)
        self.flat[self.numel] = loss_share
        if self.comm.Get_size() > 1:
            if self.sleep_while_waiting:
                wait(self.comm.Ibarrier(), self.timeout, "gradient allreduce (waiting for the other ranks)")
            self.comm.Allreduce(MPI.IN_PLACE, self._array, op=MPI.SUM)
        return float(self.flat[self.numel])


# --- failing together ----------------------------------------------------------

def _error_line(exc: BaseException) -> str:
    return f"dbs-mpi: error: {exc}"


def agree(comm: MPI.Comm, fn, *args, **kwargs):
    """Run fn on every rank; if it raises on any rank, every rank raises SystemExit(2),
    after the lowest failing rank printed one line (a UserError) or its traceback.

    Only for set-up phases in which every rank calls `agree` the same number of times."""
    try:
        result, failure = fn(*args, **kwargs), None
    except UserError as exc:
        result, failure = None, (_error_line(exc), None)
    except Exception as exc:  # an unexpected failure: keep its traceback
        result, failure = None, (_error_line(f"{type(exc).__name__}: {exc}"), traceback.format_exc())
    failures = comm.allgather(failure) if comm.Get_size() > 1 else [failure]
    for rank, f in enumerate(failures):
        if f is not None:
            if rank == comm.Get_rank():
                if f[1]:
                    sys.stderr.write(f[1])
                where = f" (rank {rank} of {comm.Get_size()})" if comm.Get_size() > 1 else ""
                sys.stderr.write(f[0] + where + "\n")
                sys.stderr.flush()
            raise SystemExit(2)
    return result


def abort_on_uncaught(comm: MPI.Comm, cleanup=None) -> None:
    """An uncaught exception on this rank prints its traceback, runs `cleanup` (e.g. mark
    the result file failed) and aborts the whole job, so no rank waits forever."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, (SystemExit, KeyboardInterrupt)) and comm.Get_size() == 1:
            return previous(kind, value, tb)
        try:
            if isinstance(value, UserError):
                sys.stderr.write(_error_line(value) + f" (rank {comm.Get_rank()})\n")
            else:
                sys.stderr.write(f"dbs-mpi: rank {comm.Get_rank()} of {comm.Get_size()} failed:\n")
                traceback.print_exception(kind, value, tb)
            sys.stderr.flush()
            if cleanup is not None:
                cleanup()
        finally:
            if comm.Get_size() > 1:
                comm.Abort(1)
            else:
                os._exit(1)

    sys.excepthook = hook


# --- environment ---------------------------------------------------------------

def local_size(comm: MPI.Comm) -> int:
    """Number of ranks of comm on this node."""
    if comm.Get_size() == 1:
        return 1
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def oversubscribed(hosts: list[str]) -> bool:
    """True if some node runs more ranks than this node has cores (hosts: one per rank)."""
    return any(hosts.count(h) > available_cores() for h in set(hosts))


def sleep_while_waiting(policy: str, hosts: list[str]) -> bool:
    return policy == "sleep" or (policy == "auto" and oversubscribed(hosts))


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def hostnames(comm: MPI.Comm) -> list[str]:
    return comm.allgather(socket.gethostname())


def mpi_library() -> str:
    return MPI.Get_library_version().strip().splitlines()[0].strip()
