"""Simulation: what a dbs-mpi run would do, in seconds, without running it.

    dbs-mpi simulate --from results/grid/strategies-dbs-s0.h5 --json      # replay a run
    dbs-mpi simulate --ranks 1024 --strategy dbs --model resnet20 --speed-spread 4 --epochs 3
    dbs-mpi simulate --speeds my-cluster.toml --strategy dbs --model resnet20 --epochs 3   # docs/simulator.md
    mpirun -n 2 dbs-mpi simulate calibrate --out results/machine/NAME.json   # machine.py

A discrete-event model of a run, step by step, built from the engine's own parts: the
allocation and the DBS controller (allocation.py, dynamic/), the epoch's table of
local batches (sharding.step_batch_sizes), the calibration's batches and fit
(allocation.py), the emulator's slow-downs and random sleeps (heterogeneity.Emulator),
and for the parameter server its Cursor and group rule (sharding.py). None of them
needs torch, and neither does the simulator: a projection answers at once, on a login
node too. What it models instead of running (docs/simulator.md has the formulas and
what limits them):

* compute: a rank's forward and backward at local batch b costs w(b) core-seconds (the
  machine's measured table, machine.py) divided by its device speed, times lognormal
  noise; an emulated slow-down (a sleep of (1/s - 1) times the compute's CPU time, plus
  the epoch's disturbance) uses no core;
* cores: the ranks of a node share its cores (processor sharing: while k ranks compute on
  C cores, each runs at min(1, C/k) of a core), which is what makes 4 ranks on 2 cores
  slower than their parts;
* the allreduce: alpha-beta, per gradient bucket (the DDP layout of exchange.bucket_layout):
  ring 2 (p-1) alpha + 2 (p-1)/p m beta, tree (binomial reduce, then broadcast)
  2 ceil(log2 p) (alpha + m beta), "auto" the cheaper; a sleeping wait adds a constant;
* a synchronous step: every rank reads its batch and computes; the allreduce starts when
  the last rank is done; then every rank updates. wait_i = max_j pre_j - pre_i;
* the parameter server: workers compute and push, the server takes the gradients one
  after the other (an add, and the update when a group is full) and replies; a message
  costs alpha + m beta. Staleness comes out of the order of events.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..mpi import comm as mpi
from ..options import UserError, parse_interval
from ..planning import allocation, dynamic, participation, sharding
from ..planning.heterogeneity import Emulator
from . import config as config_mod
from .config import ArgumentParser, Config, tomllib
from .data import SPLIT_SIZES
from .machine import Machine, ModelCost, calibrate

# Named networks (alpha: seconds per message, beta: seconds per byte).
NETWORKS = {"ib-100g": (2e-6, 1 / 12.5e9),      # InfiniBand HDR 100 Gb/s
            "eth-25g": (15e-6, 1 / 3.125e9),     # 25 Gb/s Ethernet
            "eth-10g": (25e-6, 1 / 1.25e9)}      # 10 Gb/s Ethernet
SYNC, ASYNC = ("ssgd", "static", "dbs"), ("asgd", "nsoftsync", "dbs-sgd")
DEFAULT_NOISE = 0.03                           # lognormal sigma of a step's compute time (projections)


@dataclass
class Network:
    alpha: float                     # seconds per message
    beta: float                      # seconds per byte
    algorithm: str = "auto"          # ring | tree | auto (the cheaper, as MPI libraries choose)
    sleep_wait: float = 0.0          # seconds a sleeping wait adds to a collective
    crowded: float = 0.0             # seconds every message adds where ranks outnumber cores

    def allreduce(self, ranks: int, nbytes: float, alpha: float | None = None) -> float:
        if ranks <= 1:
            return 0.0
        alpha = self.alpha if alpha is None else alpha
        ring = 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes * self.beta
        tree = 2 * math.ceil(math.log2(ranks)) * (alpha + nbytes * self.beta)
        return {"ring": ring, "tree": tree}.get(self.algorithm, min(ring, tree))

    def exchange(self, ranks: int, buckets, sleeping: bool = False, crowded: bool = False) -> float:
        """One step's gradient exchange: the buckets one after the other (bytes each). Where
        a node runs more ranks than it has cores, every message waits for its peer to be
        scheduled: alpha grows by the machine's `crowded` cost."""
        if ranks <= 1:
            return 0.0
        alpha = self.alpha + (self.crowded if crowded else 0.0)
        return sum(self.allreduce(ranks, b, alpha) for b in buckets) + (self.sleep_wait if sleeping else 0.0)

    def message(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


def buckets(numel: int, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0, extra: int = 0) -> list[float]:
    """Bytes of every gradient bucket of a model with `numel` parameters (DDP's caps; the
    loss slot and `extra` telemetry slots in the last): one bucket per cap-sized run of
    the flat buffer."""
    total, first, cap = 4.0 * (numel + 1 + extra), first_bucket_mb * 2 ** 20, bucket_mb * 2 ** 20
    if not cap or total <= (first or total):
        return [total]
    out, left = [first], total - first
    while left > cap:
        out.append(cap)
        left -= cap
    return out + [left] if left > 0 else out


def processor_sharing(work: np.ndarray, nodes: np.ndarray, cores) -> np.ndarray:
    """Wall seconds of every rank's CPU work (core-seconds) when the ranks of a node start
    together and share its cores (cores[node]): while k compute, each runs at min(1, cores/k)."""
    wall = work.astype(float).copy()
    counts = np.bincount(nodes)
    for node in np.flatnonzero(counts > np.asarray(cores, float)[:len(counts)]):     # crowded nodes only
        idx = np.flatnonzero(nodes == node)
        cores_here = cores[node]
        order = idx[np.argsort(work[idx], kind="stable")]
        t, done = 0.0, 0.0
        for j, rank in enumerate(order):
            t += (work[rank] - done) / min(1.0, cores_here / (len(order) - j))
            done = work[rank]
            wall[rank] = t
    return wall


def free_running_rate(nodes: np.ndarray, factor: np.ndarray, cores) -> np.ndarray:
    """The share of a core every rank gets when the ranks run their loops unsynchronised
    (the start-up calibration, the parameter server's workers): a rank whose emulated
    slow-down stretches its compute by `factor` computes 1/factor of its time, so a node's
    ranks keep sum_j 1/factor_j cores busy on average (a mean field), each at
    min(1, cores / that)."""
    duty = 1.0 / np.asarray(factor, float)
    busy = np.bincount(nodes, weights=duty)
    return np.minimum(1.0, np.asarray(cores, float)[nodes] / np.maximum(busy[nodes], 1e-12))


@dataclass
class Cluster:
    """Where the ranks run and how fast their devices are. A "node" is a set of ranks that
    share the same cores: a host, or the ranks of a host pinned to the same cores."""
    nodes: np.ndarray                # node of every rank
    cores: object                    # cores of every node (an int: all alike; or one per node)
    device: np.ndarray               # relative speed of every rank's device (1 = the machine's core)
    sleeping: bool = False           # waiting ranks sleep (wait policy) rather than spin

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def crowded(self) -> bool:
        """Some node runs more ranks than it has cores."""
        return bool(np.any(np.bincount(self.nodes) > self.node_cores()))

    def node_cores(self) -> np.ndarray:
        """Cores of every node, indexed by node."""
        count = int(self.nodes.max()) + 1
        return np.full(count, self.cores, dtype=float) if np.isscalar(self.cores) else np.asarray(self.cores, float)


@dataclass
class Job:
    """The training run to simulate (the parts of config.Config that matter here)."""
    strategy: str
    model: ModelCost
    samples: int                     # training samples
    global_batch: int
    epochs: int
    speeds: tuple = ()               # emulated relative speeds (heterogeneity.Emulator), () = none
    drop_last: bool = False
    min_local_batch: int = 1
    max_local_batch: int = 0
    dbs_model: str = "affine"
    dbs_smoothing: float = 0.5
    dbs_follow: float = 0.25
    dbs_min_gain: float = 0.03
    dbs_interval: str = "1"          # dbs: re-plan every N steps, or "epoch"
    dbs_window: int = 32
    participation: str = "auto"      # auto: static and dbs leave out a rank that would slow every step | all
    benchmark_steps: int = 5
    softsync_n: int = 1
    softsync_wait: bool = False
    seed: int = 0
    disturbances: dict = field(default_factory=dict)   # slow_rank, slow_factor, slow_epochs/steps/seconds, sleep_*
    data_per_sample: float = 0.0     # seconds of reading one sample
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    residual: dict = field(default_factory=dict)   # the machine's (machine.Machine.residual)


def emulators(job: Job, ranks: int) -> list[Emulator]:
    """The engine's emulator of every rank (the same draws as the real run's)."""
    top = max(job.speeds) if job.speeds else 1.0
    return [Emulator(r, job.speeds[r] / top if job.speeds else 1.0, seed=job.seed, **job.disturbances)
            for r in range(ranks)]


class Compute:
    """Every rank's step: CPU work w(b) / device speed x noise, shared cores, then the
    emulated slow-down (which sleeps: no core)."""

    def __init__(self, job: Job, cluster: Cluster, noise, rng, load: float = 1.0):
        self.job, self.cluster, self.noise, self.rng, self.load = job, cluster, noise, rng, load

    def work(self, local_batches: np.ndarray, ranks=None) -> np.ndarray:
        """Core-seconds of every rank's forward and backward (of `ranks`' only, if given)."""
        device = self.cluster.device if ranks is None else self.cluster.device[ranks]
        w = self.job.model.compute(local_batches) * self.load / device
        if np.any(self.noise):
            sigma = self.noise if np.isscalar(self.noise) or ranks is None else np.asarray(self.noise)[ranks]
            w = w * self.rng.lognormal(-np.square(sigma) / 2, sigma, size=w.shape)
        return w

    def pre(self, local_batches: np.ndarray, factor: np.ndarray, sleep: np.ndarray) -> np.ndarray:
        """(ranks,) seconds before the collective of one step: data, compute, emulation."""
        data = np.asarray(local_batches, float) * self.job.data_per_sample
        work = self.work(local_batches)
        wall = processor_sharing(work + data, self.cluster.nodes, self.cluster.node_cores())
        return wall + work * (factor - 1.0) + sleep      # the engine stretches the CPU work of every step

    def update(self) -> float:
        """Seconds of the optimizer update and the loop's own work, all ranks at once."""
        crowd = np.max(np.bincount(self.cluster.nodes) / self.cluster.node_cores())
        return (self.job.model.update + self.job.model.overhead) * self.load * max(1.0, crowd)


@dataclass
class Result:
    """What a simulated run did."""
    epoch_time: list = field(default_factory=list)     # seconds per epoch
    batch_sizes: list = field(default_factory=list)    # the vector of every epoch
    compute: float = 0.0                               # seconds summed over ranks and epochs
    comm: float = 0.0
    wait: float = 0.0
    staleness: list = field(default_factory=list)      # asynchronous: every applied gradient's
    simulate_seconds: float = 0.0

    def shares(self) -> dict:
        total = max(self.compute + self.comm + self.wait, 1e-30)
        return {"compute_share": self.compute / total, "comm_share": self.comm / total,
                "wait_share": self.wait / total}

    def as_dict(self) -> dict:
        out = {"epoch_time_predicted": [float(t) for t in self.epoch_time],
               "batch_sizes": [[int(b) for b in v] for v in self.batch_sizes], **self.shares(),
               "simulate_seconds": self.simulate_seconds}
        if self.staleness:
            s = np.asarray(self.staleness)
            out.update(staleness_mean=float(s.mean()), staleness_max=int(s.max()))
        return out


# --- the synchronous strategies -----------------------------------------------------------

def calibration_step(compute: Compute, cluster: Cluster, factor: np.ndarray, local_batch: int) -> np.ndarray:
    """Every rank's calibration step at `local_batch`, the ranks' loops unsynchronised
    (free_running_rate), the emulated slow-down included (seconds, per rank)."""
    rate = free_running_rate(cluster.nodes, factor, cluster.node_cores())
    work = compute.work(np.full(cluster.size, local_batch))
    return work / rate + work * (factor - 1.0)


def calibration_times(job: Job, cluster: Cluster, compute: Compute, emus) -> tuple[tuple, np.ndarray]:
    """The start-up calibration as the engine runs it (balancer.calibrate): the medians of
    benchmark_steps steps at two local batches. Returns ((small, large), (ranks x 2) seconds)."""
    batches = allocation.calibration_batches(job.global_batch, cluster.size, job.min_local_batch,
                                             job.max_local_batch or None)
    factor = np.array([e.factor for e in emus])
    times = [np.median([calibration_step(compute, cluster, factor, b) for _ in range(job.benchmark_steps)], axis=0)
             for b in batches]
    return batches, np.stack(times, axis=1)


def simulated_calibration(job: Job, cluster: Cluster, compute: Compute, emus) -> allocation.SpeedModel:
    """The engine's fit of the simulated calibration."""
    (small, large), times = calibration_times(job, cluster, compute, emus)
    n = cluster.size
    return allocation.SpeedModel.fit(np.full(n, small), times[:, 0], np.full(n, large), times[:, 1],
                                     affine=job.dbs_model == "affine")


def first_vector(job: Job, n: int, fit: allocation.SpeedModel) -> np.ndarray:
    bounds = (job.min_local_batch, job.max_local_batch or None)
    if job.strategy == "ssgd":
        return allocation.equal(job.global_batch, n, *bounds)
    return participation.allocate_for(fit, job.global_batch, *bounds, job.participation)


def dbs_controller(job: Job, fit: allocation.SpeedModel) -> dynamic.DBSController:
    """The engine's DBS controller with the job's damping, starting from the calibration's fit."""
    return dynamic.DBSController(model=fit, global_batch=job.global_batch, min_local=job.min_local_batch,
                                    max_local=job.max_local_batch or None, smoothing=job.dbs_smoothing,
                                    follow=job.dbs_follow, min_gain=job.dbs_min_gain)


def startup_fit(job: Job, startup: dict, ranks: int) -> allocation.SpeedModel | None:
    """The engine's fit of a recorded start-up calibration (None if the run has none)."""
    if "step_time" not in startup:
        return None
    small, large = startup["local_batch"]
    times = startup["step_time"]
    return allocation.SpeedModel.fit(np.full(ranks, small), times[:, 0], np.full(ranks, large), times[:, 1],
                                     affine=job.dbs_model == "affine")


def simulate_sync(job: Job, cluster: Cluster, network: Network, noise: float = 0.03, seed: int = 0,
                  load: float = 1.0, vector=None, fit=None) -> Result:
    """ssgd, static or dbs, epoch by epoch and step by step. vector / fit: the start-up
    calibration's outcome if known (a replay), else the calibration is simulated. dbs
    re-plans with the engine's controller: every epoch, or with the engine's Replanner at
    its step interval, the vector applying from the step after its announcement (the
    simulated ranks prefetch nothing)."""
    rng = np.random.default_rng(seed)
    n = cluster.size
    compute, emus, result = Compute(job, cluster, noise, rng, load), emulators(job, n), Result()
    if fit is None:
        fit = simulated_calibration(job, cluster, compute, emus)
    vector = np.asarray(vector if vector is not None else first_vector(job, n, fit), dtype=np.int64)
    replanner = step_replanner(job, fit, n)
    controller = dbs_controller(job, fit) if job.strategy == "dbs" and replanner is None else None
    extra = 0 if replanner is None else replanner.size
    comm = network.exchange(n, buckets(job.model.numel, job.bucket_mb, job.first_bucket_mb, extra), cluster.sleeping,
                            cluster.crowded)
    if n > 1:          # what real steps take beyond the model (machine.py: measured once per machine)
        comm += job.residual.get("sync_crowded" if cluster.crowded else "sync", 0.0)
    clock = _SyncClock(compute, emus, comm, compute.update(), replanner)
    for epoch in range(job.epochs):
        table = sharding.step_batch_sizes(job.samples, job.global_batch, vector, job.drop_last)
        for e in emus:
            e.start_epoch(epoch, len(table))
        result.batch_sizes.append(vector.tolist())
        pre = clock.epoch(table, job)                                       # (steps, ranks)
        vector = clock.vector if clock.vector is not None else vector
        slowest = pre.max(axis=1)
        result.epoch_time.append(float((slowest + comm + clock.update).sum()))
        result.compute += float(pre.sum() + clock.update * pre.size)
        result.wait += float((slowest[:, None] - pre).sum())
        result.comm += float(comm * pre.size)
        if controller is not None:
            vector, _ = controller.update(vector, table, pre.sum(axis=0))
    return result


def step_replanner(job: Job, fit: allocation.SpeedModel, ranks: int) -> dynamic.Replanner | None:
    """The engine's within-epoch Replanner (rank 0's: the one whose proposals count), or None."""
    interval = parse_interval(job.dbs_interval)
    if job.strategy != "dbs" or interval is None or ranks == 1:
        return None
    return dynamic.Replanner(0, ranks, job.global_batch, job.min_local_batch, job.max_local_batch or None,
                             model=fit, interval=interval, window=job.dbs_window, follow=job.dbs_follow,
                             min_gain=job.dbs_min_gain, participation=job.participation)


class _SyncClock:
    """The steps of an epoch in simulated time: every rank's pre-collective seconds, the
    emulator's per-step windows, and (dbs within the epoch) the Replanner fed with what
    the engine's allreduce carries, its switches applied to the epoch's table."""

    def __init__(self, compute: Compute, emus, comm: float, update: float, replanner):
        self.compute, self.emus, self.comm, self.update, self.replanner = compute, emus, comm, update, replanner
        self.trained, self.run_steps, self.vector = 0.0, 0, None

    def epoch(self, table: np.ndarray, job: Job) -> np.ndarray:
        pre = np.zeros(table.shape)
        for s in range(len(table)):
            factor = np.array([e.factor for e in self.emus])
            pre[s] = self.compute.pre(table[s], factor, np.array([e.step_sleep for e in self.emus]))
            self.trained += float(pre[s].max() + self.comm + self.update)
            self.run_steps += 1
            for e in self.emus:
                e.step_done(self.trained)
            if self.replanner is not None:
                self._replan(table, s, pre[s], job)
        return pre

    def _replan(self, table: np.ndarray, s: int, seconds: np.ndarray, job: Job) -> None:
        r, n = self.replanner, table.shape[1]
        announced = np.zeros(n) if r.announce is None else r.announce.astype(float)
        r.announce = None
        summed = np.concatenate([seconds, np.full(n, s + 1.0), announced, [n]])     # nobody prefetches
        current = self.vector if self.vector is not None else table[0]
        switch = r.incoming(summed, table[s], current, s + 1)
        if switch is None:
            return
        self.vector = switch.vector
        if switch.first_step < len(table):
            rows = sharding.step_batch_sizes(job.samples, job.global_batch, switch.vector, job.drop_last)
            table[switch.first_step:] = rows[switch.first_step:]


# --- the asynchronous strategies (the parameter server) -------------------------------------

class ServerSim:
    """The parameter server's bookkeeping in simulated time: the engine's Cursor hands out
    the samples, gradients are applied in groups of c (sharding.group_size), an
    epoch closes when all its samples are applied, dbs-sgd re-plans at every epoch with the
    engine's DBSController. Checkpoint boundaries drain the workers (every one finishes its
    step and waits; the clock stops), as the engine does."""

    def __init__(self, job: Job, workers: int, vector, controller, checkpoint_every: int):
        self.job, self.workers, self.controller, self.every = job, workers, controller, checkpoint_every
        self.c = sharding.group_size(job.strategy, workers, job.softsync_n)
        self.wait_mode = job.strategy == "nsoftsync" and job.softsync_wait
        self.cursor = sharding.Cursor(job.samples, job.global_batch, job.epochs, job.drop_last, workers,
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


# --- replays and projections ----------------------------------------------------------------

# What a run recorded before these options existed did (dbs re-planned once per epoch).
LEGACY = {**config_mod.LEGACY, "dbs_window": 32, "slow_steps": (0, 0), "slow_seconds": (0.0, 0.0)}


def job_from_config(cfg: dict, model: ModelCost, data_per_sample: float) -> Job:
    samples = SPLIT_SIZES.get(cfg["dataset"], {}).get("train", cfg.get("synthetic_samples", 0))
    if cfg.get("subset"):
        samples = min(samples, cfg["subset"])
    cfg = {**LEGACY, **cfg}
    disturbances = {k: tuple(cfg[k]) if isinstance(cfg[k], list) else cfg[k]
                    for k in ("slow_rank", "slow_factor", "slow_epochs", "slow_steps", "slow_seconds", "sleep_prob",
                              "sleep_seconds", "sleep_epochs")}
    return Job(strategy=cfg["strategy"], model=model, samples=samples, global_batch=cfg["global_batch"],
               epochs=cfg["epochs"], speeds=tuple(cfg.get("speeds") or ()), drop_last=cfg["drop_last"],
               min_local_batch=cfg["min_local_batch"], max_local_batch=cfg["max_local_batch"],
               dbs_model=cfg["dbs_model"], dbs_smoothing=cfg["dbs_smoothing"], dbs_follow=cfg["dbs_follow"],
               dbs_min_gain=cfg["dbs_min_gain"], dbs_interval=str(cfg["dbs_interval"]), dbs_window=cfg["dbs_window"],
               participation=cfg["participation"], benchmark_steps=cfg["benchmark_steps"],
               softsync_n=cfg["softsync_n"], softsync_wait=cfg["softsync_wait"], seed=cfg["seed"],
               disturbances=disturbances, data_per_sample=data_per_sample, bucket_mb=cfg["bucket_mb"],
               first_bucket_mb=cfg["first_bucket_mb"])


def replay_job(path, machine: Machine) -> tuple[Job, Cluster, Network, dict, dict]:
    """(job, cluster, network, config, start-up calibration) of a recorded run's inputs."""
    inputs = read_inputs(path)
    cfg = inputs["config"]
    if cfg["model"] not in machine.models:
        raise ValueError(f"{path}: the machine file has no costs for model {cfg['model']!r}")
    shape = tuple(cfg["synthetic_shape"]) if cfg["dataset"] == "synthetic" else \
        ((3, 32, 32) if cfg["dataset"] == "cifar10" else (1, 28, 28))
    job = job_from_config(cfg, machine.models[cfg["model"]], machine.data_cost(shape))
    job.residual = dict(machine.residual)
    nodes, cores = placement_of(inputs, machine)
    cluster = Cluster(nodes=nodes, cores=cores, device=np.ones(len(nodes)), sleeping=inputs["sleeping"])
    network = Network(machine.alpha, machine.beta, "auto", machine.sleep_wait, machine.oversubscribed_message)
    return job, cluster, network, cfg, inputs["startup"]


def read_inputs(path) -> dict:
    """What a replay may read of a run: its configuration, placement and start-up
    calibration; never its epoch or step timings."""
    import h5py
    with h5py.File(path, "r") as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        startup = {k: f[f"startup/{k}"][()] for k in ("local_batch", "step_time", "batch_sizes")
                   if f"startup/{k}" in f and len(f[f"startup/{k}"])}      # (empty: killed before its calibration)
    return {"config": json.loads(attrs["config"]), "hostnames": list(attrs["hostnames"]),
            "rank_cores": list(attrs.get("rank_cores", [])), "sleeping": bool(attrs.get("sleep_while_waiting", False)),
            "startup": startup}


def placement_of(inputs: dict, machine: Machine) -> tuple[np.ndarray, list]:
    """(node of every rank, cores of every node): ranks of a host with the same affinity set
    share those cores; without affinity sets (older files), a host's ranks share its cores."""
    hosts, sets = inputs["hostnames"], inputs["rank_cores"] or [""] * len(inputs["hostnames"])
    keys = [(h, c) for h, c in zip(hosts, sets)]
    groups = sorted(set(keys))
    nodes = np.array([groups.index(k) for k in keys])
    cores = [len(c.split(",")) if c else machine.cores for _, c in groups]
    return nodes, cores


def load_factor(job: Job, cluster: Cluster, startup: dict) -> float:
    """How much slower than the machine constants the run's own calibration was (background
    load): the median over ranks and local batches of measured / simulated step times."""
    if "step_time" not in startup:
        return 1.0
    factor = np.array([e.factor for e in emulators(job, cluster.size)])
    compute = Compute(job, cluster, 0.0, None)
    simulated = np.stack([calibration_step(compute, cluster, factor, b) for b in startup["local_batch"]], axis=1)
    return float(max(1.0, np.min(startup["step_time"] / simulated)))


def replay(path, machine: Machine, noise: float | None = None, seed: int = 0) -> dict:
    """Predict a recorded run's epoch times from its inputs (read_inputs), then set the
    measured ones beside them. noise: the machine's measured step-time spread unless given."""
    job, cluster, network, cfg, startup = replay_job(path, machine)
    if noise is None:
        noise = machine_noise(machine, cluster)
    load = load_factor(job, cluster, startup)
    fit = startup_fit(job, startup, cluster.size)
    start = time.perf_counter()
    if job.strategy in SYNC:
        result = simulate_sync(job, cluster, network, noise, seed, load, startup.get("batch_sizes"), fit)
    else:
        result = simulate_async(job, cluster, network, noise, seed, load, None, fit, cfg["checkpoint_every"])
    result.simulate_seconds = time.perf_counter() - start
    return {"run": str(path), "strategy": job.strategy, "world_size": cluster.size, "load_factor": load,
            "status": inputs_status(path), **result.as_dict(), "epoch_time_measured": measured_epochs(path)}


def machine_noise(machine: Machine, cluster: Cluster) -> np.ndarray:
    """Every rank's spread of a step's compute time on the machine: larger on a node with
    more ranks than cores (the scheduler's time slices); 0.03 if the machine file does not say."""
    crowded = (np.bincount(cluster.nodes) > cluster.node_cores())[cluster.nodes]
    return np.where(crowded, machine.noise.get("crowded", DEFAULT_NOISE), machine.noise.get("alone", DEFAULT_NOISE))


def inputs_status(path) -> str:
    import h5py
    with h5py.File(path, "r") as f:
        status = f.attrs.get("status", "unknown")
    return status.decode() if isinstance(status, bytes) else str(status)


def measured_epochs(path) -> list[float]:
    import h5py
    with h5py.File(path, "r") as f:
        return [float(t) for t in f["epoch/duration"][()]] if "epoch/duration" in f else []


def _measured_note(out: dict) -> str:
    """A replayed run that recorded no epoch (it stopped, failed or was killed first)."""
    if "run" not in out or out.get("epoch_time_measured"):
        return ""
    return (f"{out['run']}: the run recorded no epoch (status {out.get('status', 'unknown')}): predictions "
            f"only, nothing measured to compare them with")


def speeds_from(args, ranks: int) -> np.ndarray:
    """Device speeds (1 = the fastest): log-uniform in [1/R, 1], or from a TOML file:
    `speeds = [...]`, or `[[mix]]` tables with name, speed and count. ValueError names
    what is wrong with the file."""
    if args.speeds:
        return _speeds_file(Path(args.speeds))
    rng = np.random.default_rng(args.seed)
    return np.exp(rng.uniform(-math.log(args.speed_spread), 0.0, size=ranks))


def _speeds_file(path: Path) -> np.ndarray:
    try:
        data = tomllib.loads(path.read_text())
        if "speeds" in data:
            speeds = np.asarray(data["speeds"], float)
        else:
            speeds = np.concatenate([np.full(int(m["count"]), float(m["speed"])) for m in data["mix"]])
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read {path} ({exc})") from None
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: give `speeds = [numbers]` or [[mix]] tables with name, speed and count") from None
    if speeds.ndim != 1 or not speeds.size or not np.all(np.isfinite(speeds) & (speeds > 0)):
        raise ValueError(f"{path}: speeds must be positive numbers, at least one")
    return speeds / speeds.max()


def projection(machine: Machine, speeds, strategy: str = "dbs", model: str = "resnet20", epochs: int = 3,
               samples: int = 50000, global_batch: int = 0, local_batch: int = 32, network=NETWORKS["ib-100g"],
               algorithm: str = "auto", ranks_per_node: int = 1, compute_scale: float = 1.0, noise: float = 0.03,
               seed: int = 0, dbs_interval: str = "1", participation: str = "auto") -> dict:
    """A run at scale: one rank per device of relative speed `speeds[i]` (1 = the fastest,
    which computes `compute_scale` times as fast as the machine's core), `ranks_per_node`
    ranks per node, each with its own cores; network = (alpha, beta)."""
    speeds = np.asarray(speeds, float)
    ranks = len(speeds)
    global_batch = global_batch or local_batch * ranks
    job = Job(strategy=strategy, model=machine.models[model], samples=samples, global_batch=global_batch,
              epochs=epochs, seed=seed, dbs_interval=str(dbs_interval),    # no residual: that is this machine's
              participation=participation)
    alpha, beta = network
    cluster = Cluster(nodes=np.arange(ranks) // ranks_per_node, cores=ranks_per_node, device=speeds * compute_scale)
    start = time.perf_counter()
    sim = simulate_sync if strategy in SYNC else simulate_async
    result = sim(job, cluster, Network(alpha, beta, algorithm), noise, seed)
    result.simulate_seconds = time.perf_counter() - start
    return {"ranks": ranks, "strategy": strategy, "model": model, "global_batch": global_batch,
            "network": {"alpha": alpha, "beta": beta, "algorithm": algorithm},
            "speeds": {"min": float(speeds.min()), "median": float(np.median(speeds)), "max": float(speeds.max())},
            **result.as_dict()}


def project(args, machine: Machine) -> dict:
    """`dbs-mpi simulate --ranks/--speeds`: projection() from the command's arguments."""
    network = NETWORKS[args.network] if args.network in NETWORKS else tuple(map(float, args.network.split(",")))
    return projection(machine, speeds_from(args, args.ranks), args.strategy, args.model, args.epochs, args.samples,
                      args.global_batch, args.local_batch, network, args.algorithm, args.ranks_per_node,
                      args.compute_scale, DEFAULT_NOISE if args.noise is None else args.noise, args.seed,
                      args.dbs_interval, args.participation)


# --- the command ---------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dbs-mpi simulate", description="Replay a run (--from) or project one at scale (--ranks or "
                "--speeds); `dbs-mpi simulate calibrate` measures the machine constants.")
    p.add_argument("--from", dest="source", metavar="RUN.h5", help="replay this result file from its configuration "
                   "and start-up calibration")
    p.add_argument("--machine", metavar="FILE", help="machine constants (default: results/machine/dev-2core.json)")
    p.add_argument("--ranks", type=int, default=0, help="projection: ranks (one per device)")
    p.add_argument("--strategy", default="dbs", choices=[*SYNC, *ASYNC])
    p.add_argument("--model", default="resnet20", help="projection: a model of the machine file")
    p.add_argument("--speed-spread", type=float, default=1.0, metavar="R",
                   help="projection: device speeds log-uniform in [1/R, 1]")
    p.add_argument("--speeds", metavar="FILE.toml", help="projection: speeds = [...] or [[mix]] name/speed/count")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=50000, help="projection: training samples (default: CIFAR-10's)")
    p.add_argument("--local-batch", type=int, default=32, help="projection: B = this x ranks unless --global-batch")
    p.add_argument("--global-batch", type=int, default=0)
    p.add_argument("--network", default="ib-100g", help=f"{', '.join(NETWORKS)} or ALPHA,BETA (seconds, s/byte)")
    p.add_argument("--algorithm", default="auto", choices=["auto", "ring", "tree"])
    p.add_argument("--compute-scale", type=float, default=1.0, metavar="K",
                   help="projection: the fastest device is K times the machine's core")
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--compare", metavar="STRATEGY", help="projection: also simulate this strategy; report the speed-up")
    p.add_argument("--noise", type=float, metavar="SIGMA", help="lognormal sigma of every compute time (default: "
                   f"the machine file's for a replay, {DEFAULT_NOISE} for a projection)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dbs-interval", default="1", metavar="N|epoch", help="projection: dbs re-plans every N steps, "
                   "or once per epoch (as `dbs-mpi train`)")
    p.add_argument("--participation", default="auto", choices=["auto", "all"], help="projection: static and dbs "
                   "leave out a rank that would slow every step (auto), or keep every rank (all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _print(out: dict) -> None:
    pred, meas = out["epoch_time_predicted"], out.get("epoch_time_measured")
    lines = [f"{'epoch':>5} {'predicted s':>12}" + (f" {'measured s':>11} {'error':>7}" if meas else "")]
    for e, t in enumerate(pred):
        row = f"{e + 1:>5} {t:>12.3f}"
        if meas and e < len(meas):
            row += f" {meas[e]:>11.3f} {100 * (t / meas[e] - 1):>+6.1f}%"
        lines.append(row)
    lines.append(f"compute {100 * out['compute_share']:.1f}%, comm {100 * out['comm_share']:.1f}%, wait "
                 f"{100 * out['wait_share']:.1f}%; simulated in {out['simulate_seconds']:.2f} s")
    if "speedup" in out:
        lines.append(f"speed-up over {out['compared']}: {out['speedup']:.3f}x")
    if _measured_note(out):
        lines.append(_measured_note(out))
    print("\n".join(lines))


def mpi_bcast_tmp(comm) -> str:
    """A temporary folder that every rank of comm agrees on (rank 0 makes it)."""
    import tempfile

    return mpi.bcast_object(comm, tempfile.mkdtemp(prefix="dbs-mpi-calibrate-") if comm.Get_rank() == 0 else None)


def _setup(argv):
    """Arguments and machine constants, checked (under comm.agree: a mistake is one line)."""
    args = _parser().parse_args(argv)
    if not args.source and not (args.ranks or args.speeds):
        raise UserError("simulate: give --from RUN.h5, or --ranks N (or --speeds FILE.toml)")
    try:
        machine = Machine.load(args.machine)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"machine: cannot read {args.machine or 'the default machine file'} ({exc})") from None
    if args.source and not Path(args.source).is_file():
        raise UserError(f"from: no such result file {args.source}")
    if not args.source and args.model not in machine.models:
        raise UserError(f"model: the machine file has no costs for {args.model!r} (it has {', '.join(machine.models)})")
    if args.ranks < 0 or args.epochs < 1 or args.samples < 1 or args.compute_scale <= 0 or args.ranks_per_node < 1:
        raise UserError("simulate: --ranks, --epochs, --samples, --compute-scale and --ranks-per-node must be positive")
    _check_values(args, machine)
    return args, machine


def _check_values(args, machine: Machine) -> None:
    """The options' values, each refused with one line that names it."""
    if args.noise is not None and not args.noise >= 0:
        raise UserError(f"noise: must be 0 or more, got {args.noise}")
    if not args.speed_spread >= 1:
        raise UserError(f"speed-spread: must be at least 1 (speeds log-uniform in [1/R, 1]), got {args.speed_spread}")
    parse_interval(args.dbs_interval)                               # one line naming dbs_interval
    if args.network not in NETWORKS:
        try:
            alpha, beta = (float(v) for v in args.network.split(","))
        except ValueError:
            alpha = beta = -1.0
        if not (alpha >= 0 and beta >= 0):
            raise UserError(f"network: one of {', '.join(NETWORKS)}, or ALPHA,BETA (seconds, s/byte); "
                            f"got {args.network!r}")
    if args.speeds:
        try:
            _speeds_file(Path(args.speeds))
        except ValueError as exc:
            raise UserError(f"speeds: {exc}") from None
    if args.source:
        try:
            replay_job(args.source, machine)
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise UserError(f"from: {args.source} is no dbs-mpi result file this machine file can replay "
                            f"({exc})") from None


def main(comm, argv) -> int:
    if argv[:1] == ["calibrate"]:
        return _calibrate(comm, argv[1:])
    args, machine = mpi.agree(comm, _setup, argv)
    if comm.Get_rank() != 0:                     # the simulation is one process's work
        return 0
    if args.source:
        out = replay(args.source, machine, args.noise, args.seed)
    else:
        out = project(args, machine)
        if args.compare:
            other = project(argparse.Namespace(**{**vars(args), "strategy": args.compare}), machine)
            out.update(compared=args.compare, epoch_time_compared=other["epoch_time_predicted"],
                       speedup=sum(other["epoch_time_predicted"]) / sum(out["epoch_time_predicted"]))
    if args.json:
        print(json.dumps(out))
    else:
        _print(out)
    return 0


def residual_runs(cores: int, world: int) -> dict:
    """The real runs whose time beyond the model is the machine's residual: name ->
    (ranks, strategy). Equal speeds, LeNet-5 on synthetic data."""
    runs = {"sync": (min(max(cores, 2), world), "ssgd"), "async": (min(cores + 1, world), "asgd")}
    if world > cores:
        runs["sync_crowded"] = (world, "ssgd")
    return runs


def measure_residuals(comm, machine: Machine, folder: Path) -> dict:
    """Collective. Seconds real runs of this machine take beyond the model, per synchronous
    step ("sync": ranks on their own cores; "sync_crowded": more ranks than cores) and per
    gradient of a parameter-server worker ("async"): each is one short run of the engine
    (train.train on a sub-communicator; the other ranks sleep), replayed without residual;
    the median over its epochs after the first of (measured - predicted) / steps."""
    from .train import train             # the engine (torch): only calibrating runs it
    runs, residual = residual_runs(machine.cores, comm.Get_size()), {}
    for name, (ranks, strategy) in runs.items():
        member = comm.Get_rank() < ranks
        sub = comm.Split(0 if member else 1)
        if member and ranks >= 2:
            cfg = Config(dataset="synthetic", synthetic_samples=6000, test_subset=100, model="lenet5", epochs=3,
                         global_batch=64 * (ranks - (strategy == "asgd")), strategy=strategy, benchmark_steps=3,
                         checkpoint_every=0, progress=False, threads=1)
            train(sub, cfg, out=str(folder / f"{name}.h5"), log=lambda msg: None)
        sub.Free()
        mpi.barrier(comm, timeout=3600)
    if comm.Get_rank() == 0:
        machine.residual = {}
        machine.noise = {"alone": _spread(folder / "sync.h5")}
        machine.noise["crowded"] = _spread(folder / "sync_crowded.h5") if "sync_crowded" in runs else \
            machine.noise["alone"]
        for name in runs:
            residual[name] = _residual(folder / f"{name}.h5", machine)
    return residual


def _spread(path: Path) -> float:
    """Lognormal sigma of a step's compute time in a run of equal ranks: the standard
    deviation of log(compute time) over the steps after the first epoch, median over ranks."""
    import h5py
    with h5py.File(path, "r") as f:
        times, epoch = f["step/compute_time"][()], f["step/epoch"][()]
    logs = np.log(np.maximum(times[epoch > 0], 1e-9))
    return float(np.median(logs.std(axis=0)))


def _residual(path: Path, machine: Machine) -> float:
    """Seconds per step (synchronous) or per gradient (a parameter-server worker) that a
    residual run took beyond its replay (machine.residual is empty while it is measured)."""
    out = replay(path, machine, seed=0)
    job = replay_job(path, machine)[0]
    if job.strategy in SYNC:
        per = sharding.steps_per_epoch(job.samples, job.global_batch, job.drop_last)
    else:
        per = job.samples / job.global_batch           # gradients per worker and epoch (equal local batches)
    pairs = list(zip(out["epoch_time_measured"], out["epoch_time_predicted"]))[1:]
    return max(0.0, float(np.median([(m - p) / per for m, p in pairs])))


def _calibrate(comm, argv) -> int:
    p = ArgumentParser(prog="dbs-mpi simulate calibrate", description="Measure the machine constants (run under "
                "mpirun -n 2 on one node, nothing else running).")
    p.add_argument("--out", required=True, metavar="FILE.json")
    p.add_argument("--name", default="this machine")
    args = p.parse_args(argv)
    if comm.Get_size() < 2:
        raise UserError("simulate calibrate: run it under mpirun -n 2 or more, on one node (mpirun -n 4 on a "
                        "2-core machine also measures crowded collectives)")
    machine = calibrate(comm, args.name)
    folder = Path(mpi_bcast_tmp(comm))
    machine.residual = measure_residuals(comm, machine, folder)
    if comm.Get_rank() == 0:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
        machine.save(args.out)
        print(f"machine constants: {args.out} (alpha {machine.alpha * 1e6:.2f} us, beta "
              f"{1 / machine.beta / 1e9:.2f} GB/s, sleeping wait {machine.sleep_wait * 1e6:.0f} us, crowded "
              f"message {machine.oversubscribed_message * 1e6:.0f} us, {machine.cores} cores; step-time spread "
              + ", ".join(f"{k} {v:.3f}" for k, v in machine.noise.items()) + "; residuals "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in machine.residual.items()) + ")")
    return 0
