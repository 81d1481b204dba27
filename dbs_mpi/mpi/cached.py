"""What a communicator's ranks agreed once, kept on the communicator itself.

Some agreements hold for a communicator's whole life: where its ranks run (placement),
which transport sums their gradients. A launcher's set-up and the optimizer built after
it both need them; rather than gather them twice, the first answer is cached on the
communicator with MPI's attribute caching (MPI_Comm_set_attr), which is what it is for:
the cache goes away when the communicator is freed, a duplicate starts without it, and
no other communicator, not even one that reuses a freed one's handle, can see it.
Every rank asks with the same key at the same point, so every rank either computes
(collectively) or finds the answer, never some of each.
"""
from __future__ import annotations

from mpi4py import MPI

_KEYVAL = [None]


def cached(comm: MPI.Comm, key, compute):
    """compute() the first time `key` is asked of `comm`, its cached answer afterwards."""
    if _KEYVAL[0] is None:
        _KEYVAL[0] = MPI.Comm.Create_keyval()
    store = comm.Get_attr(_KEYVAL[0])
    if store is None:
        store = {}
        comm.Set_attr(_KEYVAL[0], store)
    if key not in store:
        store[key] = compute()
    return store[key]
