"""Bounded start-up: a watchdog process ends a rank whose launch stalls.

Once a run is set up, every wait of dbs-mpi is a bounded collective (waits.py). Before
that, a rank runs code that no deadline inside the process can interrupt: Python
imports from a shared file system that hangs, and MPI_Init, which waits for every rank
of the job while holding the interpreter's lock (no Python thread runs meanwhile). A
rank that stops during them would hold every other rank in MPI_Init forever.

`arm(argv)`, the first thing `dbs-mpi` does, forks a small child process before MPI or
torch is loaded (forking then is safe). The rank tells it through a pipe which phase it
is in (`phase(name)`); the child needs nothing from the rank but those lines. If one
phase lasts longer than the start-up limit, the child writes one line naming the rank
(from the launcher's environment), its host and the phase, and kills the rank with
SIGKILL: the launcher (mpirun, srun) then ends the job on every node. `done()` (the
first training step is near) lets the child go; so does the rank's exit (the pipe
closes).

Phases after MPI has started (`phase(name, backstop=True)`) are bounded inside the
process too: their collectives time out after the same limit, and the supervisor
(supervisor.py) records the failure in the result file and names the ranks that did
not arrive. The child then waits BACKSTOP_GRACE longer, so that it only acts when the
whole process is stuck (a C call that holds the lock, a job of one rank).

The limits: a launch phase (MPI_Init, imports) may last `--startup-timeout`, else
`--comm-timeout`, from the command line or the TOML file of `--config` (read before
anything heavy is imported), else 600 s; once the configuration is parsed, its own
values (set_limits). The waits before the configuration is known time out after the
same limit.

A training script of its own (the library API) may call `arm()` before it imports
mpi4py; DistributedOptimizer's first step ends the start-up (`done()`).

Fault injection for the tests: DBS_MPI_STALL_AT="RANK:PHASE" makes rank RANK stop itself
(SIGSTOP) when it enters the phase whose key is PHASE, as a hung node would.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

from ..options import flat_toml

DEFAULT_LIMIT = 600.0
BACKSTOP_GRACE = 5.0          # seconds the child waits beyond the limit where the rank bounds itself
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "PMI_ID")

PHASES = {   # key: what the line says the rank was doing
    "mpi": "starting MPI (MPI_Init waits for every rank of the job)",
    "imports": "importing dbs_mpi",
    "init": "opening the failure channel (the first collectives)",
    "config": "reading the configuration",
    "torch": "importing torch and placing the ranks",
    "data": "loading the data and building the model",
    "devices": "choosing devices and the gradient exchange",
    "results": "opening the result file",
    "calibration": "the start-up calibration",
    "restore": "restoring the checkpoint",
}

_pipe: int | None = None       # write end, while a watchdog child runs
_limit = DEFAULT_LIMIT         # a launch phase's limit (and the start-up waits' timeout)
_backstop = DEFAULT_LIMIT      # the bound of a phase whose waits time out inside the process
_phase: str | None = None      # the start-up phase this rank is in (None: started, or never tracked)


def launch_rank() -> str:
    """This rank's number as the launcher set it (before MPI is initialised), or '?'."""
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return os.environ[name]
    return "?"


def limit_from_argv(argv) -> float:
    """The start-up limit given on the command line or in its --config file (0: none given)."""
    given = _option_values(argv)
    path = given.get("config")
    if path:
        given = {**_toml_timeouts(path), **given}
    for key in ("startup_timeout", "comm_timeout"):
        try:
            value = float(given.get(key, 0) or 0)
        except ValueError:
            continue                 # the configuration's parser names the mistake later
        if value > 0:
            return value
    return 0.0


def _option_values(argv) -> dict:
    values, args = {}, list(argv)
    for i, arg in enumerate(args):
        for option in ("--startup-timeout", "--comm-timeout", "--config"):
            if arg == option and i + 1 < len(args):
                values[option[2:].replace("-", "_")] = args[i + 1]
            elif arg.startswith(option + "="):
                values[option[2:].replace("-", "_")] = arg.split("=", 1)[1]
    return values


def _toml_timeouts(path: str) -> dict:
    try:
        import tomllib
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, ValueError, ImportError):
        return {}                    # the configuration's parser names the mistake later
    flat = flat_toml(data)           # (as the configuration's parser reads it)
    return {k: flat[k] for k in ("startup_timeout", "comm_timeout") if k in flat}


