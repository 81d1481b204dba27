"""Host memory a training process keeps: glibc's malloc set for steps that allocate alike.

A training step allocates and frees the same large blocks every step (activations,
their gradients, the batch). glibc's malloc gives large freed blocks back to the kernel:
blocks above its mmap threshold are unmapped when freed, and the heap's top is trimmed
above M_TRIM_THRESHOLD. The next step then faults the same pages in again, zeroed, in
the kernel. The mmap threshold also adapts to the blocks freed so far, so whether a step
pays for it depends on the batches the process ran before: on a 2-core VM, LeNet-5's
step at 512 samples took 97-100 ms with 3.4 s of a 15 s run in the kernel, or 70-72 ms
with 0.4 s, from one launch of the same command to the next (docs/performance.md).

keep() fixes both thresholds, so what a step frees stays in the process for the next
one: no step faults its memory in again, and every launch runs alike. The process keeps
its peak heap until it ends, as a training process does anyway. Blocks above
MMAP_THRESHOLD (glibc's upper limit on 64-bit, 32 MiB) are still mapped and unmapped.

Nothing changes where the C library is not glibc, or where the user set any of glibc's
own MALLOC_* variables (theirs win: MALLOC_TRIM_THRESHOLD_=0 gives memory back at once).
The command line calls keep() before torch allocates; dbs_mpi.init() calls it for a
user's training script.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1       # mallopt's parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # the largest mmap threshold glibc accepts on 64-bit (4 MiB x sizeof(long))
NO_TRIM = -1                # M_TRIM_THRESHOLD -1: never trim the heap's top (mallopt(3))

USERS_OWN = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep(environ=None) -> bool:
    """Keep freed memory in the process (see the module docstring). Returns whether
    malloc was set: False where the C library is not glibc or the user set malloc's
    variables (GLIBC_TUNABLES among them), and then nothing changed."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in USERS_OWN) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM))


def _glibc():
    """The process's C library where it is glibc (it has gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return libc
