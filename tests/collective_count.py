"""Counting a step's collectives (tests only): a communicator that forwards every call
to an MPI communicator and counts the collective ones, including those of the
sub-communicators it splits off (the ranks taking part in a step)."""
from mpi4py import MPI

COLLECTIVES = {"Allreduce", "Iallreduce", "Bcast", "Ibcast", "Barrier", "Ibarrier", "Allgather", "Iallgather",
               "Allgatherv", "Iallgatherv", "Reduce", "Ireduce", "Split", "Dup", "Idup", "Alltoall", "Gather",
               "Scatter"}


class Tally:
    def __init__(self):
        self.calls = []            # (communicator's size, method name), in call order

    def since(self, mark: int) -> list:
        return self.calls[mark:]


class Counting:
    """Forwards to `comm`; records every collective call in `tally`."""

    def __init__(self, comm: MPI.Comm, tally: Tally):
        self._comm, self._tally = comm, tally

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in COLLECTIVES:
            return attr

        def counted(*args, **kwargs):
            self._tally.calls.append((self._comm.Get_size(), name))
            out = attr(*args, **kwargs)
            if isinstance(out, MPI.Intracomm) and out != MPI.COMM_NULL:
                return Counting(out, self._tally)
            return out
        return counted

    def __eq__(self, other):
        return self._comm == (other._comm if isinstance(other, Counting) else other)

    def __hash__(self):
        return hash(self._comm)
