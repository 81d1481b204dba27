"""Machine constants for the simulator, and the micro-benchmark that measures them.

    mpirun -n 2 dbs-mpi simulate calibrate      # this machine's file, results/machine/<fingerprint>.json

measures once, on a quiet machine:

* for every built-in model at its usual input shape: the seconds of one forward and
  backward pass at local batches 1, 2, 4, ... 512 (one torch thread, medians), the
  seconds of one optimizer update (SGD with momentum), and the framework's own cost per
  step (a DistributedOptimizer step at 1 rank, less the forward, backward and update);
* the seconds per sample of reading a batch out of an in-memory dataset;
* the gradient allreduce (exchange.GradientExchange, spin policy) at several message sizes
  between 2 ranks of one node, fitted to alpha + m * beta (one message each way);
* what a sleeping wait adds to a collective (the wait policy "sleep");
* with more ranks than cores (e.g. `mpirun -n 4` on 2 cores): what every message of an
  allreduce of all ranks adds when they share cores (each waits for its peer to be
  scheduled);
* the node's cores, and what it was measured on (fingerprint.describe);
* (simulator/calibration.py, with real runs of the engine) the residuals, the spread of a
  step's compute time, and the compute a training step adds to the table (compute_extra).

`--quick` measures the same constants from far fewer points (Effort: QUICK), in seconds
instead of many minutes: a sane machine file for a test, not one to keep.

The simulator (simulator/) replays and projects runs from these numbers and a run's
configuration; they are kept in a JSON file (results/machine/dev-2core.json: the
development machine; results/machine/<fingerprint>.json: a machine calibrated since).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .fingerprint import FALLBACK, describe

BATCHES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
SHAPES = {"lenet5": (1, 28, 28), "mlp": (1, 28, 28), "resnet20": (3, 32, 32), "cifar-cnn": (3, 32, 32)}
DEFAULT_MACHINE = FALLBACK          # Machine.load()'s: the development machine's (fingerprint.machine_file: this machine's)


@dataclass(frozen=True)
class Effort:
    """How much a calibration measures: FULL for a machine file to keep, QUICK (`simulate
    calibrate --quick`) for the same constants from a few points, in seconds."""
    name: str = "full"
    batches: tuple = BATCHES            # local batches of every model's table of step times
    repeats: int = 15                   # timed calls per point (medians)
    overhead_steps: int = 100           # steps of each epoch of loop_overhead ...
    overhead_seconds: float = 1.0       # ... fewer (at least OVERHEAD_MIN_STEPS) where its bare epoch would take longer
    overhead_pairs: int = 7             # loop_overhead's timed pairs of epochs (after one untimed)
    data_repeats: int = 30              # batches read by measure_data
    allreduce_sizes: tuple = (2 ** 10, 2 ** 14, 2 ** 17, 2 ** 19, 2 ** 21)   # bytes of the 2-rank allreduces
    allreduce_repeats: int = 200        # allreduces per size and wait policy
    crowding_repeats: int = 100         # allreduces per size with more ranks than cores
    residual_samples: int = 6000        # synthetic training samples of each residual run (calibration.py)
    residual_epochs: int = 3            # epochs of each residual run (the first is not counted)


OVERHEAD_MIN_STEPS = 10       # the fewest steps of an epoch of loop_overhead


FULL = Effort()
QUICK = Effort(name="quick", batches=(1, 4, 16), repeats=3, overhead_steps=5, overhead_pairs=1, data_repeats=5,
               allreduce_sizes=(2 ** 10, 2 ** 17, 2 ** 20), allreduce_repeats=20, crowding_repeats=10,
               residual_samples=1280, residual_epochs=2)


@dataclass
class ModelCost:
    """One model's costs on one core of the machine."""
    batches: list               # local batches measured
    step_time: list             # seconds of forward + backward at each
    update: float               # seconds of one optimizer update (SGD, momentum)
    overhead: float             # seconds per step of the training loop's own work
    numel: int                  # parameters (4 bytes each in the gradient exchange)
    add: float = 0.0            # seconds of adding one gradient into an accumulator (the parameter server)

    def compute(self, local_batch) -> np.ndarray:
        """Seconds of forward + backward at these local batches (piecewise linear in the
        measured points, linear beyond the last); 0 for 0 samples."""
        b = np.asarray(local_batch, dtype=float)
        xs, ys = np.asarray(self.batches, float), np.asarray(self.step_time, float)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(b > xs[-1], ys[-1] + slope * (b - xs[-1]), np.interp(b, xs, ys))
        return np.where(b > 0, out, 0.0)


