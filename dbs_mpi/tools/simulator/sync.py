"""The synchronous strategies (ssgd, static, dbs), epoch by epoch and step by step: every
rank reads its batch and computes; the allreduce starts when the last rank is done; then
every rank updates. wait_i = max_j pre_j - pre_i. The start-up calibration is the
engine's (its batches and fit), simulated or read from a recorded run; dbs re-plans with
the engine's DBSController every epoch, or with its Replanner within the epoch.
"""
from __future__ import annotations

import math

import numpy as np

from ...options import parse_interval
from ...planning import allocation, calibration, coupling, dynamic, participation, sharding
from ...planning.dynamic.set_check import TRIAL_FIRST
from .adaptive import next_batch, resized
from .cluster import Cluster, Compute, emulators, free_running_rate, step_factor
from .job import Job, Result
from .network import Network, buckets


def calibration_step(compute: Compute, cluster: Cluster, factor: np.ndarray, local_batch,
                     computing=None) -> np.ndarray:
    """Every rank's calibration step at `local_batch` (one, or one per rank), the ranks'
    loops unsynchronised (free_running_rate), the emulated slow-down included (seconds,
    per rank); computing (bool per rank, None: all): the ranks that compute, the others
    take no core."""
    busy = factor if computing is None else np.where(computing, factor, np.inf)
    rate = free_running_rate(cluster.nodes, busy, cluster.node_cores())
    work = compute.work(np.zeros(cluster.size) + local_batch)
    return work / rate + work * (factor - 1.0)


def calibration_times(job: Job, cluster: Cluster, compute: Compute, emus) -> tuple[tuple, np.ndarray]:
    """The start-up calibration as the engine runs it (balancer.calibrate): the medians of
    benchmark_steps steps at two local batches, those of a rank much slower at the tiny
    batch read off its tiny and its own second batch, a slower rank's large one its own
    and read off (planning/calibration.py). Returns
    ((small, large), (ranks x 2) seconds)."""
    small, large = allocation.calibration_batches(job.global_batch, cluster.size, job.min_local_batch,
                                                  job.max_local_batch or None)
    factor = step_factor(emus, cluster)              # every rank computes: a coupled rank is timed coupled

    def timed(b, steps: int) -> np.ndarray:
        return np.median([calibration_step(compute, cluster, factor, b) for _ in range(steps)], axis=0)
    tiny = timed(calibration.tiny_batch(small), calibration.TINY_STEPS)
    first = np.where(calibration.slow(tiny), np.nan, timed(small, job.benchmark_steps))
    larges = calibration.large_batches(first, small, large)     # a slower rank's own large batch
    times = np.stack([first, timed(larges, job.benchmark_steps)], axis=1)
    second = calibration.second_batch(tiny, small)      # a slow rank's own batch
    if second.any():
        times[second > 0, 0] = timed(second, calibration.TINY_STEPS)[second > 0]
    times = calibration.read_off(times, small, large, larges)
    return (small, large), calibration.completed(tiny, times, small, large)


def simulated_calibration(job: Job, cluster: Cluster, compute: Compute, emus) -> allocation.SpeedModel:
    """The engine's fit of the simulated calibration."""
    return simulated_start(job, cluster, compute, emus)[0]


def simulated_start(job: Job, cluster: Cluster, compute: Compute, emus) -> tuple:
    """The simulated calibration as the engine runs it: its fit, and its check for coupled
    ranks (coupling.py: the fastest ranks time the large batch again, nobody else
    computing) as coupling.decide's (coupling.Start or None, the first trial's wait)."""
    (small, large), times = calibration_times(job, cluster, compute, emus)
    n = cluster.size
    fit = allocation.SpeedModel.fit(np.full(n, small), times[:, 0], np.full(n, large), times[:, 1],
                                    affine=job.dbs_model == "affine")
    hosts, bounds = _hosts(cluster), (job.min_local_batch, job.max_local_batch or None)
    plan = participation.allocate_for(fit, job.global_batch, *bounds, job.participation)
    alone = coupling.timed_alone(fit, hosts, job.participation, _checked(job, n), plan)
    if alone is None:
        return (fit, *coupling.decide(fit, times[:, 1], None, hosts, job.participation, _checked(job, n),
                                      job.global_batch, *bounds))
    factor = step_factor(emus, cluster, alone.astype(np.int64))
    steps = min(job.benchmark_steps, coupling.ALONE_STEPS)
    seconds = np.median([calibration_step(compute, cluster, factor, large, alone) for _ in range(steps)], axis=0)
    return (fit, *coupling.decide(fit, times[:, 1], seconds, hosts, job.participation, True, job.global_batch,
                                  *bounds))


