"""The asynchronous strategies (asgd, nsoftsync, dbs-sgd) on a parameter server, event by
event: workers compute and push, the server takes the gradients one after the other (an
add, and the update when a group is full) and replies; a message costs alpha + m beta.
Staleness comes out of the order of events.
"""
from __future__ import annotations

import heapq

import numpy as np

from ...parameter_server.groups import group_size
from ...parameter_server.work import Cursor
from ...planning import allocation, sharding
from .cluster import Cluster, Compute, emulators, free_running_rate
from .job import Job, Result
from .network import Network
from .sync import dbs_controller, simulated_calibration


class ServerSim:
    """The parameter server's bookkeeping in simulated time: the engine's Cursor hands out
    the samples, gradients are applied in groups of c (groups.group_size), an
    epoch closes when all its samples are applied, dbs-sgd re-plans at every epoch with the
    engine's DBSController. Checkpoint boundaries drain the workers (every one finishes its
    step and waits; the clock stops), as the engine does."""

    def __init__(self, job: Job, workers: int, vector, controller, checkpoint_every: int):
        self.job, self.workers, self.controller, self.every = job, workers, controller, checkpoint_every
        self.c = group_size(job.strategy, workers, job.softsync_n)
        self.wait_mode = job.strategy == "nsoftsync" and job.softsync_wait
        self.cursor = Cursor(job.samples, job.global_batch, job.epochs, job.drop_last, workers,
                             self.wait_mode and self.c == workers)
        self.vector = np.asarray(vector, dtype=np.int64)
        self.version, self.group, self.vectors = 0, [], []
        self.applied = np.zeros(job.epochs, dtype=np.int64)
        self.closed, self.ends, self.staleness = 0, [], []
        self.measure = [[] for _ in range(workers)]
        self.segment_epoch = 0

    def take(self, worker: int):
        """(epoch, count) of the worker's next work, or None (no work now: the end or a drain)."""
        c = self.cursor
        if c.done or (self.every and c.needs_epoch and c.epoch > self.segment_epoch and c.epoch % self.every == 0):
            return None
        if c.needs_epoch:
            self._replan()
            c.begin_epoch(self.vector)
            self.vectors.append(self.vector.tolist())
        epoch, _, count = c.take(worker)
        return epoch, count

    def _replan(self) -> None:
        if self.controller is None or self.cursor.epoch == 0 or not any(self.measure):
            return
        rows = max(len(m) for m in self.measure)
        table = np.zeros((rows, self.workers))
        for w, m in enumerate(self.measure):
            table[:len(m), w] = [count for count, _ in m]
        self.vector, _ = self.controller.update(self.vector, table, [sum(t for _, t in m) for m in self.measure])
        self.measure = [[] for _ in range(self.workers)]

    def push(self, worker: int, version: int, count: int, epoch: int, seconds: float) -> bool:
        """A gradient arrives; True if it completed a group (an update is applied)."""
        self.group.append((version, count, epoch))
        if count:
            self.measure[worker].append((count, seconds))
        return len(self.group) >= self.c

    def apply(self, now: float) -> None:
        for version, count, epoch in self.group:
            self.staleness.append(self.version - version)
            self.applied[epoch] += count
        self.version, self.group = self.version + 1, []
        while self.closed < self.job.epochs and self.applied[self.closed] >= self.cursor.per_epoch:
            self.ends.append(now)
            self.closed += 1


