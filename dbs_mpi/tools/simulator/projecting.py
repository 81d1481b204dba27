"""Projecting a run at scale: one rank per device of a given relative speed (log-uniform,
or a TOML file's), on a named or given network, nothing measured (`dbs-mpi simulate
--ranks/--speeds`); and the crossover, when mixing pays: one fast rank beside slower ones,
dbs with every rank or with the planner's set, over the fast rank alone (`dbs-mpi
simulate crossover`).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from ...mpi.agreement import agree
from ...options import DEFAULT_UPPER, UserError
from ...planning.goodput import AdaptiveBatch
from ..config import ArgumentParser, tomllib
from ..machine import Machine
from .cluster import DEFAULT_NOISE, Cluster
from .job import SYNC, Job
from .network import NETWORKS, Network
from .parameter_server import simulate_async
from .sync import simulate_sync


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
               seed: int = 0, dbs_interval: str = "1", participation: str = "auto", adaptive: dict | None = None) -> dict:
    """A run at scale: one rank per device of relative speed `speeds[i]` (1 = the fastest,
    which computes `compute_scale` times as fast as the machine's core), `ranks_per_node`
    ranks per node, each with its own cores; network = (alpha, beta). adaptive: the
    global batch adapts from global_batch (adaptive.py: start, lower, upper, rule, noise)."""
    speeds = np.asarray(speeds, float)
    ranks = len(speeds)
    global_batch = global_batch or local_batch * ranks
    job = Job(strategy=strategy, model=machine.models[model], samples=samples, global_batch=global_batch,
              epochs=epochs, seed=seed, dbs_interval=str(dbs_interval),    # no residual: that is this machine's
              participation=participation, adaptive=dict(adaptive or {}))
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
    speeds = speeds_from(args, args.ranks)
    adaptive = None
    if args.global_batch == "auto":
        start = args.global_batch_start or args.local_batch * len(speeds)
        adaptive = dict(start=start, upper=max(args.max_global_batch or DEFAULT_UPPER, start), rule="adascale",
                        lower=args.min_global_batch, noise=args.noise_scale)
        AdaptiveBatch(start, adaptive["upper"], lower=args.min_global_batch)    # its bounds checked before epoch 1
    return projection(machine, speeds, args.strategy, args.model, args.epochs, args.samples,
                      adaptive["start"] if adaptive else args.global_batch, args.local_batch, network, args.algorithm,
                      args.ranks_per_node, args.compute_scale, DEFAULT_NOISE if args.noise is None else args.noise,
                      args.seed, args.dbs_interval, args.participation, adaptive)


def crossover(machine: Machine, slow: int, ratios, model: str = "lenet5", global_batch: int = 512,
              network=NETWORKS["ib-100g"], epochs: int = 2, samples: int = 60000) -> list[dict]:
    """When mixing pays: one fast rank with `slow` ranks at each relative speed of `ratios`,
    dbs with participation auto and all, each epoch's time over the fast rank alone's
    (the last epoch: the first is the calibration's and the planner's start)."""
    common = dict(model=model, epochs=epochs, samples=samples, global_batch=global_batch, network=network)
    alone = projection(machine, [1.0], **common)["epoch_time_predicted"][-1]
    rows = []
    for ratio in ratios:
        speeds = [1.0] + [float(ratio)] * slow
        times = {mode: projection(machine, speeds, participation=mode, **common) for mode in ("auto", "all")}
        rows.append({"ratio": float(ratio), **{mode: out["epoch_time_predicted"][-1] / alone
                                                for mode, out in times.items()},
                     "taking_part": int(np.count_nonzero(times["auto"]["batch_sizes"][-1]))})
    return rows


def _crossover_setup(argv):
    """`simulate crossover`'s arguments, checked: a mistake is one line naming it."""
    p = ArgumentParser(prog="dbs-mpi simulate crossover", description="When mixing pays: one fast rank with SLOW "
                       "slower ranks, dbs with every rank or the planner's set, over the fast rank alone.")
    p.add_argument("--slow", type=int, default=1, help="slower ranks beside the fast one")
    p.add_argument("--ratios", default="0.5,0.2,0.1,0.05,0.02", help="their relative speeds")
    p.add_argument("--model", default="lenet5")
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--network", default="ib-100g", help=f"{', '.join(NETWORKS)} or ALPHA,BETA")
    p.add_argument("--machine", metavar="FILE")
    args = p.parse_args(argv)
    try:
        ratios = [float(r) for r in args.ratios.split(",")]
        network = NETWORKS.get(args.network) or tuple(float(v) for v in args.network.split(","))
    except ValueError:
        raise UserError(f"crossover: --ratios and --network are numbers; got {args.ratios!r}, {args.network!r}") from None
    try:
        machine = Machine.load(args.machine)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"machine: cannot read {args.machine or 'the default machine file'} ({exc})") from None
    if args.slow < 1 or not all(0 < r <= 1 for r in ratios) or args.model not in machine.models:
        raise UserError("crossover: --slow at least 1, --ratios in (0, 1], --model one of the machine file's")
    return args, ratios, network, machine


def _crossover(comm, argv) -> int:
    args, ratios, network, machine = agree(comm, _crossover_setup, argv)     # every rank: exit 2 on a mistake
    if comm.Get_rank() == 0:
        print(f"{'ratio':>6} {'all / alone':>12} {'auto / alone':>13} {'taking part':>12}")
        for row in crossover(machine, args.slow, ratios, args.model, args.global_batch, network):
            print(f"{row['ratio']:>6g} {row['all']:>12.3f} {row['auto']:>13.3f} {row['taking_part']:>8d} of "
                  f"{args.slow + 1}")
    return 0
