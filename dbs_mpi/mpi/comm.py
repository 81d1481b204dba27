"""Communication: everything that talks MPI, behind a few small functions and one object.

* `wait` completes a non-blocking request without burning the CPU: it polls with
  MPI_Test and sleeps between polls (backing off from 20 us to 100 us, and in a long
  wait to 2% of the time waited, at most 2 ms: `next_pause`), so a rank that waits for
  slower ranks leaves its core to them (MPICH's blocking calls busy-poll).
  It is bounded: past `timeout` seconds the job is aborted instead of hanging.
  Sleeping costs latency: MPICH progresses a non-blocking allreduce only inside
  MPI_Test, and a 250 kB allreduce needs many rounds. So the gradient exchange has two
  wait policies: "sleep" waits for everybody's arrival in a sleeping Ibarrier, then
  runs a blocking Allreduce that spins only while bytes move; "spin" calls the blocking
  Allreduce at once (lowest latency). "auto" (default) sleeps only where a node runs
  more ranks than it has cores, i.e. where a spinning rank would steal a core.
* The bucketed gradient exchange (exchange.py) waits with `wait` and the supervisor,
  under the same two policies.
* `collective` runs a set-up function on every rank and lets all ranks fail together,
  cleanly, when any rank fails: every rank raises AgreedError, and the rank that failed
  holds the message (the CLI prints it once and exits with status 2; nobody is left
  waiting). `agree` is the same for the command line's set-up (SystemExit(2)).
* `abort_on_uncaught` makes an unexpected exception on any rank end the whole job.
* `init` is what a training script calls first: the communicator (COMM_WORLD unless
  given one), the fail-together hook, and torch threads per rank. This module imports
  torch only there and in the functions that move tensors: `start` (init without the
  threads) lets the command line answer a mistake in its input before torch is loaded
  (about 1.4 s of CPU a rank).
* `SUPERVISOR` bounds what cannot be bounded from inside (a blocking MPI call: the spin
  policy's Allreduce, Dup) with a watchdog thread, and lets rank 0 record a failure
  that another rank found (see Supervisor). Every wait, in every mode, ends within its
  timeout: the job is aborted, and the result file says failed if rank 0 is alive.

Library code takes the communicator as an argument; only entry points pick COMM_WORLD.
"""
from __future__ import annotations

import atexit
import math
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ..about import AFFINITY_AT_IMPORT
from ..options import UserError
from . import startup
from .cached import cached

if TYPE_CHECKING:   # imported where tensors move (see init and start)
    import torch

POLL_SPIN = 20e-6       # seconds of plain polling before the first sleep
POLL_SLEEP_MIN = 20e-6  # first sleep between polls, seconds
POLL_SLEEP_MAX = 1e-4   # longest sleep between polls in a short wait, seconds (bounds the added latency)
POLL_SLEEP_LONG = 2e-3  # ... in a long wait, which may sleep up to POLL_LONG_SHARE of the time it waited
POLL_LONG_SHARE = 0.02
ABORT_GRACE = 0.2       # seconds between printing a failure and aborting the job
NOTICE_GRACE = 3.0      # seconds a failing rank gives rank 0 to record the failure and abort the job first
COLLECT_GRACE = 1.0     # seconds a timed-out rank 0 waits for the other ranks' notices (who arrived)
WATCH_INTERVAL = 0.05   # seconds between the watchdog thread's checks
NOTICE_TAG = 7431       # tag of failure notices, on the supervisor's own communicator
QUERY_TAG = 7432        # rank 0 asks a late rank where it is (after a timeout) ...
ANSWER_TAG = 7433       # ... and its watchdog answers, in ANSWER_BYTES of UTF-8
ANSWER_BYTES = 256
QUERY_GRACE = 0.5       # seconds rank 0 waits for the late ranks' answers (within NOTICE_GRACE with COLLECT_GRACE)
WAIT_POLICIES = ("auto", "spin", "sleep")


class CommTimeout(RuntimeError):
    pass


def timeout_message(timeout: float, what: str) -> str:
    return (f"waited more than {timeout:g} s in {what}: another rank did not arrive in time (raise comm_timeout if a "
            f"step can legitimately take that long)")


