"""Ranks that sit out leave the step's gradient exchange: a sub-communicator of the ranks
taking part (planning/participation.py decides who sits out).

A rank with local batch 0 contributes nothing to the sample-weighted gradient. In the
world's allreduce it would still send and receive the whole gradient every step and
apply every update. Here the step's gradient is summed over the group of the ranks that
take part (and rank 0, which holds the run's state: it writes the checkpoints and the
result file, so it stays in the group, with weight 0 when it has no samples); a group
of one rank sums nothing. Every rank, in the group or not, then sums the step's few
extra values (the loss, the balancer's telemetry) over the world, so every planner
sees every step, stop requests and failed ranks reach everyone as before, and every wait
stays bounded by the timeout. A rank out of the group skips the update: its
parameters and optimizer state fall behind (it is *stale*).

Who is in the group follows from the step's row of local batches, which every rank
knows, so every rank switches at the same step and creates (MPI_Comm_split, collective,
cached) the same communicator. A stale rank catches up, with one broadcast of rank 0's
model and optimizer state, before the first step it takes part in (right after the
step before it, so even a compiled model's forward, which runs no hook, uses the current
parameters), and every stale rank catches up after an epoch's last step, so
evaluation, checkpoints and the end of training see one model on every rank.

Only MPI on host memory ("host" transport) leaves ranks out; the other transports, a
model with SyncBatchNorm (its layers need every rank's forward) and a GradScaler (its
skip decision needs the reduced gradient on every rank) keep every rank in the exchange
with weight 0, as before.
"""
from __future__ import annotations

import io

import numpy as np
import torch
from mpi4py import MPI

from ..mpi import transport as transports
from ..mpi.collectives import allgather_array, bcast_object, broadcast_flat
from ..mpi.supervisor import SUPERVISOR
from ..mpi.waits import wait
from .exchange import scale

WHAT = "the gradient allreduce"
CACHED = 8            # communicators kept (the sets a run moves between)


