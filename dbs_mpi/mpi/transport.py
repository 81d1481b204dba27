"""Transports: how a gradient bucket's bytes get summed over the ranks, wherever they live.

GradientExchange (exchange.py) decides *when* a bucket is reduced and with which weight; a
transport decides *how*. One per rank, agreed by all ranks at construction (`choose`),
recorded in the result file (attribute `exchange`):

  host        MPI on host memory. On a CPU rank the gradients already live there: the
              collective reads the flat buffer itself, no copies. On a GPU rank every
              bucket is staged: when backward has filled it, a side stream (waiting on
              the compute stream) copies it into a pinned host buffer while backward
              goes on; the bucket's MPI allreduce begins once that copy is done (checked
              by the next gradient hook, at the latest before the final bucket), and the
              sums are copied back on the side stream, which the compute stream waits
              for. Works with any MPI, and in jobs that mix CPU and GPU ranks.
  cuda-aware  MPI on device memory: mpi4py takes the bucket's tensor through DLPack
              (with no stream to order against: the bucket's collective begins once an
              event after the kernels that produced it has happened), with the tensor's
              GPU current. Needs an MPI library built with CUDA support
              (devices.mpi_cuda_aware); CPU ranks of the job use host memory.
  nccl        torch.distributed's NCCL backend, initialised from the MPI communicator
              (process_group.init_process_group): every rank on a GPU of its own (NCCL refuses
              two ranks on one GPU).
  gloo        torch.distributed's gloo backend on CPU tensors: the nccl path's logic on
              any machine (tests), or a CPU job's alternative to MPI.
  local       one rank: nothing to sum and nothing to move.

`auto`: local for one rank; host on CPU ranks and in jobs that mix CPU and GPU ranks;
on an all-GPU job nccl if torch has it and no two ranks share a GPU, else cuda-aware if
the MPI library is CUDA-aware, else host.

Every transport offers the same small interface to GradientExchange:
  stage(b)       after bucket b was weighted on the compute stream: begin moving it to
                 where the collective reads it (a no-op where nothing moves)
  start(b)       a request for b's non-blocking sum (Test() / Wait()); it may begin the
                 collective later, when the staging is done, but always in bucket order
  begin_all(requests)  begin every deferred collective, in order: before any other
                 collective (the sleeping barrier), so all ranks call them in one order
  reduce(b)      the final bucket's blocking sum (everything before it has begun)
  wait(requests) complete them all; finish() puts the sums where the .grad views are
  set_tail(x, extra)     the loss slot and `extra` more slots (the balancer's telemetry) at
                 the end of the final bucket, written before its collective
  loss() / extra()       their sums, after it
  deferred       True if start() may return requests that begin later (GradientExchange
                 then begins the ready ones, in order, whenever it progresses MPI)
Sample weighting, buckets, the order of collectives and the supervisor's deadlines are
GradientExchange's, the same for all of them.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..options import EXCHANGES, UserError
from .agreement import collective
from .cached import cached
from .collectives import allgather_object
from .devices import gpu_identity, mpi_cuda_aware
from .process_group import init_process_group

GRACE = 30.0        # seconds torch.distributed waits beyond comm_timeout (see TorchDistributed)


class _Gated:
    """A transport whose bucket b may be reduced only once an event says its data is ready
    (the host copy, or the kernels that produced it); MPI on `self.views[b]`."""

    def _setup_events(self, buckets: int) -> None:
        self.ready = [None] * buckets           # bucket b's data is ready when this event has happened

    def _ready(self, b: int, block: bool) -> bool:
        event = self.ready[b]
        if event is None:
            return True
        if block:
            event.synchronize()
        elif not event.query():
            return False
        self.ready[b] = None
        return True

    def start(self, b: int):
        return _Deferred(self, b)

    def _begin(self, b: int):
        return self.comm.Iallreduce(MPI.IN_PLACE, self.views[b], op=MPI.SUM)

    def begin_all(self, requests) -> None:
        """Begin every started bucket's collective, in order (before any other collective:
        every rank must call them in the same order)."""
        for r in requests:
            if isinstance(r, _Deferred):
                r.begin(block=True)

    def reduce(self, b: int, requests) -> None:
        self.begin_all(requests)
        self._ready(b, block=True)
        self.comm.Allreduce(MPI.IN_PLACE, self.views[b], op=MPI.SUM)

    def wait(self, requests) -> None:
        wait_requests(requests)


class HostMPI(_Gated):
    """MPI on host memory; stages device (or, with stage=True, any) buffers through a
    host copy (pinned for CUDA)."""

    name = "host"

    def __init__(self, comm, flat: torch.Tensor, bounds, stage: bool | None = None, tail: int = 1):
        self.comm, self.flat, self.bounds = comm, flat, bounds
        self.loss_at = flat.numel() - tail         # the loss slot; the extra slots follow it
        self.staged = flat.device.type != "cpu" if stage is None else bool(stage)
        self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda) if self.staged else flat
        array = self.host.numpy()
        self.array, self.views = array, [array[start:stop] for start, stop in bounds]
        self.side = torch.cuda.Stream(flat.device) if flat.is_cuda else None
        self.deferred = self.side is not None      # a GPU's buckets begin once their host copy is done
        self._setup_events(len(bounds))            # CUDA: bucket b's host copy is complete

    def share_host_copy(self, other: "HostMPI") -> None:
        """Stage into `other`'s host copy (a group's transport over the same buffer: one
        pinned copy of the gradients, not one per group)."""
        if self.staged:
            self.host, self.array = other.host, other.array
            self.views = [other.array[start:stop] for start, stop in self.bounds]

    def stage(self, b: int) -> None:
        if not self.staged:
            return
        start, stop = self.bounds[b]
        if self.side is None:
            self.host[start:stop].copy_(self.flat[start:stop])
            return
        self.side.wait_stream(torch.cuda.current_stream(self.flat.device))
        with torch.cuda.stream(self.side):
            self.host[start:stop].copy_(self.flat[start:stop], non_blocking=True)
            self.ready[b] = torch.cuda.Event()
            self.ready[b].record(self.side)

    def start(self, b: int):
        if self.side is None:                      # nothing to wait for: the plain MPI request
            return self.comm.Iallreduce(MPI.IN_PLACE, self.views[b], op=MPI.SUM)
        return _Deferred(self, b)

    def begin_all(self, requests) -> None:
        if self.side is not None:
            super().begin_all(requests)

    def reduce(self, b: int, requests) -> None:
        if self.side is not None:
            return super().reduce(b, requests)
        self.comm.Allreduce(MPI.IN_PLACE, self.views[b], op=MPI.SUM)   # the CPU's path, as short as it was

    def finish(self) -> None:
        if not self.staged:
            return
        if self.side is None:
            self.flat.copy_(self.host)
            return
        with torch.cuda.stream(self.side):
            self.flat.copy_(self.host, non_blocking=True)
        torch.cuda.current_stream(self.flat.device).wait_stream(self.side)

    def set_tail(self, value: float, extra=None) -> None:
        if self.side is not None:
            self._ready(len(self.bounds) - 1, block=True)     # the final bucket's copy brought the slots too
        self.array[self.loss_at] = value
        if extra is not None:
            self.array[self.loss_at + 1:] = extra

    def wait(self, requests) -> None:
        if self.side is not None:
            return wait_requests(requests)
        if requests:
            MPI.Request.Waitall(requests)

    def loss(self) -> float:
        return float(self.array[self.loss_at])

    def extra(self):
        return self.array[self.loss_at + 1:].copy()


class CudaAwareMPI(_Gated):
    """MPI on device buffers: mpi4py takes a torch CUDA tensor through DLPack (without a
    stream to order against, so the kernels that produced a bucket are waited for first:
    an event per bucket), on the tensor's GPU as the current device (torch exports only
    those)."""

    name = "cuda-aware"

    def __init__(self, comm, flat: torch.Tensor, bounds, tail: int = 1):
        self.comm, self.flat, self.bounds = comm, flat, bounds
        self.loss_at = flat.numel() - tail
        self.views = [flat[start:stop] for start, stop in bounds]
        self.deferred = True                       # a bucket begins once its kernels are done
        self._setup_events(len(bounds))

    def stage(self, b: int) -> None:
        self.ready[b] = torch.cuda.Event()
        self.ready[b].record(torch.cuda.current_stream(self.flat.device))

    def _begin(self, b: int):
        with torch.cuda.device(self.flat.device):
            return super()._begin(b)

    def reduce(self, b: int, requests) -> None:
        with torch.cuda.device(self.flat.device):
            super().reduce(b, requests)

    def finish(self) -> None:
        pass

    def set_tail(self, value: float, extra=None) -> None:
        _write_tail(self.flat, self.loss_at, value, extra)
        self.stage(len(self.bounds) - 1)          # the final bucket's event comes after the slots' writes

    def loss(self) -> float:
        return float(self.flat[self.loss_at])

    def extra(self):     # a copy: on the CPU .numpy() is a view, which the next step's zeroing would clear
        return self.flat[self.loss_at + 1:].cpu().numpy().copy()


class Local:
    """One rank: nothing to sum, nothing to move (the weighting still applies)."""

    name = "local"
    deferred = False

    def __init__(self, flat: torch.Tensor, tail: int = 1):
        self.flat, self.loss_at = flat, flat.numel() - tail
        self.held = None          # the step's loss (as the buffer would round it) and extra slots

    def stage(self, b: int) -> None:
        pass

    def start(self, b: int):
        return _DONE

    def begin_all(self, requests) -> None:
        pass

    def reduce(self, b: int, requests) -> None:
        pass

    def wait(self, requests) -> None:
        pass

    def finish(self) -> None:
        pass

    def set_tail(self, value: float, extra=None) -> None:
        """Nothing to sum: a number and the extra slots are held as they are, not written
        into the buffer and read back (some 10 us of the step's host time); a loss on the
        device is written there, where it is read (exchange._tail_sums)."""
        if isinstance(value, torch.Tensor):
            self.held = None
            _write_tail(self.flat, self.loss_at, value, extra)
        else:
            self.held = (float(np.float32(value)), extra)

    def loss(self) -> float:
        return self.held[0] if self.held is not None else float(self.flat[self.loss_at])

    def extra(self):     # a copy: on the CPU .numpy() is a view, which the next step's zeroing would clear
        if self.held is not None:
            return np.array(self.held[1], dtype=np.float32)
        return self.flat[self.loss_at + 1:].cpu().numpy().copy()


class TorchDistributed:
    """torch.distributed (nccl on GPUs, gloo on CPUs) over the same ranks as comm."""

    deferred = False                             # every all_reduce begins when it is started

    def __init__(self, comm, flat: torch.Tensor, bounds, backend: str, timeout: float = 600.0, tail: int = 1):
        self.name, self.flat, self.bounds = backend, flat, bounds
        self.loss_at = flat.numel() - tail
        # torch's own timeout a little later than comm_timeout: the supervisor's deadline
        # ends a stuck step first, with its message naming the ranks that did not arrive
        self.group = init_process_group(comm, backend, timeout + GRACE, flat.device)
        self.views = [flat[start:stop] for start, stop in bounds]

    def stage(self, b: int) -> None:
        pass

    def start(self, b: int):
        return _Work(torch.distributed.all_reduce(self.views[b], group=self.group, async_op=True))

    def begin_all(self, requests) -> None:
        pass                                     # every bucket's all_reduce began when it was started

    def reduce(self, b: int, requests) -> None:
        torch.distributed.all_reduce(self.views[b], group=self.group)

    def wait(self, requests) -> None:
        for r in requests:
            r.Wait()

    def finish(self) -> None:
        pass

    def set_tail(self, value: float, extra=None) -> None:
        _write_tail(self.flat, self.loss_at, value, extra)

    def loss(self) -> float:
        return float(self.flat[self.loss_at])   # waits for the collectives (bounded by the supervisor's deadline)

    def extra(self):     # a copy: on the CPU .numpy() is a view, which the next step's zeroing would clear
        return self.flat[self.loss_at + 1:].cpu().numpy().copy()


def _write_tail(flat: torch.Tensor, loss_at: int, value: float, extra) -> None:
    """The loss slot and the extra slots of a buffer on any device."""
    flat[loss_at].fill_(value)
    if extra is not None:
        flat[loss_at + 1:].copy_(torch.from_numpy(extra))


class _Deferred:
    """A bucket's collective that begins once its data is ready (a copy or a kernel on
    the device): Test() begins it when it can; begin(block=True) waits for the data."""

    def __init__(self, transport, b: int):
        self.transport, self.b, self.request = transport, b, None

    def begin(self, block: bool) -> bool:
        if self.request is None:
            if not self.transport._ready(self.b, block):
                return False
            self.request = self.transport._begin(self.b)
        return True

    def Test(self) -> bool:
        return self.begin(block=False) and self.request.Test()

    def Wait(self) -> None:
        self.begin(block=True)
        self.request.Wait()


class _Done:
    """A request that is complete (Local's)."""

    def Test(self) -> bool:
        return True

    def Wait(self) -> None:
        pass


_DONE = _Done()


class _Work:
    """A torch.distributed Work with the MPI request's Test()/Wait()."""

    def __init__(self, work):
        self.work = work

    def begin(self, block: bool) -> bool:
        return True

    def Test(self) -> bool:
        return self.work.is_completed()

    def Wait(self) -> None:
        self.work.wait()


def wait_requests(requests) -> None:
    """Complete requests in order (plain MPI requests all at once)."""
    if all(isinstance(r, MPI.Request) for r in requests):
        if requests:
            MPI.Request.Waitall(requests)
        return
    for r in requests:
        r.Wait()


def choose(requested: str, gpus: list, nccl: bool, cuda_aware: list) -> str:
    """The job's exchange (the same on every rank). requested: one of EXCHANGES. gpus: per
    rank, None for a CPU rank, else the identity of its GPU ((host, UUID): two ranks on
    one GPU have the same). nccl: torch has NCCL on every GPU rank. cuda_aware: per rank,
    whether its MPI library is CUDA-aware (True, False, None: unknown). Raises UserError
    for a request the job cannot honour. One rank: "local" (nothing to sum)."""
    if requested not in EXCHANGES:
        raise UserError(f"exchange: must be one of {', '.join(EXCHANGES)}; got {requested!r}")
    on_gpu = [g is not None for g in gpus]
    shared = _shared_gpus(gpus)
    if requested == "auto":
        if len(gpus) == 1:
            return "local"
        if not all(on_gpu):
            return "host"
        if nccl and not shared:
            return "nccl"
        return "cuda-aware" if all(c is True for c in cuda_aware) else "host"
    if requested == "nccl":
        _check_nccl(on_gpu, shared, nccl)
    if requested == "cuda-aware":
        bad = [r for r, (g, c) in enumerate(zip(on_gpu, cuda_aware)) if g and c is False]
        if bad:
            raise UserError(f"exchange: cuda-aware requested, but the MPI library of rank(s) {bad} is not CUDA-aware "
                            f"(MPIX_Query_cuda_support() returns 0); use exchange = \"host\"")
    if requested == "gloo" and any(on_gpu):
        raise UserError("exchange: gloo reduces CPU tensors; GPU ranks use nccl, cuda-aware or host")
    return requested


def _shared_gpus(gpus: list) -> list[int]:
    """Ranks whose GPU another rank uses too."""
    seen = [g for g in gpus if g is not None]
    return [r for r, g in enumerate(gpus) if g is not None and seen.count(g) > 1]


def _check_nccl(on_gpu: list, shared: list, nccl: bool) -> None:
    if not all(on_gpu):
        cpu = [r for r, g in enumerate(on_gpu) if not g]
        raise UserError(f"exchange: nccl needs every rank on a GPU; rank(s) {cpu} compute on the CPU (use "
                        f"exchange = \"host\" for a job that mixes CPU and GPU ranks)")
    if shared:
        raise UserError(f"exchange: nccl takes one rank per GPU, and rank(s) {shared} share a GPU (use exchange = "
                        f"\"host\" or \"cuda-aware\" for ranks that share GPUs)")
    if not nccl:
        raise UserError("exchange: nccl is not available in this torch build "
                        "(torch.distributed.is_nccl_available() is False)")


def agree(comm, requested: str, device: torch.device, timeout: float = 600.0) -> str:
    """Collective: the exchange every rank uses (see `choose`); fails on every rank together.
    Agreed once per communicator, request and device (cached.py): a launcher that checks it
    early and the optimizer built later share one agreement."""
    return cached(comm, ("transport", requested, str(device)), lambda: _agree(comm, requested, device, timeout))


def _agree(comm, requested: str, device: torch.device, timeout: float) -> str:
    cuda = device.type == "cuda"
    report = (gpu_identity(device) if cuda else None,
              cuda and torch.distributed.is_available() and torch.distributed.is_nccl_available(),
              mpi_cuda_aware() if cuda else None)
    reports = allgather_object(comm, report, timeout, "agreeing on the gradient exchange")
    gpus, nccl, aware = (list(column) for column in zip(*reports))
    nccl_everywhere = all(n for g, n in zip(gpus, nccl) if g is not None)
    return collective(comm, choose, requested, gpus, nccl_everywhere, aware, timeout=timeout)


def make(name: str, comm, flat: torch.Tensor, bounds, timeout: float = 600.0, stage: bool | None = None,
         tail: int = 1):
    """The transport `name` (an agreed choice, not auto) for this rank's buffer, whose last
    `tail` slots are the loss slot and the extra slots."""
    if name == "local":
        return Local(flat, tail)
    if name == "host" or (name == "cuda-aware" and not flat.is_cuda):
        return HostMPI(comm, flat, bounds, stage, tail)
    if name == "cuda-aware":
        return CudaAwareMPI(comm, flat, bounds, tail)
    return TorchDistributed(comm, flat, bounds, name, timeout, tail)