def next_pause(pause: float, waited: float, max_pause: float = POLL_SLEEP_MAX) -> float:
    """The next sleep between two polls of a wait: doubling up to max_pause, and in a long
    wait up to POLL_LONG_SHARE of the time waited so far (at most POLL_SLEEP_LONG; never
    where max_pause is 0). A rank that waits seconds for a slow or a stuck one then polls
    about 500 times a second instead of 10,000: 0.09 CPU-s in a 5 s wait, against 0.65
    at 100 us (13% of a core that an oversubscribed node's computing ranks need), for at
    most 2% later."""
    if max_pause <= 0:
        return 0.0
    return min(2 * pause, max(max_pause, min(POLL_SLEEP_LONG, waited * POLL_LONG_SHARE)))


def wait(request: MPI.Request, timeout: float = 600.0, what: str = "collective",
         max_pause: float = POLL_SLEEP_MAX) -> None:
    """Complete `request`, sleeping between tests (next_pause: at most `max_pause`
    seconds in a short wait, the added latency); CommTimeout after `timeout` seconds."""
    if request.Test():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < POLL_SPIN:
        if request.Test():
            return
    pause = POLL_SLEEP_MIN
    SUPERVISOR.waiting = (what, start)
    while not request.Test():
        waited = time.perf_counter() - start
        if waited > timeout:     # (still marked as waiting: rank 0 counts it among the ranks that arrived)
            raise CommTimeout(timeout_message(timeout, what))
        time.sleep(pause)
        pause = next_pause(pause, waited, max_pause)
    SUPERVISOR.waiting = None


def _sleeping_dup(comm: MPI.Comm) -> MPI.Comm:
    """comm.Dup(), waited for with sleeps: the first collective of a job, which a rank
    reaches while the others may still be importing (or stalled); MPI_Comm_dup would spin
    a core meanwhile. Unbounded here: the caller's deadline bounds it."""
    try:
        channel, request = comm.Idup()
    except NotImplementedError:        # pragma: no cover - an MPI library older than MPI-3
        return comm.Dup()
    wait(request, math.inf, "opening the failure channel")
    return channel


def barrier(comm: MPI.Comm, timeout: float = 600.0, max_pause: float = POLL_SLEEP_MAX) -> None:
    if comm.Get_size() > 1:
        wait(comm.Ibarrier(), timeout, "barrier", max_pause)


def allreduce_sum(comm: MPI.Comm, array: np.ndarray, timeout: float = 600.0) -> np.ndarray:
    """In-place sum-allreduce of a contiguous numpy array; returns it."""
    if comm.Get_size() > 1:
        wait(comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), timeout, "allreduce")
    return array


def allgather_array(comm: MPI.Comm, array, timeout: float = 600.0) -> np.ndarray:
    """Stack every rank's equal-length float64 array: shape (world_size, *array.shape)."""
    local = np.ascontiguousarray(array, dtype=np.float64)
    out = np.empty((comm.Get_size(), *local.shape), dtype=np.float64)
    if comm.Get_size() == 1:
        out[0] = local
    else:
        wait(comm.Iallgather(local, out), timeout, "allgather")
    return out