class Participants:
    """The group of ranks whose gradients a step sums (all ranks unless some sit out) and
    the ranks that fell behind while they were out of it."""

    def __init__(self, comm, exchange, model, optimizer, global_batch: int, timeout: float, enabled: bool):
        self.comm, self.rank, self.timeout = comm, comm.Get_rank(), float(timeout)
        self.global_batch = int(global_batch)
        self.exchange, self.model, self.optimizer = exchange, model, optimizer
        self.world = exchange.transport
        self.everyone = tuple(range(comm.Get_size()))
        # (agreed: a job that mixes CPU and GPU ranks may give them different transports)
        self.enabled = len(self.everyone) > 1 and bool(allgather_array(
            comm, [float(bool(enabled) and self.world.name == "host")], timeout).min())
        self.group, self.member = self.everyone, True
        self.stale: set[int] = set()             # ranks whose state missed updates
        self.used = False                        # a step has run in a group smaller than the world
        self._groups: dict[tuple, tuple] = {}    # group -> (communicator or None, transport or None)

    def group_of(self, row) -> tuple:
        """Rank 0 and the ranks with samples; an epoch's partial last step (fewer samples
        than the global batch) keeps the group it comes after, with these added."""
        if not self.enabled or (self.group == self.everyone and np.all(row)):    # (the common step: at once)
            return self.everyone
        keep = self.group if int(np.sum(row)) < self.global_batch else ()
        return tuple(r for r in self.everyone if r == 0 or row[r] > 0 or r in keep)

    def begin(self, row) -> None:
        """The step with local batches `row` begins (collective where the group changes)."""
        group = self.group_of(row)
        if group == self.group:
            return
        if self.stale.intersection(group):
            self.catch_up()
        self.group, self.member = group, self.rank in group
        _use(self.exchange, self.world if group == self.everyone else self._transport(group) or self.world)
        self.used = self.used or group != self.everyone

    def arm(self, row, weight: float) -> None:
        """At the step's first forward: its group, and the buckets may start during backward."""
        self.begin(row)
        if self.member:
            self.exchange.arm(weight)

    def allreduce(self, row, weight: float, loss_share, extra) -> float:
        """The step's exchange (GradientExchange.allreduce's contract): the world's, or
        the group's gradient sum and the world's sum of the extra values."""
        self.begin(row)
        if self.group == self.everyone:
            return self.exchange.allreduce(weight, loss_share, extra)
        if self.member:
            _group_sum(self.exchange, weight, self.timeout)
        self.exchange._schedule.reset()
        tail = np.array([float(loss_share), *(() if extra is None else extra)], dtype=np.float32)
        self._world_sum(tail)
        self.exchange.extra = tail[1:].copy() if self.exchange.extra_slots else None
        return float(tail[0])

    def updates(self, grad_scaler) -> bool:
        """Whether this rank applies the step's update (a rank out of the group does not)."""
        if grad_scaler is not None and self.enabled:
            if self.used:
                raise RuntimeError("DistributedOptimizer: a GradScaler after ranks sat out of the exchange: its skip "
                                   "decision needs every rank's reduced gradient; construct the optimizer with "
                                   "leave_exchange=False for loss scaling")
            self.enabled = False                 # (every rank hands the scaler over at the same step)
        return self.member

    def updated(self, balancer, buffers, row) -> None:
        """Right after the step's update (its time is the update's): the model's buffers
        become those of the first rank that computed, and after an epoch's last step every
        rank that fell behind catches up (evaluation and checkpoints see one model)."""
        if buffers:
            computed = np.flatnonzero(row)
            broadcast_flat(buffers, self.comm, int(computed[0]) if len(computed) else 0, self.timeout)
        if self.group != self.everyone and balancer.step + 1 >= len(balancer.epoch_table):
            self.stale.update(r for r in self.everyone if r not in self.group)
            self.catch_up()
            self.group, self.member = self.everyone, True
            _use(self.exchange, self.world)

    def after_step(self, balancer) -> None:
        """After the step's record: the ranks out of its group fell behind; one taking part in
        the next step catches up now, before its forward."""
        if self.group == self.everyone:
            return
        self.stale.update(r for r in self.everyone if r not in self.group)
        self.begin(balancer.step_batch_sizes())

    def same_everywhere(self, value):
        """rank 0's `value` (a gradient's norm, a 0-dim tensor) on every rank where ranks are
        out of the step's sum, which hold no gradient; `value` elsewhere."""
        if self.group == self.everyone:
            return value
        number = np.array([float(value)])
        wait(self.comm.Ibcast(number, root=0), self.timeout, "broadcasting the gradient's norm")
        return torch.tensor(number[0], dtype=value.dtype if isinstance(value, torch.Tensor) else torch.float32)

    def catch_up(self) -> None:
        """Collective: the stale ranks take rank 0's model and optimizer state."""
        payload = None
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, buffer)
            payload = buffer.getvalue()
        payload = bcast_object(self.comm, payload, 0, self.timeout, "bringing the ranks that sat out the run's "
                                                                    "state")
        if self.rank in self.stale:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.stale.clear()

    def _transport(self, group: tuple):
        """The group's transport on this rank (None out of it): created once, collectively."""
        if group not in self._groups:
            if len(self._groups) >= CACHED:
                sub, _ = self._groups.pop(next(iter(self._groups)))
                if sub is not None:
                    sub.Free()
            with SUPERVISOR.deadline(self.comm, self.timeout, "creating the communicator of the ranks taking part"):
                sub = self.comm.Split(0 if self.rank in group else MPI.UNDEFINED, self.rank)
            self._groups[group] = (None, None) if sub == MPI.COMM_NULL else (sub, self._make(sub))
        return self._groups[group][1]

    def _make(self, sub):
        x, world = self.exchange, self.world
        if sub.Get_size() == 1:
            return transports.Local(x.flat, 1 + x.extra_slots)
        bounds = [*x.bounds[:-1], (x.bounds[-1][0], x.numel)]      # the gradients: the extra values go world-wide
        part = transports.HostMPI(sub, x.flat, bounds, world.staged, 1 + x.extra_slots)
        if world.staged:                 # one pinned host copy of the gradients, not one per group
            part.host, part.array = world.host, world.array
            part.views = [world.array[start:stop] for start, stop in bounds]
        return part

    def _world_sum(self, tail: np.ndarray) -> None:
        if self.exchange.sleep_while_waiting:
            wait(self.comm.Iallreduce(MPI.IN_PLACE, tail, op=MPI.SUM), self.timeout, f"{WHAT} (the step's loss "
                                                                                        f"and times)")
            return
        SUPERVISOR.arm(self.comm, self.timeout, WHAT)
        try:
            self.comm.Allreduce(MPI.IN_PLACE, tail, op=MPI.SUM)
        finally:
            SUPERVISOR.disarm()


def _use(exchange, transport) -> None:
    """The exchange's buckets go through `transport` from the next one started."""
    exchange.transport = exchange._schedule.transport = transport
    exchange._schedule.gated = transport.deferred


def _group_sum(exchange, weight: float, timeout: float) -> None:
    """The step's gradient summed over the group (its transport is the exchange's now):
    GradientExchange.allreduce's steps without the extra values."""
    schedule, transport = exchange._schedule, exchange.transport
    last = schedule.last
    exchange.adopt_grads()
    try:
        while schedule.next < last:
            schedule.start(schedule.next, weight)
        if weight != 1.0 and not schedule.prescaled:
            scale(exchange.final_grads, weight)
        transport.stage(last)
        sub = getattr(transport, "comm", None)
        if sub is not None:
            transport.begin_all(schedule.requests)
            if exchange.sleep_while_waiting:
                wait(sub.Ibarrier(), timeout, f"{WHAT} (waiting for the other ranks)")
            SUPERVISOR.arm(exchange.comm, timeout, WHAT)
            try:
                transport.reduce(last, schedule.requests)
                transport.wait(schedule.requests)
            finally:
                SUPERVISOR.disarm()
        transport.finish()
    finally:
        schedule.reset()
