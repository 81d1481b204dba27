"""Run pytest on every MPI rank; rank 0 reports, the other ranks speak only on failure.

    mpirun -n 4 python tests/mpi_pytest.py --with-mpi -m mpi tests

A test that fails on some rank aborts the whole job at once, after that rank printed
its failure (the other ranks may be waiting for it in a collective, and would otherwise
wait until the Makefile's timeout). The exit status is then non-zero; when every test
passes it is the worst over all ranks. A launch whose processes this MPI library does not
see together ends at once, exit 2.
"""
import io
import os
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stdout

import pytest
from mpi4py import MPI

from dbs_mpi.mpi.collectives import allgather_object
from dbs_mpi.mpi.comm import launch_mismatch

comm = MPI.COMM_WORLD
# Another MPI library's mpirun (or srun without PMI) starts N processes that this library
# does not connect: N worlds of one, in which every "2-rank" test would pass alone. The
# check `dbs-mpi` makes at start: one line naming the library and the launcher, exit 2.
problem = launch_mismatch(os.environ, comm.Get_size(), MPI.Get_library_version().splitlines()[0].strip())
if problem:
    sys.stderr.write(f"mpi_pytest: error: {problem}\n")
    sys.exit(2)
os.environ.setdefault("PYTHONHASHSEED", "0")


class AbortOnFailure:
    """On the first failed test (or set-up, or tear-down) of this rank: print it, abort."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report):
        if report.failed and comm.Get_size() > 1:
            text = (f"\n===== rank {comm.Get_rank()} of {comm.Get_size()}: {report.nodeid} failed "
                    f"({report.when}); aborting the test job =====\n{report.longreprtext}\n")
            data = text.encode(errors="replace")
            while data:
                data = data[os.write(2, data):]
            time.sleep(0.5)                 # mpirun forwards it before the abort tears the job down
            comm.Abort(1)


plugins = [AbortOnFailure()]
# Every rank its own pytest temporary folder (rank 0's is shared through the shared_tmp
# fixture), so that the ranks do not clean up each other's.
base = allgather_object(comm, tempfile.mkdtemp(prefix="mpi-pytest-") if comm.Get_rank() == 0 else None)[0]
args = [*sys.argv[1:], f"--basetemp={base}/rank{comm.Get_rank()}"]
if comm.Get_rank() == 0:
    code = pytest.main(args, plugins=plugins)
else:
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        code = pytest.main(args, plugins=plugins)
    if code != 0:
        sys.stderr.write(f"\n===== rank {comm.Get_rank()}: pytest exit {int(code)} =====\n" + buffer.getvalue())
codes = allgather_object(comm, int(code), 600.0, "gathering pytest's exit codes")     # bounded
worst = max(codes)
if comm.Get_rank() == 0:
    shutil.rmtree(base, ignore_errors=True)
    print(f"mpi_pytest: {comm.Get_size()} ranks, pytest exit codes by rank: {codes}")
sys.exit(worst)