@dataclass
class Machine:
    """What the simulator needs to know about a machine (seconds, bytes)."""
    name: str
    cores: int                  # cores of a node
    alpha: float                # seconds per message of an allreduce (latency)
    beta: float                 # seconds per byte
    sleep_wait: float           # seconds a sleeping wait adds to a collective
    data_per_sample: dict       # "C,H,W" -> seconds per sample of reading an in-memory batch
    oversubscribed_message: float = 0.0   # seconds each message of a collective adds when a node runs more ranks than cores
    residual: dict = field(default_factory=dict)   # seconds real runs take beyond the model: "sync", "sync_crowded" per step, "async" per gradient
    noise: dict = field(default_factory=dict)      # lognormal sigma of a step's compute time: "alone" (a core each), "crowded"
    models: dict = field(default_factory=dict)   # name -> ModelCost
    measured: str = ""          # when and how
    compute_extra: dict = field(default_factory=dict)   # seconds a training step's compute takes beyond the model's table: "spinning" (a rank that waits spinning), "sleeping" (one whose emulated slow-down sleeps)
    host: dict = field(default_factory=dict)   # what it was measured on (fingerprint.describe: CPU, CPUs, threads per core, memory, torch, MPI, date)
    drift: float = 0.0          # LeNet-5's step at its largest batch up to 256, timed again at the end, over the table's, minus 1

    @classmethod
    def load(cls, path=None) -> "Machine":
        data = json.loads(Path(path or DEFAULT_MACHINE).read_text())
        data["models"] = {k: ModelCost(**v) for k, v in data["models"].items()}
        return cls(**data)

    def save(self, path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    def data_cost(self, shape) -> float:
        key = ",".join(str(int(s)) for s in shape)
        if key in self.data_per_sample:
            return self.data_per_sample[key]
        per_value = np.median([v / np.prod([int(x) for x in k.split(",")]) for k, v in self.data_per_sample.items()])
        return float(per_value * np.prod(shape))


def _median_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup` untimed ones."""
    from ..training.profiling import time_step
    return time_step(lambda _: fn(), 0, repeats, warmup)


DRIFT_LIMIT = 0.10    # a calibration whose machine moved more than this while it ran says so


def steadiness(machine: Machine) -> float:
    """LeNet-5's step time at the table's largest batch up to 256, timed again (at the end
    of a calibration), over the table's, minus 1: how far the machine's speed moved while
    it was measured (the runs at the end read their own load: simulator/calibration.py)."""
    import torch
    import torch.nn.functional as F

    from .models import build_model
    cost = machine.models["lenet5"]
    batch = max(b for b in cost.batches if b <= 256)
    torch.manual_seed(0)
    model = build_model("lenet5", SHAPES["lenet5"], 10)
    x, y = torch.randn(batch, *SHAPES["lenet5"]), torch.randint(10, (batch,))

    def step():
        model.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
    return _median_time(step, 15) / float(cost.compute(batch)) - 1.0


def drift_note(drift: float) -> str:
    """The line a calibration adds where its machine moved (empty where it held still)."""
    if abs(drift) <= DRIFT_LIMIT:
        return ""
    return (f"dbs-mpi: the machine's speed moved while it was calibrated (LeNet-5's step time {drift:+.0%} from the "
            f"table to the end): replays from this file may be off by as much; calibrate again when nothing else runs")


def measure_model(name: str, effort: Effort = FULL) -> ModelCost:
    """A model's costs at one thread (forward + backward per local batch, update, loop overhead)."""
    import torch
    import torch.nn.functional as F

    from .models import build_model
    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 10)
    batches, repeats = effort.batches, effort.repeats
    x_all, y_all = torch.randn(max(batches), *SHAPES[name]), torch.randint(10, (max(batches),))

    def step(b):
        model.zero_grad(set_to_none=False)
        F.cross_entropy(model(x_all[:b]), y_all[:b]).backward()
    # Largest batch first: glibc's malloc raises its mmap threshold to the largest block
    # freed so far, so a batch larger than any before gets fresh pages (and their faults) at
    # every step, which a training run, whose batch size stays put, never pays. Two
    # descending sweeps, each size's faster median; a larger batch never costs less.
    sweeps = [[_median_time(lambda b=b: step(b), repeats if b <= 128 else max(7, repeats // 2))
               for b in reversed(batches)][::-1] for _ in range(2)]
    times = np.maximum.accumulate(np.min(sweeps, axis=0)).tolist()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    update = _median_time(optimizer.step, repeats)
    numel = sum(p.numel() for p in model.parameters())
    acc, grad = torch.zeros(numel), torch.ones(numel)
    # A slow model's loop overhead is timed over fewer steps: ResNet-20's 1,600 steps of 32
    # samples took 5.6 of the 11-12 minutes of a calibration, to measure 1.5 ms of a 210 ms step.
    per_step = float(np.interp(32, batches, times))
    steps = min(effort.overhead_steps, max(OVERHEAD_MIN_STEPS, round(effort.overhead_seconds / per_step)))
    return ModelCost(batches=list(batches), step_time=times, update=update,
                     overhead=loop_overhead(name, steps, effort.overhead_pairs), numel=numel,
                     add=_median_time(lambda: acc.add_(grad, alpha=0.5), repeats))


def loop_overhead(name: str, steps: int = 100, pairs: int = 7) -> float:
    """Seconds per step that dbs-mpi's loop adds to forward + backward + update: epochs of
    `steps` steps of local batch 32 through HeteroSampler and DistributedOptimizer at 1
    rank, each beside an epoch of the bare steps on a copy of the model (alternating, so
    drift hits both); the median of the differences, less the reading of the batch (the
    simulator counts that apart: data_per_sample)."""
    import copy

    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from ..planning.sharding import HeteroSampler
    from ..training.balancer import Balancer
    from ..training.batches import InMemoryLoader
    from ..training.optimizer import DistributedOptimizer
    from .data import load_synthetic
    from .models import build_model
    data = load_synthetic("train", 32 * steps, SHAPES[name], 10, seed=0)
    model = build_model(name, SHAPES[name], 10)
    bare = copy.deepcopy(model)
    bare_optimizer = torch.optim.SGD(bare.parameters(), lr=0.01, momentum=0.9)
    balancer = Balancer(MPI.COMM_SELF, 32, "ssgd")
    sampler = HeteroSampler(data, balancer)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model, balancer)
    x, y = data.x[:32], data.y[:32]

    def ours(epoch):
        sampler.set_epoch(epoch)
        for xb, yb in InMemoryLoader(data, sampler):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step(loss=loss)
        balancer.end_epoch()

    def plain(_):
        for _ in range(steps):
            bare.zero_grad(set_to_none=False)
            F.cross_entropy(bare(x), y).backward()
            bare_optimizer.step()
    diffs = []
    for epoch in range(pairs + 1):
        times = [_median_time(lambda f=f: f(epoch), 1, 0) for f in ((ours, plain) if epoch % 2 else (plain, ours))]
        if epoch:                                      # the first pair warms up
            diffs.append((times[0] - times[1]) * (1 if epoch % 2 else -1) / steps)
    optimizer.close()
    return max(0.0, statistics.median(diffs) - 32 * measure_data(SHAPES[name]))


def measure_data(shape, samples: int = 4096, batch: int = 128, repeats: int = 30) -> float:
    """Seconds per sample of x[indices] on an in-memory dataset of this shape."""
    import torch
    x = torch.randn(samples, *shape)
    rng = np.random.default_rng(0)
    idx = [rng.permutation(samples)[:batch] for _ in range(repeats)]
    return _median_time(lambda: [x[i] for i in idx], 5) / (repeats * batch)


def measure_allreduce(comm, sizes=(2 ** 10, 2 ** 14, 2 ** 17, 2 ** 19, 2 ** 21), repeats: int = 200):
    """(alpha, beta, sleep_wait) of 2 ranks: the exchange's time for m bytes fitted (least
    squares) to the ring allreduce of p = 2 ranks, 2 (p - 1) alpha + 2 (p - 1) / p m beta
    = 2 alpha + m beta; and the median extra time of the sleeping wait policy."""
    import torch

    from ..mpi.collectives import barrier
    from ..training.exchange import GradientExchange
    rows, times, sleeps = [], [], []
    for numel in sizes:
        for sleep in (False, True):
            param = torch.nn.Parameter(torch.zeros(numel // 4))
            exchange = GradientExchange(comm, [param], 60, sleep)

            def call():
                barrier(comm, timeout=60, max_pause=0.0)
                start = time.perf_counter()
                exchange.allreduce(0.5, 0.0)
                return time.perf_counter() - start
            t = statistics.median([call() for _ in range(repeats)])
            exchange.close()
            if sleep:
                sleeps.append(t)
            else:
                rows.append([2.0, float(numel)])
                times.append(t)
    (alpha, beta), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    alpha = max(float(alpha), 1e-7)
    sleep_wait = max(0.0, float(np.median(np.array(sleeps) - np.array(times))))
    return alpha, max(float(beta), 1e-12), sleep_wait


def measure_crowding(comm, alpha: float, beta: float, sleep_wait: float, repeats: int = 100) -> float:
    """Seconds each message of an allreduce of all ranks adds beyond the alpha-beta ring when
    the ranks outnumber the cores (sleeping wait policy, as training uses there)."""
    import torch

    from ..mpi.collectives import barrier
    from ..training.exchange import GradientExchange
    p, extra = comm.Get_size(), []
    for nbytes in (2 ** 14, 2 ** 18, 2 ** 20):
        param = torch.nn.Parameter(torch.zeros(nbytes // 4))
        exchange = GradientExchange(comm, [param], 60, True)
        times = []
        for _ in range(repeats):
            barrier(comm, timeout=60, max_pause=0.0)
            start = time.perf_counter()
            exchange.allreduce(1.0 / p, 0.0)
            times.append(time.perf_counter() - start)
        exchange.close()
        ring = 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta + sleep_wait
        extra.append((statistics.median(times) - ring) / (2 * (p - 1)))
    return max(0.0, float(np.median(extra)))


def calibrate(comm, name: str, effort: Effort = FULL) -> Machine:
    """Collective, on one node: every constant, measured as much as `effort` says. Ranks 0
    and 1 measure the allreduce (the others sleep meanwhile); with more ranks than cores,
    all of them measure crowding; rank 0 measures the models while the others sleep."""
    import torch

    from ..mpi.collectives import barrier, bcast_object
    from ..mpi.placement import available_cores, mpi_library
    torch.set_num_threads(1)
    pair = comm.Split(0 if comm.Get_rank() < 2 else 1)
    alpha = beta = sleep_wait = 0.0
    if comm.Get_rank() < 2:
        alpha, beta, sleep_wait = measure_allreduce(pair, effort.allreduce_sizes, effort.allreduce_repeats)
    barrier(comm, timeout=3600)
    alpha, beta, sleep_wait = bcast_object(comm, (alpha, beta, sleep_wait), timeout=3600)
    crowding = measure_crowding(comm, alpha, beta, sleep_wait, effort.crowding_repeats) \
        if comm.Get_size() > available_cores() else 0.0
    models, data = {}, {}
    if comm.Get_rank() == 0:
        for model in SHAPES:
            models[model] = measure_model(model, effort)
        for shape in sorted(set(SHAPES.values())):
            data[",".join(map(str, shape))] = measure_data(shape, repeats=effort.data_repeats)
    barrier(comm, timeout=3600)            # the others sleep meanwhile (a spinning wait would take a core)
    return Machine(name=name, cores=available_cores(), alpha=alpha, beta=beta, sleep_wait=sleep_wait,
                   data_per_sample=data, models=models, oversubscribed_message=crowding, host=describe(mpi_library()),
                   measured=f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({platform.processor() or platform.machine()}, "
                            f"{os.cpu_count()} cores), {comm.Get_size()} ranks, torch threads 1"
                            + ("" if effort == FULL else f", {effort.name} calibration (few points)"))
