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

from ..mpi.collectives import bcast_object, broadcast_flat
from ..mpi.supervisor import SUPERVISOR
from ..mpi.waits import wait
from .exchange import Route, StepSums

CACHED = 8            # communicators kept (the sets a run moves between)


class Participants:
    """The group of ranks whose gradients a step sums (all ranks unless some sit out) and
    the ranks that fell behind while they were out of it. It decides who takes part and
    when; the exchange (exchange.py) sums over the route it is given.

    balancer: its global_batch tells a partial step (it may change between epochs).
    enabled: ranks may leave the sum (agreed by the caller: the same on every rank)."""

    def __init__(self, comm, exchange, model, optimizer, balancer, timeout: float, enabled: bool):
        self.comm, self.rank, self.timeout = comm, comm.Get_rank(), float(timeout)
        self.balancer = balancer
        self.exchange, self.model, self.optimizer = exchange, model, optimizer
        self.everyone = tuple(range(comm.Get_size()))
        self.enabled = len(self.everyone) > 1 and bool(enabled)
        self.group, self.member = self.everyone, True
        self.stale: set[int] = set()             # ranks whose state missed updates
        self.used = False                        # a step has run in a group smaller than the world
        self._routes: dict[tuple, tuple] = {}    # group -> (communicator or None, route or None)

    def group_of(self, row) -> tuple:
        """Rank 0 and the ranks with samples; an epoch's partial last step (fewer samples
        than the global batch) keeps the group it comes after, with these added."""
        if not self.enabled or (self.group == self.everyone and all(row)):    # (the common step: at once)
            return self.everyone
        keep = self.group if int(sum(row)) < self.balancer.global_batch else ()
        return tuple(r for r in self.everyone if r == 0 or row[r] > 0 or r in keep)

    def plan(self, row) -> Route | None:
        """The route of the step with local batches `row` (None: this rank is out of its
        sum). Collective where the group changes: a new group's communicator (created
        once), and the stale ranks that take part again catch up first."""
        group = self.group_of(row)
        if group != self.group:
            if self.stale.intersection(group):
                self.catch_up()
            self.group, self.member = group, self.rank in group
            self.used = self.used or group != self.everyone
        if group == self.everyone:
            return self.exchange.world
        return self._route(group)          # every rank: its communicator is created collectively

    def reduce(self, route: Route | None, weight: float, loss_share, extra, sleep: bool = False) -> StepSums:
        """The step's exchange over its route: the world's (gradient and tail in one
        collective), or the group's gradient sum (nothing out of it) and the world's sum of
        the tail (the loss, the telemetry, the stop flags); sleep: a probe computes beside
        this rank's wait (prober.py)."""
        if route is self.exchange.world:
            return self.exchange.reduce(weight, route, loss_share, extra)
        if route is not None:
            self.exchange.reduce(weight, route)
        else:
            self.exchange.drop_step()
        return self.exchange.sum_tail(loss_share, extra, sleep)

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
        become those of the first rank that computed; the ranks out of the step's group fell
        behind, and after an epoch's last step they catch up (evaluation and checkpoints
        see one model); one that takes part in the next step catches up when that step is
        planned (the optimizer plans it right after this one)."""
        if buffers:
            first = next((rank for rank, local in enumerate(row) if local), 0)
            broadcast_flat(buffers, self.comm, int(first), self.timeout)
        if self.group == self.everyone:
            return
        self.stale.update(r for r in self.everyone if r not in self.group)
        if balancer.step + 1 >= len(balancer.epoch_table):
            self.catch_up()
            self.group, self.member = self.everyone, True

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

    def _route(self, group: tuple) -> Route | None:
        """The group's route on this rank (None out of it): created once, collectively."""
        if group not in self._routes:
            if len(self._routes) >= CACHED:
                sub, _ = self._routes.pop(next(iter(self._routes)))
                if sub is not None:
                    sub.Free()
            with SUPERVISOR.deadline(self.comm, self.timeout, "creating the communicator of the ranks taking part"):
                sub = self.comm.Split(0 if self.rank in group else MPI.UNDEFINED, self.rank)
            self._routes[group] = (None, None) if sub == MPI.COMM_NULL else (sub, self.exchange.route_over(sub))
        return self._routes[group][1]