def allgather_object(comm: MPI.Comm, obj, timeout: float = 600.0, what: str = "allgather") -> list:
    """Every rank's picklable `obj`, in rank order (a bounded, sleeping allgather)."""
    if comm.Get_size() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(np.array([data.size], dtype=np.int64), sizes), timeout, what)
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    wait(comm.Iallgatherv(data, [out, (sizes, offsets), MPI.BYTE]), timeout, what)
    return [pickle.loads(out[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]


def bcast_object(comm: MPI.Comm, obj, root: int = 0, timeout: float = 600.0, what: str = "broadcast"):
    """root's picklable `obj` on every rank (a bounded, sleeping broadcast)."""
    if comm.Get_size() == 1:
        return obj
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8) \
        if comm.Get_rank() == root else None
    size = np.array([data.size if data is not None else 0], dtype=np.int64)
    wait(comm.Ibcast(size, root=root), timeout, what)
    buffer = data.copy() if data is not None else np.empty(int(size[0]), dtype=np.uint8)
    wait(comm.Ibcast(buffer, root=root), timeout, what)
    return obj if comm.Get_rank() == root else pickle.loads(buffer.tobytes())


def broadcast_parameters(model: torch.nn.Module, comm: MPI.Comm, root: int = 0, timeout: float = 600.0) -> None:
    """Make every rank's parameters and buffers equal to root's (call it once, after
    building the model and before training; bounded like every wait here)."""
    broadcast_tensors([*model.parameters(), *model.buffers()], comm, root, timeout)


def broadcast_tensors(tensors, comm: MPI.Comm, root: int = 0, timeout: float = 600.0) -> float:
    """Make every rank's `tensors` (on any device) equal to root's, in place; returns the
    largest absolute difference a rank's values had from root's (0 on root)."""
    import torch
    drift = 0.0
    if comm.Get_size() == 1:
        return drift
    for tensor in tensors:
        data = tensor.data
        host = data.detach().cpu().contiguous()
        before = host.clone() if host.is_floating_point() and comm.Get_rank() != root else None
        array = host.numpy() if host.dtype != torch.bfloat16 else host.view(torch.int16).numpy()
        wait(comm.Ibcast(array, root=root), timeout, "broadcasting the parameters")
        if before is not None and before.numel():
            drift = max(drift, float((before - host).abs().max()))
        if host.data_ptr() != data.data_ptr():
            data.copy_(host)
    return drift


def broadcast_flat(tensors, comm: MPI.Comm, root: int = 0, timeout: float = 600.0) -> None:
    """Make every rank's floating-point `tensors` (small: buffers) equal to root's, in
    place, with one broadcast of their values packed in float64 (exact for float16/32)."""
    if comm.Get_size() == 1 or not tensors:
        return
    import torch
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors]).numpy()
    wait(comm.Ibcast(flat, root=root), timeout, "broadcasting the buffers")
    if comm.Get_rank() != root:
        offset = 0
        values = torch.from_numpy(flat)
        for t in tensors:
            t.data.copy_(values[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


# --- supervision ----------------------------------------------------------------------

class Supervisor:
    """One per process. Bounds blocking MPI calls, and lets rank 0 record a failure that
    another rank found, before the job is aborted.

    * `deadline(comm, seconds, what)`: around a blocking call (the spin policy's Allreduce,
      a Dup). A watchdog thread checks it every WATCH_INTERVAL; past it, it fails the job
      from outside the call (MPI is initialised THREAD_MULTIPLE). The call itself pays two
      attribute writes: the spin path keeps its latency. `wait` (the sleeping waits) marks
      itself too, so that rank 0 knows whether it is waiting.
    * `on_failure(fn)`: fn runs on this rank when the job fails here (rank 0: the result
      file is marked failed). `fail(comm, message)` is that: print the message in one
      write, run the callbacks, abort the job.
    * `attach(comm)` (collective; dbs_mpi.init does it) opens a channel to rank 0: a
      failing rank other than 0 sends rank 0 a notice (its rank, and whether it timed out)
      and gives it NOTICE_GRACE seconds; rank 0's watchdog sees the notice, runs rank 0's
      callbacks (the file says failed) and aborts the job. When the failure is a timeout,
      rank 0 first waits COLLECT_GRACE for the notices of the ranks that time out in the
      same wait, names the ranks that did not arrive, and asks each where it is
      (`Whereabouts`): in which wait and for how long, computing, or no answer (stopped
      or dead)."""

    def __init__(self):
        self._deadline = None            # (perf_counter time, comm, seconds, what) of the blocking call under way
        self.waiting = None              # (what, since) of the sleeping wait this rank is in, or None
        self.whereabouts = Whereabouts()
        self._callbacks: list = []
        self._channel = None             # (communicator, rank 0's receive request, its buffer [rank, timed out])
        self._thread = None
        self._lock = threading.Lock()
        self._failing = False

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="dbs-mpi watchdog", daemon=True)
            self._thread.start()

    @contextmanager
    def deadline(self, comm: MPI.Comm, seconds: float, what: str):
        self.arm(comm, seconds, what)
        try:
            yield
        finally:
            self._deadline = None

    def arm(self, comm: MPI.Comm, seconds: float, what: str) -> None:
        """Start a deadline (the hot path's form of `deadline`: `disarm()` after the call)."""
        if self._thread is None:
            self._ensure_thread()
        self._deadline = (time.perf_counter() + seconds, comm, seconds, what)

    def disarm(self) -> None:
        self._deadline = None

    def on_failure(self, fn):
        """Run fn when the job fails on this rank; returns a function that unregisters it."""
        self._callbacks.append(fn)
        return lambda: self._callbacks.remove(fn) if fn in self._callbacks else None

    def attach(self, comm: MPI.Comm, timeout: float = 600.0) -> None:
        """Collective: the failure channel of comm (rank 0 listens for notices)."""
        if comm.Get_size() == 1 or self._channel is not None:
            return
        with self.deadline(comm, timeout, "opening the failure channel (MPI_Comm_dup)"):
            channel = _sleeping_dup(comm)
        buffer = np.zeros(2, dtype=np.int64)
        self._channel = (channel, self._listen(channel, buffer) if comm.Get_rank() == 0 else None, buffer)
        if comm.Get_rank() != 0:
            self.whereabouts.listen(channel)
        self._ensure_thread()

    @staticmethod
    def _listen(channel: MPI.Comm, buffer: np.ndarray) -> MPI.Request:
        return channel.Irecv(buffer, source=MPI.ANY_SOURCE, tag=NOTICE_TAG)

    def detach(self) -> None:
        """Cancel rank 0's pending receive (before MPI is finalised)."""
        channel, self._channel = self._channel, None
        if channel is not None and channel[1] is not None:
            channel[1].Cancel()
            channel[1].Wait()
        self.whereabouts.cancel()

    def _notice(self) -> tuple[int, bool] | None:
        """Rank 0: (rank, timed out) of a failure notice that arrived, if one did."""
        channel = self._channel
        if channel is None or channel[1] is None or not channel[1].Test():
            return None
        notice = int(channel[2][0]), bool(channel[2][1])
        self._channel = (channel[0], self._listen(channel[0], channel[2]), channel[2])
        return notice

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            d = self._deadline
            if d is not None and time.perf_counter() > d[0]:
                self.fail(d[1], f"dbs-mpi: rank {d[1].Get_rank()} of {d[1].Get_size()}: "
                                f"{timeout_message(d[2], d[3])}{startup.during()}\n", timed_out=True)
            if self._channel is not None and not self._failing:
                self.whereabouts.answer(self._channel[0], self.where)
            notice = None if self._failing else self._notice()
            if notice is not None:
                self.fail(self._channel[0], f"dbs-mpi: rank 0: rank {notice[0]} failed"
                          + (" (timed out)" if notice[1] else "") + "; recording it and ending the job\n",
                          timed_out=notice[1], notified=notice[0])

    def fail(self, comm: MPI.Comm, message: str, timed_out: bool = False, notified: int | None = None) -> None:
        """End the whole job because of this rank (from any thread): print, record, abort."""
        with self._lock:
            if self._failing:              # already failing (another thread): the abort is under way
                while True:
                    time.sleep(1)
            self._failing = True
        _write_stderr(message)
        for fn in list(self._callbacks):
            try:
                fn()
            except Exception:              # recording is best effort; the abort must happen
                pass
        channel = self._channel
        if comm.Get_size() == 1 and channel is None:
            os._exit(1)
        if channel is not None and channel[0].Get_rank() != 0:
            self._send_notice(channel, timed_out)
        else:
            if channel is not None and timed_out:
                self._report_arrivals(channel, notified)
            # mpirun forwards the last line written (the message, or who did not arrive) before
            # the abort tears it down: without this pause, a loaded machine lost it now and then
            time.sleep(ABORT_GRACE)
        comm.Abort(1)

    @staticmethod
    def _send_notice(channel, timed_out: bool) -> None:
        """Tell rank 0, then give it NOTICE_GRACE to record the failure and abort the job."""
        request = channel[0].Isend(np.array([channel[0].Get_rank(), int(timed_out)], dtype=np.int64), dest=0,
                                   tag=NOTICE_TAG)
        end = time.perf_counter() + NOTICE_GRACE
        while time.perf_counter() < end:
            request.Test()                 # progress the send; rank 0's abort ends this process meanwhile
            time.sleep(0.01)

    def _report_arrivals(self, channel, notified: int | None) -> None:
        """A timeout: the ranks that time out in the same wait had arrived; the others did not."""
        arrived = {notified} if notified is not None else set()
        if self._deadline is not None or self.waiting is not None or notified is None:
            arrived.add(0)
        end = time.perf_counter() + COLLECT_GRACE
        while time.perf_counter() < end:
            notice = self._notice()
            if notice is not None:
                arrived.add(notice[0])
            time.sleep(0.01)
        missing = sorted(set(range(channel[0].Get_size())) - arrived)
        if missing:
            _write_stderr(f"dbs-mpi: rank 0: rank(s) {missing} did not arrive; rank(s) {sorted(arrived)} waited "
                          f"for them\n")
            answers = Whereabouts.ask(channel[0], missing)
            _write_stderr("".join(f"dbs-mpi: rank {r} {answers.get(r, NO_ANSWER)}\n" for r in missing))

    def where(self) -> str:
        """Where this rank is: the wait it is in and for how long, or not in one."""
        now, d, w = time.perf_counter(), self._deadline, self.waiting
        if d is not None:
            return f"is alive, waiting in {d[3]} for {now - d[0] + d[2]:.1f} s"
        if w is not None:
            return f"is alive, waiting in {w[0]} for {now - w[1]:.1f} s"
        return "is alive and not in a collective: computing, or held up outside MPI, for longer than the timeout"


NO_ANSWER = f"did not answer within {QUERY_GRACE:g} s: stopped, dead or hung (its watchdog thread could not reply)"


class Whereabouts:
    """Rank 0 asks the ranks that did not arrive in a timed-out wait where they are, and
    their watchdog threads answer (Supervisor.where): a rank waiting in another
    collective (the ranks run different code or settings), one computing for longer than
    the timeout, or one that cannot answer (stopped, dead). Every rank but 0 listens from
    `attach` on; the messages go on the supervisor's own communicator."""

    def __init__(self):
        self.query = None                # this rank's receive of rank 0's question
        self.sent = None                 # its answer, on its way

    def listen(self, channel: MPI.Comm) -> None:
        self.query = channel.Irecv(np.zeros(1, dtype=np.int64), source=0, tag=QUERY_TAG)

    def answer(self, channel: MPI.Comm, where) -> None:
        """If rank 0 asked: send it where() (the watchdog calls this every interval)."""
        if self.query is None or not self.query.Test():
            return
        self.query = None
        text = where().encode()[:ANSWER_BYTES]
        self.sent = channel.Isend(np.frombuffer(text.ljust(ANSWER_BYTES, b"\0"), dtype=np.uint8), dest=0,
                                  tag=ANSWER_TAG)

    def cancel(self) -> None:
        if self.query is not None:
            self.query.Cancel()
            self.query.Wait()
            self.query = None

    @staticmethod
    def ask(channel: MPI.Comm, ranks: list[int], grace: float = QUERY_GRACE) -> dict[int, str]:
        """Rank 0: the answers of `ranks` that came within `grace` seconds."""
        asks = [channel.Isend(np.zeros(1, dtype=np.int64), dest=r, tag=QUERY_TAG) for r in ranks]
        buffers = {r: np.zeros(ANSWER_BYTES, dtype=np.uint8) for r in ranks}
        pending = {r: channel.Irecv(buffers[r], source=r, tag=ANSWER_TAG) for r in ranks}
        answers, end = {}, time.perf_counter() + grace
        while pending and time.perf_counter() < end:
            for r in [r for r, request in pending.items() if request.Test()]:
                answers[r] = buffers[r].tobytes().rstrip(b"\0").decode(errors="replace")
                del pending[r]
            for request in asks:
                request.Test()
            time.sleep(0.01)
        return answers


SUPERVISOR = Supervisor()


# --- failing together ----------------------------------------------------------

class AgreedError(UserError):
    """Raised on every rank when a collective step (`collective`) failed on some rank.

    `origin` is the lowest rank that failed and `local` says whether it is this one: that
    rank's message (str(error)) is the one to show; `details` holds its traceback when the
    failure was not a UserError. Because every rank raises it, nobody is left waiting."""

    def __init__(self, message: str, origin: int, local: bool, world_size: int, details: str | None = None):
        super().__init__(message)
        self.origin, self.local, self.world_size, self.details = origin, local, world_size, details

    def report(self) -> str:
        """The one line (after the traceback, if any) that the failing rank prints."""
        where = f" (rank {self.origin} of {self.world_size})" if self.world_size > 1 else ""
        return (self.details or "") + _error_line(self) + where + "\n"


def _error_line(exc) -> str:
    return f"dbs-mpi: error: {exc}"


def agree_settings(comm: MPI.Comm, settings: dict, timeout: float = 600.0, who: str = "") -> None:
    """Collective (one allgather, none on one rank): every rank has the same `settings`
    (name -> value), or every rank raises AgreedError naming the first setting that
    differs, rank 0's value and the ranks that have another. Ranks that disagree on what
    they run would otherwise wait in different collectives, or train another model."""
    if comm.Get_size() == 1:
        return
    every = allgather_object(comm, settings, timeout, f"agreeing on the settings of {who or 'the run'}")
    for name, value in every[0].items():
        differ = [r for r, mine in enumerate(every) if mine.get(name) != value]
        if differ:
            others = ", ".join(sorted({repr(every[r].get(name)) for r in differ}))
            raise AgreedError(f"{who + ': ' if who else ''}{name} differs between the ranks: rank 0 has {value!r}, "
                              f"rank(s) {differ} have {others}", 0, comm.Get_rank() == 0, comm.Get_size())


def collective(comm: MPI.Comm, fn, *args, timeout: float = 600.0, **kwargs):
    """Run fn on every rank; if it raises on any rank, every rank raises AgreedError
    (bounded: one allgather of a small object).

    Only for steps that every rank of comm runs the same number of times, in the same order."""
    try:
        result, failure = fn(*args, **kwargs), None
    except UserError as exc:
        result, failure = None, (str(exc), None)
    except Exception as exc:  # an unexpected failure: keep its traceback
        result, failure = None, (f"{type(exc).__name__}: {exc}", traceback.format_exc())
    failures = allgather_object(comm, failure, timeout, "agreeing on the outcome of a set-up step")
    for rank, f in enumerate(failures):
        if f is not None:
            raise AgreedError(f[0], rank, rank == comm.Get_rank(), comm.Get_size(), f[1])
    return result


def agree(comm: MPI.Comm, fn, *args, **kwargs):
    """`collective` for the command line's set-up: the failing rank prints its line (or
    traceback) and every rank raises SystemExit(2)."""
    try:
        return collective(comm, fn, *args, **kwargs)
    except AgreedError as exc:
        if exc.local:
            _write_stderr(exc.report())
        raise SystemExit(2) from None


def _write_stderr(message: str) -> None:
    """Write message to the process's stderr in as few system calls as possible (whole,
    unbuffered). Where sys.stderr is no file (torch.distributed's exception hook swaps in
    a buffer while the hook before it, ours, runs: a rank that never returns from it would
    lose the message), the process's own stderr, file descriptor 2."""
    fd = 2
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.flush()
            fd = stream.fileno()
            break
        except (AttributeError, OSError, ValueError):  # a stream without a file descriptor
            continue
    data = message.encode(errors="replace")
    while data:
        data = data[os.write(fd, data):]


def abort_on_uncaught(comm: MPI.Comm, cleanup=None) -> None:
    """An uncaught exception on this rank prints its traceback, runs `cleanup` (e.g. mark
    the result file failed) and aborts the whole job, so no rank waits forever.

    An AgreedError (raised on every rank together, see `collective`) is a user's mistake
    that every rank knows about: the failing rank prints its one line, and every rank
    exits with status 2, without an abort."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, (SystemExit, KeyboardInterrupt)) and comm.Get_size() == 1:
            return previous(kind, value, tb)
        if isinstance(value, AgreedError):
            if value.local:
                _write_stderr(value.report())
            if cleanup is not None:
                cleanup()
            sys.stderr.flush()
            os._exit(2)
        if isinstance(value, UserError):
            message = _error_line(value) + f" (rank {comm.Get_rank()})\n"
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
    threads (default: the node's cores divided by the ranks on it). Collective; its
    waits (a rank that does not arrive) end the job after `timeout` seconds."""
    comm = start(comm, timeout)
    global THREADS_GIVEN
    THREADS_GIVEN = bool(threads)
    set_torch_threads(threads or threads_per_rank(comm, timeout=timeout))
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
            _write_stderr(f"dbs-mpi: error: {problem}\n")
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


# --- environment ---------------------------------------------------------------

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


def hostnames(comm: MPI.Comm, timeout: float = 600.0) -> list[str]:
    """The host of every rank of comm, in rank order."""
    return allgather_object(comm, socket.gethostname(), timeout, "gathering host names")


def mpi_library() -> str:
    return MPI.Get_library_version().strip().splitlines()[0].strip()
