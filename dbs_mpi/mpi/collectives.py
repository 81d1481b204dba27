"""Bounded collectives: barrier, sums, gathers and broadcasts that wait sleeping.

Each is a non-blocking MPI collective completed by waits.wait: a rank that arrives early
sleeps instead of spinning, and one that waits more than `timeout` seconds for a rank
that never arrives raises CommTimeout, which ends the job. On a world of one, none talks
to MPI. Objects travel pickled (sizes first, then the bytes); tensors travel through
numpy, from any device. This module imports torch only in the functions that move
tensors.

Library code takes the communicator as an argument; only entry points pick COMM_WORLD.
"""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from .waits import POLL_SLEEP_MAX, wait

if TYPE_CHECKING:   # imported where tensors move
    import torch


def barrier(comm: MPI.Comm, timeout: float = 600.0, max_pause: float = POLL_SLEEP_MAX) -> None:
    if comm.Get_size() > 1:
        wait(comm.Ibarrier(), timeout, "barrier", max_pause)


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


def allgather_object(comm: MPI.Comm, obj, timeout: float = 600.0, what: str = "allgather") -> list:
    """Every rank's picklable `obj`, in rank order (a bounded, sleeping allgather)."""
    if comm.Get_size() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(np.array([data.size], dtype=np.int64), sizes), timeout, what)
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    wait(comm.Iallgatherv(data, [out, (sizes, offsets), MPI.BYTE]), timeout, what)
    return [pickle.loads(out[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]


def bcast_object(comm: MPI.Comm, obj, root: int = 0, timeout: float = 600.0, what: str = "broadcast"):
    """root's picklable `obj` on every rank (a bounded, sleeping broadcast)."""
    if comm.Get_size() == 1:
        return obj
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8) \
        if comm.Get_rank() == root else None
    size = np.array([data.size if data is not None else 0], dtype=np.int64)
    wait(comm.Ibcast(size, root=root), timeout, what)
    buffer = data.copy() if data is not None else np.empty(int(size[0]), dtype=np.uint8)
    wait(comm.Ibcast(buffer, root=root), timeout, what)
    return obj if comm.Get_rank() == root else pickle.loads(buffer.tobytes())


def broadcast_parameters(model: torch.nn.Module, comm: MPI.Comm, root: int = 0, timeout: float = 600.0) -> None:
    """Make every rank's parameters and buffers equal to root's (call it once, after
    building the model and before training; bounded like every wait here)."""
    broadcast_tensors([*model.parameters(), *model.buffers()], comm, root, timeout)


def broadcast_tensors(tensors, comm: MPI.Comm, root: int = 0, timeout: float = 600.0) -> float:
    """Make every rank's `tensors` (on any device) equal to root's, in place; returns the
    largest absolute difference a rank's values had from root's (0 on root)."""
    import torch
    drift = 0.0
    if comm.Get_size() == 1:
        return drift
    for tensor in tensors:
        data = tensor.data
        host = data.detach().cpu().contiguous()
        before = host.clone() if host.is_floating_point() and comm.Get_rank() != root else None
        array = host.numpy() if host.dtype != torch.bfloat16 else host.view(torch.int16).numpy()
        wait(comm.Ibcast(array, root=root), timeout, "broadcasting the parameters")
        if before is not None and before.numel():
            drift = max(drift, float((before - host).abs().max()))
        if host.data_ptr() != data.data_ptr():
            data.copy_(host)
    return drift


def broadcast_flat(tensors, comm: MPI.Comm, root: int = 0, timeout: float = 600.0) -> None:
    """Make every rank's floating-point `tensors` (small: buffers) equal to root's, in
    place, with one broadcast of their values packed in float64 (exact for float16/32)."""
    if comm.Get_size() == 1 or not tensors:
        return
    import torch
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors]).numpy()
    wait(comm.Ibcast(flat, root=root), timeout, "broadcasting the buffers")
    if comm.Get_rank() != root:
        offset = 0
        values = torch.from_numpy(flat)
        for t in tensors:
            t.data.copy_(values[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
