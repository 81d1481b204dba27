"""The cluster and the compute model: where the ranks run, and what their steps cost.

* compute: a rank's forward and backward at local batch b costs w(b) core-seconds (the
  machine's measured table, tools/machine.py) divided by its device speed, times lognormal
  noise; an emulated slow-down (a sleep of (1/s - 1) times the compute's CPU time, plus
  the epoch's disturbance) uses no core; in a replay, a training step's compute takes
  the machine's compute_extra more (what the engine's step adds to the bare model's, measured
  by the calibration; more on a rank that sleeps); a coupled rank (`--couple`) is K times slower in a
  step where another rank of its host computes (Emulator.factor_with), in the calibration
  too (every rank computes there);
* cores: the ranks of a node share its cores (processor sharing: while k ranks compute on
  C cores, each runs at min(1, C/k) of a core), which is what makes 4 ranks on 2 cores
  slower than their parts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...planning.heterogeneity import Emulator, others_compute
from .job import Job

DEFAULT_NOISE = 0.03                           # lognormal sigma of a step's compute time (projections)


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
    hosts: np.ndarray | None = None  # host of every rank, which coupled speeds follow (None: the nodes)

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def crowded(self) -> bool:
        """Some node runs more ranks than it has cores."""
        return bool(np.any(np.bincount(self.nodes) > self.node_cores()))

    def others_compute(self, row=None) -> np.ndarray:
        """Whether another rank of every rank's host computes in a step of local batches `row`
        (None: every rank computes, as in the calibration)."""
        return others_compute(self.nodes if self.hosts is None else self.hosts, row)

    def node_cores(self) -> np.ndarray:
        """Cores of every node, indexed by node."""
        count = int(self.nodes.max()) + 1
        return np.full(count, self.cores, dtype=float) if np.isscalar(self.cores) else np.asarray(self.cores, float)


def emulators(job: Job, ranks: int) -> list[Emulator]:
    """The engine's emulator of every rank (the same draws as the real run's)."""
    top = max(job.speeds) if job.speeds else 1.0
    return [Emulator(r, job.speeds[r] / top if job.speeds else 1.0, seed=job.seed, couple=job.couple.get(r, 1.0),
                     **job.disturbances) for r in range(ranks)]


def step_factor(emus, cluster: Cluster, row=None) -> np.ndarray:
    """Every rank's compute-time multiplier in a step of local batches `row` (None: every
    rank computes): its emulated speed and disturbance, its coupling (Emulator.factor_with)."""
    others = cluster.others_compute(row)
    return np.array([e.factor_with(bool(o)) for e, o in zip(emus, others)])


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
        work = self.work(local_batches) + self.extra(local_batches, factor)
        wall = processor_sharing(work + data, self.cluster.nodes, self.cluster.node_cores())
        return wall + work * (factor - 1.0) + sleep      # the engine stretches the CPU work of every step

    def extra(self, local_batches: np.ndarray, factor: np.ndarray) -> np.ndarray:
        """Core-seconds a training step's compute takes beyond the model's table on every rank
        with samples (Machine.compute_extra: "sleeping" where an emulated slow-down sleeps
        after it, else "spinning"; 0 where the machine file does not say)."""
        extra = self.job.compute_extra
        if not extra:
            return 0.0
        per = np.where(np.asarray(factor) > 1.0, extra.get("sleeping", 0.0), extra.get("spinning", 0.0))
        return np.where(np.asarray(local_batches) > 0, per * self.load, 0.0)

    def update(self) -> float:
        """Seconds of the optimizer update and the loop's own work, all ranks at once."""
        crowd = np.max(np.bincount(self.cluster.nodes) / self.cluster.node_cores())
        return (self.job.model.update + self.job.model.overhead) * self.load * max(1.0, crowd)