def arm(argv=None, limit: float | None = None) -> None:
    """Fork the watchdog child (once per process; before MPI and torch are loaded). The
    limit: `limit`, else the one `argv` gives (default: this command line's), else
    DEFAULT_LIMIT. A training script may call it first thing; DistributedOptimizer's
    first step calls done()."""
    global _pipe, _limit, _backstop
    if _pipe is not None:
        return
    argv = sys.argv[1:] if argv is None else argv
    _limit = _backstop = limit or limit_from_argv(argv) or DEFAULT_LIMIT
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:                                  # the child: never returns
        for low, high in ((0, 2), (3, read_end), (read_end + 1, os.sysconf("SC_OPEN_MAX"))):
            os.closerange(low, high)              # only the pipe and stderr (not the launcher's sockets)
        _watch(read_end, parent, _limit)
    os.close(read_end)
    _pipe = write_end


def limit() -> float:
    """The start-up limit, seconds (the waits of the start-up use it as their timeout)."""
    return _limit


def set_limits(startup_timeout: float, comm_timeout: float) -> None:
    """The parsed configuration's limits: a launch phase gets startup_timeout (0: the
    communication timeout); a phase whose collectives time out after comm_timeout gets
    the longer of the two, plus BACKSTOP_GRACE."""
    global _limit, _backstop
    _limit = startup_timeout or comm_timeout
    _backstop = max(_limit, comm_timeout)


def phase(key: str, backstop: bool = False) -> None:
    """This rank enters start-up phase `key` (one of PHASES): its clock starts again.
    backstop: the phase's waits are bounded inside the process (after MPI has started)."""
    global _phase
    _phase = key
    seconds = _backstop + BACKSTOP_GRACE if backstop else _limit
    _send(f"phase\t{key}\t{seconds}")
    _stall_if_asked(key)


def during() -> str:
    """' (start-up: <phase>)' while this rank is starting up, else '': for failure lines."""
    return f" (start-up: {PHASES.get(_phase, _phase)})" if _phase else ""


def done() -> None:
    """The start-up is over: the child exits."""
    global _pipe, _phase
    _phase = None
    if _pipe is not None:
        _send("done")
        os.close(_pipe)
        _pipe = None


def _send(line: str) -> None:
    if _pipe is None:
        return
    try:
        os.write(_pipe, (line + "\n").encode())
    except OSError:                   # the child is gone (a signal to the process group)
        pass


EARLY_STOP = [0]        # SIGUSR1 received during the start-up (keep_stop_requests): a stop at the first step


def keep_stop_requests() -> None:
    """From now on, SIGUSR1 (a scheduler's warning before a time limit) is kept instead of
    killing the rank (its default action): checkpoint.StopRequest takes it over when the
    training begins and stops at the first step. SIGTERM still ends a rank in start-up."""
    def keep(signum, frame):
        EARLY_STOP[0] = signum
    signal.signal(signal.SIGUSR1, keep)


def _stall_if_asked(key: str) -> None:
    spec = os.environ.get("DBS_MPI_STALL_AT", "")
    if spec and spec == f"{launch_rank()}:{key}":
        os.write(2, f"dbs-mpi: rank {launch_rank()} stops itself in {key} (DBS_MPI_STALL_AT) at {time.time():.3f}\n"
                 .encode())
        os.kill(os.getpid(), signal.SIGSTOP)


def _watch(fd: int, parent: int, limit: float) -> None:
    """The child's loop: a deadline per phase; past it, one line and SIGKILL to the rank."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)        # stop requests are the rank's to handle
    key, seconds, started, buffer = "mpi", limit, time.monotonic(), b""
    try:
        while True:
            left = started + seconds - time.monotonic()
            if left <= 0:
                _end(parent, key, seconds)
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:                     # the rank exited
                os._exit(0)
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                parts = line.decode().split("\t")
                if parts[0] == "done":
                    os._exit(0)
                if parts[0] == "phase":
                    key, seconds, started = parts[1], float(parts[2]), time.monotonic()
    finally:
        os._exit(0)


def _end(parent: int, key: str, limit: float) -> None:
    what = PHASES.get(key, key)
    message = (f"dbs-mpi: rank {launch_rank()} ({socket.gethostname()}, pid {parent}): start-up stalled: "
               f"{limit:g} s in {what} (--startup-timeout); ending the job\n")
    try:
        os.write(sys.stderr.fileno(), message.encode())
    except (OSError, ValueError):
        pass
    try:
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os._exit(0)