def recorded_start(job: Job, cluster: Cluster, startup: dict, fit: allocation.SpeedModel | None) -> tuple:
    """The engine's decision from a recorded calibration, coupling.decide's (coupling.Start
    or None, the first trial's wait); (None, TRIAL_FIRST) where no calibration is known."""
    if fit is None:
        return None, TRIAL_FIRST
    alone = startup.get("alone_time")
    return coupling.decide(fit, np.asarray(startup["step_time"])[:, 1],
                           None if alone is None or not len(alone) else alone, _hosts(cluster),
                           job.participation, _checked(job, cluster.size), job.global_batch, job.min_local_batch,
                           job.max_local_batch or None)


def _hosts(cluster: Cluster) -> list:
    return list(cluster.nodes if cluster.hosts is None else cluster.hosts)


def _checked(job: Job, ranks: int) -> bool:
    """Whether a set check follows the start (dbs's within-epoch planner: step_replanner)."""
    return job.strategy == "dbs" and parse_interval(job.dbs_interval) is not None and ranks > 1


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
                  load: float = 1.0, vector=None, fit=None, start=(None, TRIAL_FIRST)) -> Result:
    """ssgd, static or dbs, epoch by epoch and step by step. vector / fit / start: the
    start-up calibration's outcome if known (a replay; start: recorded_start), else the
    calibration is simulated, its check for coupled ranks too (start: coupling.Start or
    None, and the steps before the first trial of the fastest ranks alone, as the engine's). dbs
    re-plans with the engine's controller: every epoch, or with the engine's Replanner at
    its step interval, the vector applying from the step after its announcement (the
    simulated ranks prefetch nothing)."""
    rng = np.random.default_rng(seed)
    n = cluster.size
    compute, emus, result = Compute(job, cluster, noise, rng, load), emulators(job, n), Result()
    if fit is None:
        fit, *start = simulated_start(job, cluster, compute, emus)
    coupled, first_trial = start
    if coupled is not None:
        fit, vector = coupled.model, coupled.vector if vector is None else vector
    vector = np.asarray(vector if vector is not None else first_vector(job, n, fit), dtype=np.int64)
    replanner = step_replanner(job, fit, cluster, first_trial, coupled)
    controller = dbs_controller(job, fit) if job.strategy == "dbs" and replanner is None else None
    extra = 0 if replanner is None else replanner.size
    clock = _SyncClock(compute, emus, ExchangeCost(job, cluster, network, extra), compute.update(), replanner)
    global_batch, fixed = int(vector.sum()), 0.0
    for epoch in range(job.epochs):
        if epoch:                                          # global_batch = auto (adaptive.py)
            model = dynamic.planning_model(replanner, controller, fit)
            chosen = next_batch(job, epoch, global_batch, model, fixed, n, replanner, vector)
            if chosen != global_batch:
                vector = resized(job, chosen, model, n, replanner, controller, clock.comm, vector)
                global_batch = chosen
                clock.vector = None                        # (a switch of the old B's does not carry over)
        table = sharding.step_batch_sizes(job.samples, global_batch, vector, job.drop_last)
        for e in emus:
            e.start_epoch(epoch, len(table))
        result.batch_sizes.append(vector.tolist())
        pre, comm = clock.epoch(table, job)                                 # (steps, ranks), (steps,)
        vector = clock.vector if clock.vector is not None else vector
        slowest = pre.max(axis=1)
        fixed = float(np.median(comm)) + clock.update
        result.epoch_time.append(float((slowest + comm + clock.update).sum()))
        result.compute += float(pre.sum() + clock.update * pre.size)
        result.wait += float((slowest[:, None] - pre).sum())
        result.comm += float(comm.sum() * pre.shape[1])
        if controller is not None:
            vector, _ = controller.update(vector, table, pre.sum(axis=0))
    return result


