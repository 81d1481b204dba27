"""torch.distributed from an MPI communicator: the same ranks, in the same order.

`init_process_group(comm)` agrees a backend on every rank (nccl where every rank has a
GPU of its own and NCCL, else gloo; requests must agree), then rank 0 hosts a TCPStore
on a port the operating system picks and its address and port travel by MPI, so no
environment variable or fixed port is needed. Every step runs under agreement.collective:
a failure on one rank (a backend this build lacks, different requests, a group that
exists already with another shape) fails every rank together, in one line. The DDP
hook (ddp.py) and the torch.distributed transport (transport.py) both start from here.
"""
import datetime
import os
import socket

import torch
import torch.distributed as dist

from ..options import UserError
from .agreement import AgreedError, collective
from .collectives import allgather_object, bcast_object
from .placement import hostnames
from .devices import gpu_identity

LOOPBACK = "127.0.0.1"


def agree_backend(reports: list) -> str:
    """The job's backend from every rank's (requested backend or None, its GPU's identity
    or None for a CPU rank, whether torch has NCCL). Requests must agree; with none, nccl
    if every rank has a GPU of its own and NCCL, else gloo (CPU ranks, or ranks sharing a
    GPU, which NCCL refuses)."""
    requested = {r for r, _, _ in reports if r is not None}
    if len(requested) > 1:
        raise UserError(f"exchange/backend: the ranks asked for different torch.distributed backends "
                        f"({', '.join(sorted(requested))}); pass the same on every rank, or None to agree on one")
    if requested:
        return requested.pop()
    gpus = [g for _, g, _ in reports]
    own_gpus = all(g is not None for g in gpus) and len(set(gpus)) == len(gpus)
    return "nccl" if own_gpus and all(n for _, _, n in reports) else "gloo"


def check_backend(backend: str) -> None:
    """UserError, in one line, for a backend this torch build or machine cannot run.
    Accepts torch's forms "gloo", "nccl" and "cpu:gloo,cuda:nccl"."""
    if not dist.is_available():
        raise UserError("exchange/backend: this torch build has no torch.distributed (torch.distributed.is_available() "
                        "is False)")
    for part in backend.lower().split(","):
        name = part.split(":")[-1].strip()
        if name not in dist.Backend.backend_list or name == "undefined":
            raise UserError(f"exchange/backend: unknown torch.distributed backend {name!r} (one of "
                            f"{', '.join(b for b in dist.Backend.backend_list if b != 'undefined')})")
        if not dist.is_backend_available(name):
            raise UserError(f"exchange/backend: {name} is not available in this torch build "
                            f"(torch.distributed.is_{name}_available() is False)")
        if name == "nccl" and not torch.cuda.is_available():
            raise UserError("exchange/backend: nccl needs a GPU, and torch.cuda.is_available() is False on this "
                            "rank; use gloo on CPU ranks")


def master_address(hosts: "list[str]") -> str:
    """The address the other ranks reach rank 0 at: the loopback when every rank runs on
    rank 0's host; else $MASTER_ADDR if set, else rank 0's address on the route to the
    next host (a hostname may resolve to 127.0.1.1), else its hostname's address."""
    if all(h == hosts[0] for h in hosts):
        return LOOPBACK
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    other = next(h for h in hosts if h != hosts[0])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(other), 9))       # no packet is sent: it only picks a route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _existing_group(backend: "str | None", world: int, rank: int) -> bool:
    """True if torch.distributed is initialised already as asked (same world, same rank,
    same backend if one was named); raises if it is initialised otherwise."""
    if not dist.is_initialized():
        return False
    have_world, have_rank, have_backend = dist.get_world_size(), dist.get_rank(), str(dist.get_backend())
    if have_world != world or have_rank != rank:
        raise RuntimeError(f"torch.distributed is already initialised as rank {have_rank} of {have_world}, but "
                           f"this is rank {rank} of a communicator of {world}: call "
                           f"dbs_mpi.destroy_process_group() first, or pass the communicator it was made from")
    if backend is not None and backend.lower() != have_backend.lower():
        raise RuntimeError(f"torch.distributed is already initialised with backend {have_backend}, not {backend}: "
                           f"call dbs_mpi.destroy_process_group() first, or ask for {have_backend}")
    return True


def _serve(address: str, world: int, timeout: float):
    """Rank 0: a TCPStore on a free port (the OS picks it: no race with another job)."""
    return dist.TCPStore(address, 0, world, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)


def _join(store, address: str, port: int, backend: str, rank: int, world: int, timeout: float) -> None:
    if store is None:
        store = dist.TCPStore(address, port, world, False, datetime.timedelta(seconds=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def init_process_group(comm, backend: "str | None" = None, timeout: float = 600.0, device=None):
    """Collective: torch.distributed over the ranks of `comm` (same ranks, same order);
    returns the default process group.

    backend: "nccl" (every rank on a GPU of its own: select it first,
    dbs_mpi.select_device), "gloo", or None: agreed from every rank's `device` (default:
    the current CUDA device where CUDA is available, else the CPU): nccl if every rank
    has its own GPU, else gloo (`agree_backend`). timeout: seconds any rendezvous or
    collective may wait. Already initialised the same way: the existing group is
    returned. A failure on any rank (a backend this build lacks, different requests, a
    different existing group) raises AgreedError on every rank."""
    rank, world = comm.Get_rank(), comm.Get_size()
    existing = collective(comm, _existing_group, backend, world, rank, timeout=timeout)
    flags = allgather_object(comm, existing, timeout, "agreeing whether torch.distributed is initialised")
    if all(flags):
        return dist.group.WORLD
    if any(flags):
        raise AgreedError(f"torch.distributed is initialised on rank(s) {[r for r, f in enumerate(flags) if f]} "
                          f"but not on the others: initialise it on every rank together", 0, rank == 0, world)
    reports = allgather_object(comm, _backend_report(backend, device), timeout,
                               "agreeing on the torch.distributed backend")
    backend = collective(comm, agree_backend, reports, timeout=timeout)
    collective(comm, check_backend, backend, timeout=timeout)
    hosts = hostnames(comm, timeout)
    address = master_address(hosts) if rank == 0 else None
    store = collective(comm, lambda: _serve(address, world, timeout) if rank == 0 else None, timeout=timeout)
    address, port = bcast_object(comm, (address, store.port if rank == 0 else None), timeout=timeout,
                                 what="broadcasting the TCPStore address")
    collective(comm, _join, store, address, port, backend, rank, world, timeout, timeout=timeout)
    return dist.group.WORLD


def _backend_report(backend, device) -> tuple:
    """This rank's part of `agree_backend`."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    gpu = gpu_identity(device) if device.type == "cuda" else None
    return backend, gpu, dist.is_nccl_available()


def destroy_process_group() -> None:
    """Tear torch.distributed's default group down (nothing if it is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
