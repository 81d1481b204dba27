"""Checkpoints and stop requests: lose nothing when a job is stopped or crashes.

A checkpoint is one file that rank 0 writes for all ranks: a dict of what every
component's state_dict() gave (model, optimizer, balancer, sampler, parameter server,
...) plus `per_rank`, the list of every rank's own part (RNG states, emulator, partial
step times). It holds only tensors, numpy arrays (stored as tensors), and plain types
(dict, list, tuple, str, int, float, bool, None): `save` refuses anything else, and `load`
reads with torch.load(weights_only=True), so loading a checkpoint never runs code.
Only this module reads and writes checkpoint files.

Writing is atomic: a temporary file in the same folder, fsync, then rename, so a crash
while writing leaves the previous checkpoint intact.

Stop requests: SIGUSR1 (what a job script asks the scheduler to send before a time
limit: Slurm's `--signal=B:USR1@120`) and SIGTERM (what `scancel`, `qdel` and a
preemption send) set a flag. The ranks agree on it at every step boundary, so all ranks
stop after the same step, write the checkpoint and exit with EXIT_STOPPED. The flag
rides the step's own collective where a DistributedOptimizer over the same
communicator runs the step (two slots of its tail: `flags`, `carried`); elsewhere (a
DDP loop, a loop of one's own) a one-integer non-blocking allreduce that overlaps the
step agrees on it. The result file then says
`interrupted` (SIGUSR1: to be continued) or `cancelled` (SIGTERM from any rank: a
user's cancel; resumable by hand, never requeued by the job scripts).
"""
from __future__ import annotations

import io
import os
import signal
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from ..mpi import startup
from ..mpi.collectives import allgather_object
from ..mpi.waits import wait
from ..options import UserError

EXIT_STOPPED = 3          # exit status after a stop request: checkpoint written, resume with --resume
FORMAT_VERSION = 2        # 2: weights_only (tensors and plain types); 1 (pickled objects) is not read any more
PLAIN = (str, int, float, bool, bytes, type(None), torch.Tensor)


class Stopped(Exception):
    """Raised on every rank after a stop request was checkpointed (train() exits with
    EXIT_STOPPED); `signum` is the agreed signal (SIGTERM: cancelled)."""

    def __init__(self, signum: int = 0):
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def cancelled(self) -> bool:
        return self.signum == signal.SIGTERM


