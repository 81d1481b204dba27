"""`dbs-mpi simulate`: replay a run (--from, replaying.py) or project one at scale (--ranks or
--speeds, projecting.py); `simulate calibrate` (calibration.py) measures the machine
constants, `simulate crossover` (projecting.py) tells when mixing pays.

    dbs-mpi simulate --from results/grid/strategies-dbs-s0.h5 --json      # replay a run
    dbs-mpi simulate --ranks 1024 --strategy dbs --model resnet20 --speed-spread 4 --epochs 3
    dbs-mpi simulate --speeds my-cluster.toml --strategy dbs --model resnet20 --epochs 3   # docs/simulator.md
    mpirun -n 2 dbs-mpi simulate calibrate       # this machine's file (tools/machine.py, tools/fingerprint.py)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...mpi.agreement import agree
from ...options import UserError, parse_interval
from ..config import ArgumentParser
from ..fingerprint import elsewhere_note, machine_file
from ..machine import Machine
from .calibration import _calibrate
from .cluster import DEFAULT_NOISE
from .job import ASYNC, SYNC
from .network import NETWORKS
from .projecting import _crossover, _speeds_file, project
from .replaying import _measured_note, replay, replay_job


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dbs-mpi simulate", description="Replay a run (--from) or project one at scale (--ranks or "
                "--speeds); `dbs-mpi simulate calibrate` measures the machine constants.")
    p.add_argument("--from", dest="source", metavar="RUN.h5", help="replay this result file from its configuration "
                   "and start-up calibration")
    p.add_argument("--machine", metavar="FILE", help="machine constants (default: this machine's, "
                   "results/machine/<fingerprint>.json, if it was calibrated, else results/machine/dev-2core.json)")
    p.add_argument("--ranks", type=int, default=0, help="projection: ranks (one per device)")
    p.add_argument("--strategy", default="dbs", choices=[*SYNC, *ASYNC])
    p.add_argument("--model", default="resnet20", help="projection: a model of the machine file")
    p.add_argument("--speed-spread", type=float, default=1.0, metavar="R",
                   help="projection: device speeds log-uniform in [1/R, 1]")
    p.add_argument("--speeds", metavar="FILE.toml", help="projection: speeds = [...] or [[mix]] name/speed/count")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=50000, help="projection: training samples (default: CIFAR-10's)")
    p.add_argument("--local-batch", type=int, default=32, help="projection: B = this x ranks unless --global-batch")
    p.add_argument("--global-batch", default="0", metavar="B|auto", help="projection: B (0: --local-batch x ranks); "
                   "auto: after every epoch the engine's goodput choice at --noise-scale (from --global-batch-start, "
                   "default --local-batch x ranks, down to --min-global-batch, default half the start, up to "
                   "--max-global-batch, default 4096)")
    p.add_argument("--noise-scale", type=float, default=0.0, metavar="N",
                   help="projection with --global-batch auto: the gradient noise scale, in samples (a run's "
                        "step/noise_scale)")
    p.add_argument("--global-batch-start", type=int, default=0)
    p.add_argument("--min-global-batch", type=int, default=0)
    p.add_argument("--max-global-batch", type=int, default=0)
    p.add_argument("--network", default="ib-100g", help=f"{', '.join(NETWORKS)} or ALPHA,BETA (seconds, s/byte)")
    p.add_argument("--algorithm", default="auto", choices=["auto", "ring", "tree"])
    p.add_argument("--compute-scale", type=float, default=1.0, metavar="K",
                   help="projection: the fastest device is K times the machine's core")
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--compare", metavar="STRATEGY", choices=[*SYNC, *ASYNC],
                   help="projection: also simulate this strategy; report the speed-up")
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
    if len(set(out.get("global_batches", []))) > 1:
        lines.append(f"global batch by epoch: {', '.join(str(b) for b in out['global_batches'])}")
    if "speedup" in out:
        lines.append(f"speed-up over {out['compared']}: {out['speedup']:.3f}x")
    if _measured_note(out):
        lines.append(_measured_note(out))
    if "machine_note" in out:
        lines.append(out["machine_note"])
    print("\n".join(lines))


def _setup(argv):
    """Arguments and machine constants, checked (under agree: a mistake is one line)."""
    args = _parser().parse_args(argv)
    if not args.source and not (args.ranks or args.speeds):
        raise UserError("simulate: give --from RUN.h5, or --ranks N (or --speeds FILE.toml)")
    args.machine = args.machine or str(machine_file())
    try:
        machine = Machine.load(args.machine)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"machine: cannot read {args.machine or 'the default machine file'} ({exc})") from None
    if args.source and not Path(args.source).is_file():
        raise UserError(f"from: no such result file {args.source}")
    if not args.source and args.model not in machine.models:
        raise UserError(f"model: the machine file has no costs for {args.model!r} (it has {', '.join(machine.models)})")
    if args.ranks < 0 or args.epochs < 1 or args.samples < 1 or args.compute_scale <= 0 or args.ranks_per_node < 1 \
            or args.local_batch < 1:
        raise UserError("simulate: --ranks, --epochs, --samples, --compute-scale, --ranks-per-node and --local-batch "
                        "must be positive")
    _check_values(args, machine)
    return args, machine


def _check_values(args, machine: Machine) -> None:
    """The options' values, each refused with one line that names it."""
    if args.noise is not None and not args.noise >= 0:
        raise UserError(f"noise: must be 0 or more, got {args.noise}")
    if not args.speed_spread >= 1:
        raise UserError(f"speed-spread: must be at least 1 (speeds log-uniform in [1/R, 1]), got {args.speed_spread}")
    parse_interval(args.dbs_interval)                               # one line naming dbs_interval
    _check_adaptive(args)
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


