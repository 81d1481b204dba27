"""Shared fixtures. MPI tests use pytest-mpi (`@pytest.mark.mpi(min_size=...)`) and run
under `mpirun -n K python tests/mpi_pytest.py --with-mpi -m mpi tests` at K = 2 and 4;
the other tests run in one plain process (some launch mpirun themselves)."""
import gc
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def mpiexec() -> str:
    """The mpirun to launch with: $DBS_MPI_MPIEXEC, else the venv's, else PATH's."""
    env = os.environ.get("DBS_MPI_MPIEXEC")
    if env:
        return env
    local = VENV_BIN / "mpirun"
    return str(local) if local.exists() else (shutil.which("mpirun") or "mpirun")


def dbs_mpi_cmd():
    return [sys.executable, "-m", "dbs_mpi"]


def run_cli(args, ranks=1, timeout=120, cwd=None, env=None):
    """Run `dbs-mpi ARGS` (under mpirun if ranks > 1); returns CompletedProcess.
    A hang fails the test through the timeout instead of blocking the suite."""
    cmd = ([mpiexec(), "-n", str(ranks)] if ranks > 1 else []) + dbs_mpi_cmd() + list(args)
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env=full_env)


def pinned_calibration(tmp_path, ranks: int):
    """A result file whose start-up calibration has the last rank 50 times slower (step
    times at 2 and 20 samples), for `--calibration-from`. Tests that need a 1:0.02 rank out
    from the start plan from it: a calibration timed on CI's busy cores kept that rank at
    1 sample, since the emulation stretches a step's CPU time, not its wait for a core, so
    every rank's wait shrinks the ratio."""
    path = tmp_path / "calibration.h5"
    times = np.tile([0.002, 0.005], (ranks, 1))
    times[-1] *= 50
    with h5py.File(path, "w") as f:
        f["startup/local_batch"] = np.array([2, 20])
        f["startup/step_time"] = times
    return path


def read_released(path, deadline):
    """read_run(path) once no process holds its HDF5 lock any more (by time.time() deadline)."""
    from dbs_mpi.training.results import read_run
    while True:
        try:
            return read_run(path)
        except BlockingIOError:
            assert time.time() < deadline, f"{path} is still locked by a rank that should be gone"
            time.sleep(0.05)


def read_line(proc, text, seconds=120):
    """Read proc's stdout up to a line containing text (bounded in time)."""
    deadline = time.monotonic() + seconds
    while text not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no line with {text!r}"


def rank_pids(mpirun_pid) -> dict:
    """{rank: pid} of the Python ranks below an mpirun (mpiexec -> hydra_pmi_proxy -> python),
    read from each process's PMI_RANK (their own children, e.g. DataLoader workers, are not ranks)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,comm="], capture_output=True, text=True).stdout
    children, names = {}, {}
    for line in out.splitlines():
        pid, ppid, name = line.split(None, 2)
        children.setdefault(int(ppid), []).append(int(pid))
        names[int(pid)] = name
    found, todo = {}, [mpirun_pid]
    while todo:
        parent = todo.pop()
        for pid in children.get(parent, []):
            if names[pid].startswith("python") and not names.get(parent, "").startswith("python"):
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                ranks = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"PMI_RANK=")]
                if ranks:
                    found[int(ranks[0])] = pid
            else:
                todo.append(pid)
    return found


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp(comm, tmp_path):
    """A temporary folder that every rank of COMM_WORLD agrees on (rank 0's)."""
    return Path(comm.bcast(str(tmp_path), root=0))


def pytest_collection_finish(session):
    """The test modules and what they import (torch) are loaded: the garbage collector
    leaves their objects out of its passes from now on, as `dbs-mpi` does after its imports
    (the 2-rank MPI suite: 30.3 -> 27.8 CPU-s)."""
    gc.freeze()