def step_replanner(job: Job, fit: allocation.SpeedModel, cluster: Cluster,
                   first_trial: int = TRIAL_FIRST, coupled=None) -> dynamic.Replanner | None:
    """The engine's within-epoch Replanner (rank 0's: the one whose proposals count), or
    None; started as the engine starts it: the ranks' hosts (where ranks share one, the
    planner tries sets: set_check.py), and the first trial's wait and coupled, the
    calibration's (coupling.decide: the wait, and its Start or None)."""
    interval = parse_interval(job.dbs_interval)
    if job.strategy != "dbs" or interval is None or cluster.size == 1:
        return None
    replanner = dynamic.Replanner(0, cluster.size, job.global_batch, job.min_local_batch,
                                  job.max_local_batch or None, interval=interval, window=job.dbs_window,
                                  follow=job.dbs_follow, min_gain=job.dbs_min_gain, participation=job.participation,
                                  hosts=_hosts(cluster))
    replanner.start_from(fit, first_trial, coupled)
    return replanner


class ExchangeCost:
    """Seconds of a step's exchange as the engine runs it (training/participants.py): the
    gradient summed over rank 0 and the ranks with samples (an epoch's partial last step
    keeps the group it follows); where that leaves ranks out, every rank also sums the
    step's few extra values, and a rank that fell behind gets rank 0's model and
    optimizer state (a broadcast of twice the model: SGD's momentum) before it takes part
    again and after the epoch's last step."""

    def __init__(self, job: Job, cluster: Cluster, network: Network, extra: int):
        self.n, self.global_batch, self.cluster, self.network = cluster.size, job.global_batch, cluster, network
        self.sizes = buckets(job.model.numel, job.bucket_mb, job.first_bucket_mb, extra)
        self.tail = 4.0 * (1 + extra)
        self.catch_up = math.ceil(math.log2(max(self.n, 2))) * network.message(8.0 * job.model.numel)
        # what real steps take beyond the model (machine.py: measured once per machine)
        self.residual = job.residual.get("sync_crowded" if cluster.crowded else "sync", 0.0) if self.n > 1 else 0.0
        self.group, self.stale, self.cache = set(range(self.n)), set(), {}

    def __call__(self, row, last: bool = False) -> float:
        group = {0, *np.flatnonzero(row).tolist()} | (self.group if int(np.sum(row)) < self.global_batch else set())
        seconds = 0.0
        if self.stale & group:           # a returning rank: every stale rank catches up
            seconds, self.stale = self.catch_up, set()
        self.group = group
        k = len(group)
        if k not in self.cache:
            c = self.cluster
            self.cache[k] = self.network.exchange(k, self.sizes, c.sleeping, c.crowded) + self.residual + (
                self.network.allreduce(self.n, self.tail) if k < self.n else 0.0)
        self.stale |= set(range(self.n)) - group
        if last and self.stale:
            seconds += self.catch_up
            self.stale, self.group = set(), set(range(self.n))
        return self.cache[k] + seconds


class OwnProbeSizes:
    """Every rank's prober state in the simulator: the size of its next own-time probe by
    dynamic.own_probe_size, the rule training/prober.py follows (the last small probe's
    seconds, whether it ran twice as fast as the one before, both forgotten when a rank
    begins to sit out; the steps' mean interval, where the prober counts only the steps
    it sat out). The prober's duty spacing is not simulated: a probe follows the last."""

    def __init__(self, ranks: int):
        self.since_large = np.full(ranks, dynamic.LARGE_EVERY)
        self.last_small = [None] * ranks
        self.sped_up, self.out = np.zeros(ranks, bool), np.zeros(ranks, bool)
        self.step_time, self.small = 0.0, 2

    def stepped(self, seconds: float) -> None:
        self.step_time = 0.8 * self.step_time + 0.2 * seconds

    def sat_out(self, out: np.ndarray) -> None:
        """The ranks that sit out in this step: those that did not in the last start afresh."""
        for rank in np.flatnonzero(out & ~self.out):
            self.last_small[rank], self.sped_up[rank] = None, False
        self.out = np.array(out, bool)

    def next(self, due: np.ndarray, job: Job, global_batch: int) -> np.ndarray:
        small, large = dynamic.own_probe_bounds(job.min_local_batch, global_batch, len(due), job.max_local_batch)
        small = self.small = min(small, large)          # (the prober keeps at most `large` samples)
        sizes = np.full(len(due), small)
        for rank in np.flatnonzero(due):
            self.since_large[rank] += 1
            sizes[rank] = dynamic.own_probe_size(small, large, self.since_large[rank] >= dynamic.LARGE_EVERY or
                                                 self.sped_up[rank], self.last_small[rank], self.step_time)
            self.since_large[rank] = 0 if sizes[rank] > small else self.since_large[rank]
        return sizes

    def measured(self, due: np.ndarray, sizes: np.ndarray, seconds: np.ndarray) -> None:
        for rank in np.flatnonzero(due):
            self.last_small[rank], self.sped_up[rank] = dynamic.after_own_probe(
                sizes[rank], self.small, float(seconds[rank]), self.last_small[rank], self.sped_up[rank])


