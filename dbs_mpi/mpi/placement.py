"""Placement: where each rank runs (its host, the cores it may use) and the threads it gets.

`placement` gathers every rank's host and cores; from it follow each node's cores
(`node_cores`, the union of its ranks' affinity sets), whether a node runs more ranks
than it has cores (`oversubscribed`: there a spinning rank steals a core, so the "auto"
wait policy sleeps, `sleep_while_waiting`), and each rank's share of torch threads
(`threads_per_rank`, no more than OMP_THREAD_LIMIT). Also the host names and the MPI
library that a result file records. torch is imported only to set its threads.
"""
from __future__ import annotations

import os
import socket

from mpi4py import MPI

from ..about import AFFINITY_AT_IMPORT
from .cached import cached
from .collectives import allgather_object


def placement(comm: MPI.Comm, timeout: float = 600.0) -> list[tuple[str, tuple[int, ...]]]:
    """(host, the cores this rank may run on) of every rank of comm, in rank order:
    gathered once per communicator (cached.py)."""
    return cached(comm, "placement", lambda: allgather_object(
        comm, (socket.gethostname(), tuple(sorted(affinity()))), timeout, "gathering every rank's host and cores"))


def node_cores(places) -> dict[str, int]:
    """The cores each node's ranks can use together: the union of their affinity sets (a
    rank pinned to one core, as cluster launchers do, still shares the node's others)."""
    cores: dict[str, set] = {}
    for host, cpus in places:
        cores.setdefault(host, set()).update(cpus)
    return {host: len(c) for host, c in cores.items()}


def oversubscribed(places) -> bool:
    """True if some node runs more ranks than its ranks have cores together (places: one
    (host, cores) per rank, from `placement`)."""
    hosts = [host for host, _ in places]
    return any(hosts.count(h) > n for h, n in node_cores(places).items())


def sleep_while_waiting(policy: str, places) -> bool:
    return policy == "sleep" or (policy == "auto" and oversubscribed(places))


def affinity() -> set[int]:
    """The cores this process may run on: its affinity set, and the one it had when
    dbs_mpi was imported (OMP_PROC_BIND makes OpenMP pin the main thread to one of them
    when torch loads; a script that imports torch first sees only that core)."""
    try:
        return set(os.sched_getaffinity(0)) | set(AFFINITY_AT_IMPORT)
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def available_cores() -> int:
    return len(affinity())


THREADS_GIVEN = False     # init() was given threads: select_device leaves them as they are


def thread_limit() -> int | None:
    """OMP_THREAD_LIMIT from the environment (torch hangs if asked for more threads)."""
    value = os.environ.get("OMP_THREAD_LIMIT", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def set_torch_threads(threads: int) -> int:
    """torch's intra-op threads of this rank, no more than OMP_THREAD_LIMIT allows; returns them."""
    import torch
    limit = thread_limit()
    threads = min(threads, limit) if limit else threads
    torch.set_num_threads(threads)
    return threads


def threads_per_rank(comm: MPI.Comm, places=None, timeout: float = 600.0) -> int:
    """The cores of this rank's node (its ranks' together) shared out over the ranks of
    comm on the node, and no more than this rank may use itself (at least 1)."""
    places = places or placement(comm, timeout)
    host = places[comm.Get_rank()][0]
    share = node_cores(places)[host] // sum(1 for h, _ in places if h == host)
    return max(1, min(share, available_cores(), thread_limit() or share))


def hostnames(comm: MPI.Comm, timeout: float = 600.0) -> list[str]:
    """The host of every rank of comm, in rank order."""
    return allgather_object(comm, socket.gethostname(), timeout, "gathering host names")


def mpi_library() -> str:
    return MPI.Get_library_version().strip().splitlines()[0].strip()
