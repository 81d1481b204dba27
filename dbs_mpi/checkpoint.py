"""Checkpoints and stop requests: lose nothing when a job is stopped or crashes.

A checkpoint holds everything needed to continue a synchronous run exactly where it
stopped: the configuration, the position (epoch and step), model and optimiser state,
the batch vector and the allocation model (start-up benchmark / DBS controller), the
partial epoch's losses and step times, and the RNG states of every rank (torch,
heterogeneity emulator). Rank 0 gathers the per-rank parts and writes one file,
atomically: a temporary file in the same folder, fsync, then rename, so a crash while
writing leaves the previous checkpoint intact.

Stop requests: SIGTERM and SIGUSR1 (what schedulers send before a time limit or a
preemption; Slurm with `--signal=USR1@120`) set a flag. The ranks agree on it at every
step boundary with a one-integer non-blocking allreduce that overlaps the step, so all
ranks stop after the same step, write the checkpoint and exit with EXIT_STOPPED.
"""
from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from . import comm as mpi
from .config import UserError

EXIT_STOPPED = 3          # exit status after a stop request: checkpoint written, resume with --resume
FORMAT_VERSION = 1


class Stopped(Exception):
    """Raised on every rank after a stop request was checkpointed (train() exits with EXIT_STOPPED)."""


def default_path(out) -> Path:
    return Path(str(out) + ".ckpt")


def save(comm, path, common: dict, per_rank: dict) -> None:
    """Collective: rank 0 writes {common, per_rank: [every rank's dict]} to path atomically."""
    gathered = comm.gather(per_rank, root=0)
    if comm.Get_rank() != 0:
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    buffer = io.BytesIO()
    torch.save({"format": FORMAT_VERSION, **common, "per_rank": gathered}, buffer)
    with open(tmp, "wb") as f:
        f.write(buffer.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path) -> dict:
    """Read a checkpoint; a missing, truncated or foreign file raises UserError naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"resume: no checkpoint {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises many kinds for damaged files
        raise UserError(f"resume: {path} is not a readable checkpoint (truncated or corrupt: "
                        f"{type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise UserError(f"resume: {path} is not a dbs-mpi checkpoint of format {FORMAT_VERSION}")
    return state


def rng_state(emulator) -> dict:
    return {"torch": torch.get_rng_state(), "emulator": emulator.rng.bit_generator.state,
            "disturbed_until": emulator.disturbed_until}


def restore_rng(state: dict, emulator) -> None:
    torch.set_rng_state(state["torch"])
    emulator.rng.bit_generator.state = state["emulator"]
    emulator.disturbed_until = state["disturbed_until"]


class StopRequest:
    """Turns SIGTERM / SIGUSR1 into a flag that all ranks agree on at step boundaries."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, comm, timeout: float = 600.0):
        self.comm = comm
        self.timeout = timeout
        self.requested = 0          # the signal number received on this rank, 0 if none
        self._buffer = np.zeros(1, dtype=np.int64)
        self._request = None
        self._previous = {}

    def __enter__(self):
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        self.requested = signum

    # The synchronous loop agrees on the flag with start()/agreed() at every step; the
    # parameter server reads `requested` directly (workers send it with their gradients).

    def start(self) -> None:
        """Begin the step's agreement (non-blocking; every rank calls it at the same step)."""
        self._buffer[0] = self.requested
        if self.comm.Get_size() > 1:
            self._request = self.comm.Iallreduce(MPI.IN_PLACE, self._buffer, op=MPI.MAX)

    def agreed(self) -> int:
        """Finish the agreement: the signal number if any rank was asked to stop, else 0."""
        if self._request is not None:
            mpi.wait(self._request, self.timeout, "stop-request agreement")
            self._request = None
        return int(self._buffer[0])