def simulate_async(job: Job, cluster: Cluster, network: Network, noise: float = 0.03, seed: int = 0,
                   load: float = 1.0, vector=None, fit=None, checkpoint_every: int = 1) -> Result:
    """asgd, nsoftsync or dbs-sgd on a parameter server (rank 0), event by event."""
    rng = np.random.default_rng(seed)
    n, workers = cluster.size, cluster.size - 1
    compute, emus = Compute(job, cluster, noise, rng, load), emulators(job, n)
    controller = None
    if job.strategy == "dbs-sgd":
        fit = fit or simulated_calibration(job, cluster, compute, emus)
        model = allocation.SpeedModel(fit.per_sample[1:].copy(), fit.overhead[1:].copy())
        controller = dbs_controller(job, model)
        vector = model.allocate(job.global_batch, job.min_local_batch, job.max_local_batch or None)
    elif vector is None or len(vector) != workers:
        vector = allocation.equal(job.global_batch, workers, job.min_local_batch, job.max_local_batch or None)
    server = ServerSim(job, workers, vector, controller, checkpoint_every)
    message = network.message(4.0 * job.model.numel)
    add = job.model.add or job.model.update / 2
    factor = np.array([e.factor for e in emus])
    factor[0] = np.inf                              # the server mostly sleeps between messages
    contention = 1.0 / free_running_rate(cluster.nodes, factor, cluster.node_cores())
    steps = sharding.steps_per_epoch(job.samples, job.global_batch, job.drop_last)
    loop = _AsyncLoop(server, compute, emus, contention, message, add, steps)
    loop.run(workers)
    result = Result(epoch_time=list(np.diff([0.0, *server.ends])), batch_sizes=server.vectors,
                    staleness=server.staleness)
    result.compute, result.comm, result.wait = loop.compute, loop.comm, loop.wait
    return result


class _AsyncLoop:
    """The events: a worker gets work (a message), computes, pushes (a message); the server
    takes pushes in arrival order, one at a time (add; update when a group is full)."""

    def __init__(self, server: ServerSim, compute: Compute, emus, contention, message, add, steps):
        self.server, self.compute_model, self.emus, self.contention = server, compute, emus, contention
        self.message, self.add, self.steps = message, add, steps
        self.residual = server.job.residual.get("async", 0.0)
        self.heap, self.seq, self.free = [], 0, 0.0
        self.busy, self.deferred, self.drained = 0, [], []
        self.epoch_of = [-1] * len(emus)
        self.compute = self.comm = self.wait = 0.0

    def give(self, worker: int, now: float) -> None:
        work = self.server.take(worker)
        if work is None:
            self.drained.append(worker)
            return
        epoch, count = work
        rank = worker + 1
        if epoch != self.epoch_of[rank]:
            self.emus[rank].start_epoch(epoch, self.steps)
            self.epoch_of[rank] = epoch
        e = self.emus[rank]
        work = float(self.compute_model.work(np.array([count]), [rank])[0]) if count else 0.0
        seconds = work * self.contention[rank] + work * (e.factor - 1.0) + e.step_sleep + self.residual
        self.compute += seconds
        self.comm += 2 * self.message
        arrival = now + self.message + seconds + self.message
        self.seq += 1
        self.busy += 1
        heapq.heappush(self.heap, (arrival, self.seq, worker, self.server.version, count, epoch, seconds))

    def run(self, workers: int) -> None:
        for w in range(workers):
            self.give(w, 0.0)
        budget = 10 * (self.server.job.epochs * (self.server.job.samples + workers * self.steps) + workers)
        for _ in range(budget):                      # bounded: every pass applies one gradient
            if not self.heap:
                if not self.drained or self.server.cursor.done:
                    return
                self._next_segment()
                continue
            self._receive(*heapq.heappop(self.heap))
        raise RuntimeError("simulated parameter server: more events than the budget allows")

    def _receive(self, arrival, _, worker, version, count, epoch, seconds) -> None:
        self.busy -= 1
        start = max(arrival, self.free)
        self.wait += max(0.0, self.free - arrival)
        full = self.server.push(worker, version, count, epoch, seconds)
        self.free = start + self.add + (self.compute_model.job.model.update if full else 0.0)
        if full:
            self.server.apply(self.free)
        if not self.server.wait_mode:
            self.give(worker, self.free)
        else:
            self.deferred.append(worker)
            if full:
                self._reply_deferred()
        if self.server.group and self.busy == 0:     # nobody computes: apply the group as it is
            self.server.apply(self.free)
            self._reply_deferred()

    def _reply_deferred(self) -> None:
        deferred, self.deferred = sorted(self.deferred), []
        for w in deferred:
            self.give(w, self.free)

    def _next_segment(self) -> None:
        """After a drain (a checkpoint boundary): everybody restarts together; the engine's
        clock stopped meanwhile (checkpoint and evaluation are not training time)."""
        workers, self.drained = sorted(self.drained), []
        self.server.segment_epoch = self.server.cursor.epoch
        for w in workers:
            self.give(w, self.free)
