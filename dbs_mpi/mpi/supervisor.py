"""Failing together: a rank that fails ends the whole job, and rank 0 records it first.

`SUPERVISOR` (one per process) bounds what cannot be bounded from inside (a blocking MPI
call: the spin policy's Allreduce, Dup) with a watchdog thread, and lets rank 0 record a
failure that another rank found (see Supervisor): its result file says failed. After a
timeout, rank 0 names the ranks that did not arrive and asks each where it is
(Whereabouts). Every wait, in every mode, ends within its timeout: the job is aborted,
and the result file says failed if rank 0 is alive. `write_stderr` prints a failure
whole, in one write, so that the abort cannot cut it.

comm.start opens the supervisor's channel (`attach`) and installs the hook that hands an
uncaught exception to it (comm.abort_on_uncaught).
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from . import startup, waits
from .waits import timeout_message, wait

ABORT_GRACE = 0.2       # seconds between printing a failure and aborting the job
NOTICE_GRACE = 3.0      # seconds a failing rank gives rank 0 to record the failure and abort the job first
COLLECT_GRACE = 1.0     # seconds a timed-out rank 0 waits for the other ranks' notices (who arrived)
WATCH_INTERVAL = 0.05   # seconds between the watchdog thread's checks
NOTICE_TAG = 7431       # tag of failure notices, on the supervisor's own communicator
QUERY_TAG = 7432        # rank 0 asks a late rank where it is (after a timeout) ...
ANSWER_TAG = 7433       # ... and its watchdog answers, in ANSWER_BYTES of UTF-8
ANSWER_BYTES = 256
QUERY_GRACE = 0.5       # seconds rank 0 waits for the late ranks' answers (within NOTICE_GRACE with COLLECT_GRACE)


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


class Supervisor:
    """One per process. Bounds blocking MPI calls, and lets rank 0 record a failure that
    another rank found, before the job is aborted.

    * `deadline(comm, seconds, what)`: around a blocking call (the spin policy's Allreduce,
      a Dup). A watchdog thread checks it every WATCH_INTERVAL; past it, it fails the job
      from outside the call (MPI is initialised THREAD_MULTIPLE). The call itself pays two
      attribute writes: the spin path keeps its latency. `wait` (the sleeping waits) marks
      itself too (waits.WAITING), so that rank 0 knows whether it is waiting.
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
        write_stderr(message)
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
        if self._deadline is not None or waits.WAITING is not None or notified is None:
            arrived.add(0)
        end = time.perf_counter() + COLLECT_GRACE
        while time.perf_counter() < end:
            notice = self._notice()
            if notice is not None:
                arrived.add(notice[0])
            time.sleep(0.01)
        missing = sorted(set(range(channel[0].Get_size())) - arrived)
        if missing:
            write_stderr(f"dbs-mpi: rank 0: rank(s) {missing} did not arrive; rank(s) {sorted(arrived)} waited "
                          f"for them\n")
            answers = Whereabouts.ask(channel[0], missing)
            write_stderr("".join(f"dbs-mpi: rank {r} {answers.get(r, NO_ANSWER)}\n" for r in missing))

    def where(self) -> str:
        """Where this rank is: the wait it is in and for how long, or not in one."""
        now, d, w = time.perf_counter(), self._deadline, waits.WAITING
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


def write_stderr(message: str) -> None:
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
