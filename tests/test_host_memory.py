"""glibc's malloc keeps a step's freed memory (mpi/host_memory.py): counted in page faults,
not timed. Each case runs in a fresh process, since malloc's settings are the process's."""
import subprocess
import sys

import pytest

from conftest import ROOT
from dbs_mpi.mpi import host_memory

pytestmark = pytest.mark.skipif(host_memory._glibc() is None, reason="the C library is not glibc")

# A step that allocates four 4 MiB blocks, writes them and frees them: glibc's own
# thresholds give the 16 MiB back to the kernel at every step (the heap's top, above twice
# the adapted mmap threshold, is trimmed), and the next step faults all of it in again.
STEPS = """
import ctypes, resource, sys
sys.path.insert(0, {root!r})
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
def step():
    blocks = [libc.malloc(4 << 20) for _ in range(4)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in reversed(blocks):
        libc.free(b)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def faults_per_step(setup: str, env=None) -> float:
    proc = subprocess.run([sys.executable, "-c", STEPS.format(root=str(ROOT), setup=setup)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.split()[-1])


def test_without_it_every_step_faults_its_memory_in_again():
    assert faults_per_step("") > 0.5 * (16 << 20) / 4096


@pytest.mark.parametrize("setup", [
    "from dbs_mpi.mpi import host_memory; assert host_memory.keep()",
    "import dbs_mpi; dbs_mpi.init(threads=1)",                                      # a user's script
    "from dbs_mpi.tools.cli import start_torch; from mpi4py import MPI; start_torch(MPI.COMM_WORLD)",  # the commands
])
def test_kept_the_steps_fault_nothing(setup):
    assert faults_per_step(setup) == 0


def test_the_users_own_malloc_settings_win():
    assert not host_memory.keep({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert not host_memory.keep({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    import os
    env = {**os.environ, "MALLOC_TOP_PAD_": "0"}
    assert faults_per_step("import dbs_mpi; dbs_mpi.init(threads=1)", env) > 0
