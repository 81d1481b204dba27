"""Waiting without spinning, and never forever: how a rank waits for the others.

`wait` completes a non-blocking request without burning the CPU: it polls with
MPI_Test and sleeps between polls (backing off from 20 us to 100 us, and in a long wait
to 2% of the time waited, at most 2 ms: `next_pause`), so a rank that waits for slower
ranks leaves its core to them (MPICH's blocking calls busy-poll). It is bounded: past
`timeout` seconds it raises CommTimeout, which ends the job (supervisor.py) instead of
hanging. While it sleeps, WAITING says in which wait and since when: the supervisor's
watchdog tells rank 0 from it whether this rank arrived, and where it is.

Sleeping costs latency: MPICH progresses a non-blocking allreduce only inside MPI_Test,
and a 250 kB allreduce needs many rounds. So the gradient exchange (exchange.py) has two
wait policies: "sleep" waits for everybody's arrival in a sleeping Ibarrier, then runs a
blocking Allreduce that spins only while bytes move; "spin" calls the blocking Allreduce
at once (lowest latency), bounded by the supervisor's watchdog. "auto" (default) sleeps
only where a node runs more ranks than it has cores, i.e. where a spinning rank would
steal a core (placement.sleep_while_waiting).
"""
from __future__ import annotations

import time

from mpi4py import MPI

POLL_SPIN = 20e-6       # seconds of plain polling before the first sleep
POLL_SLEEP_MIN = 20e-6  # first sleep between polls, seconds
POLL_SLEEP_MAX = 1e-4   # longest sleep between polls in a short wait, seconds (bounds the added latency)
POLL_SLEEP_LONG = 2e-3  # ... in a long wait, which may sleep up to POLL_LONG_SHARE of the time it waited
POLL_LONG_SHARE = 0.02
WAIT_POLICIES = ("auto", "spin", "sleep")
WAITING: tuple[str, float] | None = None    # (what, since: perf_counter time) of the sleeping wait under way


class CommTimeout(RuntimeError):
    """A wait that outlasted its timeout: another rank did not arrive in time."""


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
    global WAITING
    if request.Test():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < POLL_SPIN:
        if request.Test():
            return
    pause = POLL_SLEEP_MIN
    WAITING = (what, start)
    while not request.Test():
        waited = time.perf_counter() - start
        if waited > timeout:     # (still marked as waiting: rank 0 counts it among the ranks that arrived)
            raise CommTimeout(timeout_message(timeout, what))
        time.sleep(pause)
        pause = next_pause(pause, waited, max_pause)
    WAITING = None
