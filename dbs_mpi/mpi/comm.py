"""The entry: `init` (and `start`) build the communicator a training script trains on.

`init` is what a training script calls first: the communicator (COMM_WORLD unless given
one), the fail-together hook, and torch threads per rank. This module imports torch
only there (placement.set_torch_threads): `start` (init without the threads) lets the
command line answer a mistake in its input before torch is loaded (about 1.4 s of CPU
a rank). `abort_on_uncaught`, the hook start installs, makes an unexpected exception
on any rank end the whole job (supervisor.py), and an AgreedError (agreement.py) end
every rank with status 2. A launch whose processes MPI does not see together
(`launch_mismatch`: torchrun, another library's mpirun) is refused here.

The other ideas of the MPI layer live in the modules named after them: waits.py
(bounded, non-spinning waits), collectives.py, supervisor.py (failing together),
agreement.py (set-up steps that fail on every rank) and placement.py (hosts, cores,
threads). Library code takes the communicator as an argument; only entry points pick
COMM_WORLD.
"""
from __future__ import annotations

import atexit
import os
import sys
import traceback

from mpi4py import MPI

from ..options import UserError
from . import host_memory, placement, startup
from .agreement import AgreedError, error_line
from .supervisor import SUPERVISOR, write_stderr
from .waits import CommTimeout


def abort_on_uncaught(comm: MPI.Comm, cleanup=None) -> None:
    """An uncaught exception on this rank prints its traceback, runs `cleanup` (e.g. mark
    the result file failed) and aborts the whole job, so no rank waits forever.

    An AgreedError (raised on every rank together, see agreement.collective) is a user's mistake
    that every rank knows about: the failing rank prints its one line, and every rank
    exits with status 2, without an abort."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, (SystemExit, KeyboardInterrupt)) and comm.Get_size() == 1:
            return previous(kind, value, tb)
        if isinstance(value, AgreedError):
            if value.local:
                write_stderr(value.report())
            if cleanup is not None:
                cleanup()
            sys.stderr.flush()
            os._exit(2)
        if isinstance(value, UserError):
            message = error_line(value) + f" (rank {comm.Get_rank()})\n"
        elif isinstance(value, CommTimeout):     # which wait, on which rank: the traceback adds nothing
            message = f"dbs-mpi: rank {comm.Get_rank()} of {comm.Get_size()}: {value}{startup.during()}\n"
        else:
            message = (f"dbs-mpi: rank {comm.Get_rank()} of {comm.Get_size()} failed:\n"
                       + "".join(traceback.format_exception(kind, value, tb)))
        # One write (a traceback written in pieces was seen cut after its first line by the
        # abort), then the supervisor: rank 0 records the failure, the job is aborted.
        if cleanup is not None:
            SUPERVISOR.on_failure(cleanup)
        SUPERVISOR.fail(comm, message, timed_out=isinstance(value, CommTimeout))

    sys.excepthook = hook


def init(comm: MPI.Comm | None = None, threads: int | None = None, timeout: float = 600.0) -> MPI.Comm:
    """Start dbs-mpi in a training script: returns the communicator to train on.

    comm: the ranks that train together (default MPI.COMM_WORLD: every rank mpirun
    started; a single process without mpirun is a world of one). An uncaught exception
    on any rank then ends the whole job (abort_on_uncaught), after rank 0 recorded it
    (Supervisor: its result file says failed), and each rank gets `threads` torch
    threads (default: the node's cores divided by the ranks on it), and glibc's malloc
    keeps freed memory for the next step (host_memory.keep). Collective; its waits (a
    rank that does not arrive) end the job after `timeout` seconds."""
    comm = start(comm, timeout)
    host_memory.keep()
    placement.THREADS_GIVEN = bool(threads)
    placement.set_torch_threads(threads or placement.threads_per_rank(comm, timeout=timeout))
    return comm


def start(comm: MPI.Comm | None = None, timeout: float = 600.0) -> MPI.Comm:
    """init without torch: the communicator, the fail-together hook and the supervisor.
    The command line starts so, checks its input, then sets torch's threads (init's
    last step), so that bad input is answered before torch is imported. A launch whose
    processes MPI does not see together (`launch_mismatch`) ends here: one line, exit 2."""
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm == MPI.COMM_WORLD:
        problem = launch_mismatch(os.environ, comm.Get_size(), MPI.Get_library_version().splitlines()[0].strip())
        if problem:
            write_stderr(f"dbs-mpi: error: {problem}\n")
            raise SystemExit(2)
    abort_on_uncaught(comm)
    SUPERVISOR.attach(comm, timeout)
    atexit.register(SUPERVISOR.detach)
    return comm


def launch_mismatch(environ, world_size: int, library: str = "") -> str | None:
    """What is wrong with a launch whose MPI world is `world_size` processes, from the
    launcher's variables in `environ` (None: nothing). dbs-mpi's ranks are MPI processes:
    a launcher that starts N processes MPI does not connect (torchrun, srun without a PMI
    plug-in, another MPI library's mpirun) gives N worlds of one, N independent runs. A
    single process started on purpose sets none of these variables above 1."""
    if world_size > 1:
        return None

    def count(name: str) -> int:
        value = str(environ.get(name, "")).strip()
        return int(value) if value.isdigit() else 0

    said = max(("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"), key=count)    # MPICH/Slurm PMI, Open MPI, PMIx
    if count(said) > 1:
        return (f"an mpirun started {count(said)} processes, but the MPI library mpi4py loaded "
                f"({library or 'unknown'}) sees 1, not the launcher's {said}={count(said)}: launch with the mpirun of "
                f"that library, or point mpi4py at the launcher's (MPI4PY_LIBMPI)")
    if count("SLURM_STEP_NUM_TASKS") > 1:
        return (f"srun started {count('SLURM_STEP_NUM_TASKS')} tasks that MPI does not connect (no PMI): launch with "
                f"srun --mpi=pmi2 (or pmix), or mpirun -n {count('SLURM_STEP_NUM_TASKS')}")
    if count("WORLD_SIZE") > 1 or "TORCHELASTIC_RUN_ID" in environ and count("LOCAL_WORLD_SIZE") > 1:
        n = count("WORLD_SIZE") or count("LOCAL_WORLD_SIZE")
        return (f"started by torchrun or another launcher that is not MPI (WORLD_SIZE={n}), so each of the {n} "
                f"processes would train alone: dbs-mpi's ranks are MPI processes; launch with mpirun -n {n} (on Slurm: "
                f"srun --mpi=pmi2)")
    return None