def to_safe(obj, where: str = "state"):
    """obj with numpy arrays as tensors and numpy scalars as Python numbers; TypeError
    (naming where it was) for anything that torch.load(weights_only=True) would refuse."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"{where}: cannot store a numpy array of dtype {obj.dtype}")
        return torch.from_numpy(np.array(obj, copy=True))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, PLAIN):
        return obj
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: dictionary key {key!r} is not a str or int")
            out[key] = to_safe(value, f"{where}[{key!r}]")
        if hasattr(obj, "_metadata"):     # a module's state_dict keeps its version metadata
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)):
        items = [to_safe(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise TypeError(f"{where}: cannot store a {type(obj).__name__} (a checkpoint holds only tensors, arrays and "
                    f"plain types: give the object's state_dict())")


def save(comm, path, common: dict, per_rank: dict | None = None, timeout: float = 600.0) -> None:
    """Collective: rank 0 writes {**common, per_rank: [every rank's dict]} to path,
    atomically. `common` matters on rank 0 only (what every rank holds alike)."""
    common = to_safe(common)                 # on every rank: a bad object fails everywhere alike
    gathered = allgather_object(comm, to_safe(per_rank or {}, "per_rank"), timeout, "gathering checkpoint parts")
    if comm.Get_rank() != 0:
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    buffer = io.BytesIO()
    torch.save({"format": FORMAT_VERSION, **common, "per_rank": gathered}, buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(buffer.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path) -> dict:
    """Read a checkpoint without running any code (weights_only); a missing, truncated or
    foreign file raises UserError naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"resume: no checkpoint {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for damaged or foreign files
        raise UserError(f"resume: {path} is not a readable checkpoint (truncated, corrupt or not written by "
                        f"dbs-mpi {FORMAT_VERSION}: {type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise UserError(f"resume: {path} is not a dbs-mpi checkpoint of format {FORMAT_VERSION}")
    return state


def rng_state() -> dict:
    """This process's torch random state: the CPU generator, and the current GPU's where
    the rank computes on one (dropout on a GPU draws from it)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


_ACTIVE = [0]       # StopRequests entered and not yet left in this process


def _shield_forked_child() -> None:
    """In a process forked while a StopRequest is active (a DataLoader worker): block
    SIGTERM and SIGUSR1. mpirun and schedulers send them to every process of the job, and
    torch's workers die of SIGTERM, which would kill the rank (its DataLoader raises)
    before it could agree on the stop and checkpoint. The rank shuts its workers down as
    usual afterwards (and a worker whose rank is gone exits by itself)."""
    if _ACTIVE[0]:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})


os.register_at_fork(after_in_child=_shield_forked_child)

EXIT_GRACE = 2.0    # seconds a child that blocks SIGTERM has to exit by itself before it is killed


def _blocks_sigterm(pid: int) -> bool | None:
    """Whether process pid blocks SIGTERM (Linux: its /proc status), None if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigBlk:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError):
        pass
    return None


def _end_shielded_children() -> None:
    """At exit, before multiprocessing's own exit hook: end the daemonic children that
    block SIGTERM (DataLoader workers forked under a StopRequest). That hook terminates
    daemonic children with SIGTERM and then joins them without a bound, and torch leaves
    persistent workers to it at exit (it shuts them down itself only with pin_memory), so
    a shielded worker would keep the rank alive for ever. Such a child gets SIGKILL, the
    terminate it cannot receive, and SIGCHLD its default action first: torch's handler
    would report the killed worker as a failure. Where /proc cannot tell, a daemonic child
    gets SIGTERM and, EXIT_GRACE seconds later, SIGKILL."""
    import multiprocessing
    import time

    children = [c for c in multiprocessing.active_children() if c.daemon]
    shielded = {c.pid: _blocks_sigterm(c.pid) for c in children}
    if not any(b is not False for b in shielded.values()):
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        if shielded[child.pid] is None:
            child.terminate()
    deadline = time.monotonic() + EXIT_GRACE
    for child in children:
        if shielded[child.pid] is None:
            child.join(max(0.0, deadline - time.monotonic()))
        if shielded[child.pid] is not False and child.is_alive():
            child.kill()
            child.join(EXIT_GRACE)


def _register_exit_hook() -> None:
    """Registered once, after multiprocessing's exit hook, so that it runs first (atexit
    runs in reverse order of registration)."""
    import atexit
    import multiprocessing.util  # noqa: F401 (registers its hook now, if it has not yet)

    if not _EXIT_HOOK:
        atexit.register(_end_shielded_children)
        _EXIT_HOOK.append(True)


_EXIT_HOOK: list = []


class StopRequest:
    """Turns SIGTERM / SIGUSR1 into a flag that all ranks agree on at step boundaries.

        with StopRequest(comm) as stop:
            for x, y in loader:
                ...                              # the step
                if stop.agreed():                # collective, the same answer on every rank
                    save the checkpoint; raise SystemExit(EXIT_STOPPED)

    While it is active, processes forked by this rank (DataLoader workers) ignore both
    signals, so that only the rank decides when to stop."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, comm, timeout: float = 600.0):
        self.comm = comm
        self.timeout = timeout
        self.requested = 0          # the signal number received on this rank, 0 if none
        self._buffer = np.zeros(1, dtype=np.int64)
        self._request = None
        self._previous = {}
        self._rides = False         # a step's collective has carried the flag (start() posts nothing then)
        self._carried = None        # the agreed flag a step carried since the last agreed(), if any

    def __enter__(self):
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)
        self.requested = self.requested or startup.EARLY_STOP[0]     # one that came during the start-up
        _register_exit_hook()
        _ACTIVE[0] += 1
        _ENTERED.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE[0] -= 1
        if self in _ENTERED:
            _ENTERED.remove(self)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        self.requested = signum

    # The synchronous loop agrees on the flag with start()/agreed() at every step; the
    # parameter server reads `requested` directly (workers send it with their gradients).

    def start(self) -> None:
        """Begin the step's agreement (non-blocking; every rank calls it at the same step).
        Nothing to begin where the step's own collective carries the flag."""
        if self._rides:
            return
        self._buffer[0] = self.requested
        if self.comm.Get_size() > 1:
            self._request = self.comm.Iallreduce(MPI.IN_PLACE, self._buffer, op=MPI.MAX)

    def agreed(self) -> int:
        """Finish the agreement: the signal number if any rank was asked to stop, else 0.
        Collective: every rank calls it at the same step and gets the same answer. Where
        the step's collective carried the flag, that is the answer (with the one start()
        posted before the first such step, if any); else the agreement is begun now if
        start() did not."""
        carried, self._carried = self._carried, None
        if carried is None:                 # no step carried it since the last agreement: agree on it here
            self._rides = False
            if self._request is None:
                self.start()
        if self._request is not None:
            wait(self._request, self.timeout, "stop-request agreement")
            self._request = None
            return max(carried or 0, int(self._buffer[0]))
        return int(self._buffer[0]) if carried is None else carried     # one rank: start() wrote the flag

    # What a step's collective carries: two slots, summed over the ranks (a sum can say
    # whether any rank was asked to stop and by which signal; SIGTERM wins, as with MAX).
    FLAGS = 2

    def flags(self) -> list[float]:
        """This rank's slots: [SIGTERM received, SIGUSR1 received]."""
        return [float(self.requested == signal.SIGTERM), float(self.requested == signal.SIGUSR1)]

    def carried(self, sums) -> None:
        """The step's collective summed every rank's flags(): the agreed signal."""
        self._rides = True
        self._carried = max(self._carried or 0, int(signal.SIGTERM) if sums[0] > 0 else
                            int(signal.SIGUSR1) if sums[1] > 0 else 0)


_ENTERED: list = []      # StopRequests entered and not yet left, innermost last


def riding(comm) -> StopRequest | None:
    """The innermost active StopRequest over `comm` (the same communicator), whose flag a
    step's collective over comm can carry; None if there is none."""
    for request in reversed(_ENTERED):
        if request.comm == comm:
            return request
    return None