def _check_adaptive(args) -> None:
    """--global-batch B|auto and, with auto, the noise scale and bounds."""
    given = args.global_batch.strip().lower()
    if given != "auto":
        args.global_batch = int(given) if given.isdigit() else -1
        if args.global_batch < 0:
            raise UserError(f"global-batch: a number of samples (0: --local-batch x ranks) or auto; got {given!r}")
        if args.global_batch_start or args.min_global_batch or args.max_global_batch:
            raise UserError("global-batch-start, min-global-batch, max-global-batch: bounds of --global-batch auto")
        return
    args.global_batch = "auto"
    if args.strategy not in SYNC:
        raise UserError(f"global-batch: auto adapts a synchronous step's global batch ({', '.join(SYNC)})")
    if not args.noise_scale > 0:
        raise UserError("noise-scale: --global-batch auto projects the engine's choice at a noise scale; give it "
                        "(samples, e.g. a run's step/noise_scale)")
    if min(args.global_batch_start, args.min_global_batch, args.max_global_batch) < 0:
        raise UserError("global-batch-start, min-global-batch, max-global-batch: must be positive (0: the default)")
    start = args.global_batch_start or args.local_batch * (args.ranks or 0)
    if start and args.min_global_batch > start:
        raise UserError(f"min-global-batch: must be at most the start, {start}; got {args.min_global_batch}")


def main(comm, argv) -> int:
    if argv[:1] == ["calibrate"]:
        return _calibrate(comm, argv[1:])
    if argv[:1] == ["crossover"]:
        return _crossover(comm, argv[1:])
    args, machine = agree(comm, _setup, argv)
    if comm.Get_rank() != 0:                     # the simulation is one process's work
        return 0
    if args.source:
        out = replay(args.source, machine, args.noise, args.seed)
        out.update(machine=args.machine, **({"machine_note": note} if (note := elsewhere_note(
            machine.host, args.machine)) else {}))
    else:
        out = project(args, machine)
        if args.compare:
            other = project(argparse.Namespace(**{**vars(args), "strategy": args.compare}), machine)
            out.update(compared=args.compare, epoch_time_compared=other["epoch_time_predicted"],
                       speedup=sum(other["epoch_time_predicted"]) / sum(out["epoch_time_predicted"]))
    if args.json:
        print(json.dumps(out))
        if "machine_note" in out:
            print(out["machine_note"], file=sys.stderr)
    else:
        _print(out)
    return 0
