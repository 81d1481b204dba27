"""Run pytest on every MPI rank; rank 0 reports, the other ranks speak only on failure.

    mpirun -n 4 python tests/mpi_pytest.py --with-mpi -m mpi tests

The exit status is the worst over all ranks, so a test that fails on rank 3 alone
still fails the run (and rank 3's report is printed).
"""
import io
import os
import sys
from contextlib import redirect_stdout

import pytest
from mpi4py import MPI

comm = MPI.COMM_WORLD
os.environ.setdefault("PYTHONHASHSEED", "0")
if comm.Get_rank() == 0:
    code = pytest.main(sys.argv[1:])
else:
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        code = pytest.main(sys.argv[1:])
    if code != 0:
        sys.stderr.write(f"\n===== rank {comm.Get_rank()}: pytest exit {int(code)} =====\n" + buffer.getvalue())
codes = comm.allgather(int(code))
worst = max(codes)
if comm.Get_rank() == 0:
    print(f"mpi_pytest: {comm.Get_size()} ranks, pytest exit codes by rank: {codes}")
sys.exit(worst)