class _SyncClock:
    """The steps of an epoch in simulated time: every rank's pre-collective seconds, the
    emulator's per-step windows, and (dbs within the epoch) the Replanner fed with what
    the engine's allreduce carries, its switches applied to the epoch's table."""

    def __init__(self, compute: Compute, emus, comm: float, update: float, replanner):
        self.compute, self.emus, self.comm, self.update, self.replanner = compute, emus, comm, update, replanner
        self.trained, self.run_steps, self.vector = 0.0, 0, None
        self.probe_end = np.zeros(len(emus))      # when every rank's own-time probe under way ends
        self.sizes = OwnProbeSizes(len(emus))     # ... and at how many samples the next one runs

    def epoch(self, table: np.ndarray, job: Job) -> tuple[np.ndarray, np.ndarray]:
        pre, comm = np.zeros(table.shape), np.zeros(len(table))
        for s in range(len(table)):
            factor = step_factor(self.emus, self.compute.cluster, table[s])
            pre[s] = self.compute.pre(table[s], factor, np.array([e.step_sleep for e in self.emus]))
            comm[s] = self.comm(table[s], last=s == len(table) - 1)
            seconds = float(pre[s].max() + comm[s] + self.update)
            self.sizes.stepped(seconds)
            self.trained += seconds
            self.run_steps += 1
            for e in self.emus:
                e.step_done(self.trained)
            if self.replanner is not None:
                self._replan(table, s, pre[s], job)
        return pre, comm

    def _probes(self, row: np.ndarray, factor, job: Job) -> tuple[np.ndarray, np.ndarray]:
        """The probes ranks that sit out run on their own time (training/prober.py): a rank
        reports one at the first step after the last one ended, at the samples its prober
        would choose (OwnProbeSizes: its own compute at that batch, stretched as the
        engine's), busy for twice its time (a warm-up pass runs first, as long on a real
        device; the engine stretches only the timed pass to an emulated speed); nobody waits for it."""
        out = row == 0
        samples, seconds = np.zeros(len(row)), np.zeros(len(row))
        self.sizes.sat_out(out)
        if not out.any():
            return samples, seconds
        due = out & (self.probe_end <= self.trained)
        sizes = self.sizes.next(due, job, int(row.sum()))
        times = self.compute.pre(np.where(due, sizes, 0), factor, np.array([e.step_sleep for e in self.emus]))
        samples[due], seconds[due] = sizes[due], times[due]
        self.sizes.measured(due, sizes, times)
        self.probe_end = np.where(due, self.trained + 2 * times, self.probe_end)
        return samples, seconds

    def _replan(self, table: np.ndarray, s: int, seconds: np.ndarray, job: Job) -> None:
        r, n = self.replanner, table.shape[1]
        announced = np.zeros(n) if r.announce is None else r.announce.astype(float)
        r.announce = None
        probe_samples, probe_seconds = self._probes(table[s], step_factor(self.emus, self.compute.cluster, table[s]),
                                                    job)
        summed = np.concatenate([seconds, np.full(n, s + 1.0), announced, probe_seconds, probe_samples, [n]])
        current = self.vector if self.vector is not None else table[0]
        switch = r.incoming(summed, table[s], current, s + 1)
        if switch is None:
            return
        self.vector = switch.vector
        if switch.first_step < len(table):
            rows = sharding.step_batch_sizes(job.samples, int(switch.vector.sum()), switch.vector, job.drop_last)
            table[switch.first_step:] = rows[switch.first_step:]
