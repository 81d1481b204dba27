"""Agreement: a set-up step that fails on one rank fails on every rank, cleanly.

`collective` runs a set-up function on every rank and lets all ranks fail together when
any rank fails: every rank raises AgreedError, and the rank that failed holds the
message (the CLI prints it once and exits with status 2; nobody is left waiting, and
nothing is aborted). `agree` is the same for the command line's set-up (SystemExit(2)).
`agree_settings` checks that every rank runs with the same settings. Each is one bounded
allgather (collectives.py), none on a world of one.
"""
from __future__ import annotations

import traceback

from mpi4py import MPI

from ..options import UserError
from .collectives import allgather_object
from .supervisor import write_stderr


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
        return (self.details or "") + error_line(self) + where + "\n"


def error_line(exc) -> str:
    """The start of the line dbs-mpi prints for a user's mistake."""
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
            write_stderr(exc.report())
        raise SystemExit(2) from None
