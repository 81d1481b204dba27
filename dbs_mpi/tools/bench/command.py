"""Benchmarks: `dbs-mpi bench CASE`. Each case runs its variants side by side in one
MPI job, repeats them (alternating their order, so that drift favours nobody), and
reports medians and ratios: machines are noisy, and a ratio measured in one run is the
honest figure. Results go to HDF5 under results/bench/.

  exchange  the framework's gradient exchange vs a raw mpi4py Allreduce of the same
            bytes, LeNet-5 and MLP sizes, 2 ranks (target: at most 1.10x)
  ddp       uniform 2-rank training throughput vs torch DistributedDataParallel
            (gloo), same model, local batch, data and threads (target: at least 1.0x)
  hetero    epoch time of ssgd, static and dbs under emulated speeds; the ssgd/dbs
            ratio against mean(v)/min(v), and static/dbs against the ideal
            N / sum_i v_i + measured communication (target: within 10%)
  overhead  one rank: the framework's epoch vs a plain PyTorch loop over the same
            batches (target: at most 1.05x)
  scaling   throughput at 1, 2 and 4 ranks (sub-communicators of the job), local
            batch fixed; runs with more ranks than cores are marked
  overlap   gradient buckets reduced during backward vs one bucket after it (is
            overlap worth it here?), 2 ranks, lean step loop
  wait      epoch time with wait_policy spin vs sleep, 3-4 ranks on a 2-core node
  tracking  a rank slowed 4x (emulated) or sharing its core with a CPU hog (real) in the
            middle of epochs: ssgd, dbs and the per-epoch rule side by side; the stretch's
            time against the ideal, steps to follow and to give back, the vector's
            movement under steady speeds (bench_tracking.py)
  batchnorm ResNet-20 with GroupNorm, with BatchNorm, with synchronised BatchNorm
            (sync_batchnorm.py), 2 ranks, even batches: time per step, the time in
            SyncBatchNorm's collectives and the exchange's exposed wait
  all       exchange, ddp, hetero, overhead, scaling, overlap, wait, tracking, batchnorm
            (`make bench`, mpirun -n 4): one table at the end

A case that needs k ranks runs on the first k ranks of the job (a sub-communicator:
library code takes any communicator); the other ranks wait in a sleeping barrier that
polls every 10 ms, so they leave the cores to the measured ranks.
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from ...mpi.agreement import agree
from ...mpi.placement import available_cores, hostnames, mpi_library
from ...options import DATA_ON_DEVICE, UserError
from ...training.results import git_revision, versions
from .. import bench_tracking as tracking
from ..config import ArgumentParser
from ..config import MODELS, SYNC_STRATEGIES
from .batchnorm import case_batchnorm, format_batchnorm
from .ddp import case_ddp, format_ddp
from .exchange import case_exchange, format_exchange
from .harness import _config
from .hetero import case_hetero, format_hetero
from .overhead import case_overhead, format_overhead
from .overlap import case_overlap, format_overlap
from .report import format_table, write_report
from .scaling import case_scaling, format_scaling
from .tracking import case_tracking, format_tracking
from .wait import case_wait, format_wait

CASES = ("exchange", "ddp", "hetero", "overhead", "scaling", "overlap", "wait", "tracking", "batchnorm")


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dbs-mpi bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                allow_abbrev=False)
    p.add_argument("case", choices=[*CASES, "all"], help="which benchmark")
    p.add_argument("--repeats", type=int, default=0, help="repetitions of every variant (median reported); "
                   "0 = the case's default")
    p.add_argument("--dataset", default="fashion-mnist", help="training data of the training cases")
    p.add_argument("--data-dir", default="")
    p.add_argument("--synthetic-shape", default="1,28,28", help="sample shape C,H,W of --dataset synthetic (3,32,32: "
                   "CIFAR-10-shaped)")
    p.add_argument("--synthetic-samples", type=int, default=4096, help="training samples of --dataset synthetic")
    p.add_argument("--model", default="lenet5", help="model of the training cases")
    p.add_argument("--models", default="lenet5,mlp", help="models of the exchange case")
    p.add_argument("--overlap-models", default="lenet5,mlp,resnet20", help="models of the overlap case (also "
                   "mlp-wide: 1.86 M parameters)")
    p.add_argument("--local-batch", type=int, default=64, help="samples per rank and step (ddp, overhead, "
                   "scaling, overlap)")
    p.add_argument("--steps", type=int, default=150, help="timed steps per epoch (ddp, overhead, scaling)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank, the same for every variant")
    p.add_argument("--device", default="cpu", help="the training cases' device: cpu | auto | cuda | cuda:N "
                   "(default cpu: the CPU benchmarks)")
    p.add_argument("--devices", default="", help="per-rank devices of the training cases, e.g. cuda,cpu,cpu")
    p.add_argument("--exchange", default="auto", help="gradient exchange of the training cases")
    p.add_argument("--data-on-device", default="auto", choices=DATA_ON_DEVICE,
                   help="the training cases' data in the GPU's memory (overhead: the plain loop's too)")
    p.add_argument("--iterations", type=int, default=300, help="exchange: timed exchanges per repeat and variant")
    p.add_argument("--strategies", default="ssgd,static,dbs", help="hetero: variants, ssgd first")
    p.add_argument("--speeds", default="1,0.25", help="hetero: emulated relative speed of every rank; \"none\": "
                   "no emulation (real heterogeneity, e.g. --devices cuda,cpu,cpu), ranks = the job's")
    p.add_argument("--global-batch", type=int, default=512, help="hetero and wait: samples per step over all ranks")
    p.add_argument("--subset", type=int, default=0, help="hetero and wait: first N training samples (0 = all)")
    p.add_argument("--sizes", default="1,2,4", help="scaling: rank counts")
    p.add_argument("--bucket-kb", type=float, default=64, help="overlap: bucket cap of the bucketed variants, KiB")
    p.add_argument("--first-bucket-kb", type=float, default=16, help="overlap: first-bucket cap, KiB")
    p.add_argument("--wait-speeds", default="1,0.25,0.25,0.25", help="wait: speeds (their count = ranks used)")
    p.add_argument("--wait-strategies", default="ssgd,dbs", help="wait: strategies")
    p.add_argument("--tracking-steps", default="30,90", help="tracking: the run's steps [A,B) in which rank 1 "
                   "is slowed")
    p.add_argument("--tracking-factor", type=float, default=4.0, help="tracking: the emulated slow-down")
    p.add_argument("--tracking-epochs", type=int, default=3, help="tracking: epochs of every run")
    p.add_argument("--scenarios", default="emulated,contention", help="tracking: emulated and/or contention")
    p.add_argument("--dbs-intervals", default="", help="tracking: compare dbs at these step intervals (e.g. "
                   "1,4,16) instead of the default one")
    p.add_argument("--batchnorm-steps", type=int, default=20, help="batchnorm: steps per run (ResNet-20, "
                   "CIFAR-10-shaped synthetic data, --local-batch samples a rank)")
    p.add_argument("--out-dir", default="results/bench", help="folder of the result files")
    return p


RUNNERS = {"exchange": case_exchange, "ddp": case_ddp, "hetero": case_hetero, "overhead": case_overhead,
           "scaling": case_scaling, "overlap": case_overlap, "wait": case_wait, "tracking": case_tracking,
           "batchnorm": case_batchnorm}
FORMATTERS = {"exchange": format_exchange, "ddp": format_ddp, "hetero": format_hetero, "overhead": format_overhead,
              "scaling": format_scaling, "overlap": format_overlap, "wait": format_wait, "tracking": format_tracking,
              "batchnorm": format_batchnorm}
# `make bench` (all): shorter hetero and wait runs than their stand-alone defaults
ALL_DEFAULTS = {"subset": 20000}


def _check_tracking(args) -> None:
    try:
        start, stop = (int(s) for s in args.tracking_steps.split(","))
    except ValueError:
        raise UserError(f"tracking-steps: two step numbers A,B; got {args.tracking_steps!r}") from None
    if not tracking.AROUND <= start < stop:
        raise UserError(f"tracking-steps: need {tracking.AROUND} <= A < B (steps before A are the baseline); got "
                        f"{args.tracking_steps!r}")
    unknown = set(args.scenarios.split(",")) - set(tracking.SCENARIOS)
    if unknown:
        raise UserError(f"scenarios: {', '.join(sorted(unknown))} unknown; use {', '.join(tracking.SCENARIOS)}")
    if not args.tracking_factor >= 1:
        raise UserError(f"tracking-factor: must be at least 1; got {args.tracking_factor}")


def required_ranks(args) -> dict:
    """Ranks every chosen case needs at least (scaling and wait use what there is)."""
    speeds = [s for s in args.speeds.split(",") if s]
    need = {"exchange": 2, "ddp": 2, "hetero": len(speeds), "overhead": 1, "scaling": 1, "overlap": 2, "wait": 2,
            "tracking": 2, "batchnorm": 2}
    return {c: need[c] for c in (CASES if args.case == "all" else [args.case])}


def _check_values(args) -> None:
    """What the cases read, checked before any runs (one line, exit 2): the training
    options as `train` reads them (model, dataset, devices, speeds), the lists, the counts."""
    _config(args, strategy="ssgd", global_batch=args.global_batch, speeds="" if args.speeds == "none" else args.speeds)
    models = (*MODELS, "mlp-wide")                   # (harness._bench_model)
    for name, given, known in (("models", args.models, models), ("overlap-models", args.overlap_models, models),
                               ("strategies", args.strategies, SYNC_STRATEGIES),
                               ("wait-strategies", args.wait_strategies, SYNC_STRATEGIES)):
        unknown = [x for x in given.split(",") if x and x not in known]
        if unknown or not given.strip(","):
            raise UserError(f"{name}: {', '.join(unknown) or 'none'} given; choose from {', '.join(known)}")
    for name, given, kind in (("sizes", args.sizes, int), ("wait-speeds", args.wait_speeds, float)):
        try:
            values = [kind(x) for x in given.split(",") if x]
        except ValueError:
            values = []
        if not values or min(values) <= 0:
            raise UserError(f"{name}: positive numbers separated by commas; got {given!r}")
    for name in ("local_batch", "steps", "iterations", "tracking_epochs", "batchnorm_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"{name.replace('_', '-')}: must be at least 1; got {getattr(args, name)}")
    if args.repeats < 0:
        raise UserError(f"repeats: must be 0 (the case's default) or more; got {args.repeats}")


def _setup(argv, world_size: int):
    args = _parser().parse_args(argv)
    _check_values(args)
    _check_tracking(args)
    for case, k in required_ranks(args).items():
        if world_size < k:
            raise UserError(f"bench {case} needs {k} ranks, the job has {world_size}: "
                            f"mpirun -n {max(required_ranks(args).values())} dbs-mpi bench {args.case}")
    if args.case == "all":
        for key, value in ALL_DEFAULTS.items():
            if not getattr(args, key):
                setattr(args, key, value)
    return args


def main(comm, argv) -> int:
    args = agree(comm, _setup, argv, comm.Get_size())
    cases = list(CASES) if args.case == "all" else [args.case]
    stamp = comm.bcast(datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), root=0)
    folder = Path(args.out_dir) / f"{args.case}-{stamp}"
    hosts = hostnames(comm)
    reports = []
    for case in cases:      # every rank runs every case (idle ranks sleep); a failure aborts the job
        report = RUNNERS[case](comm, args, folder)
        if comm.Get_rank() == 0:
            reports.append(report)
            print(FORMATTERS[case](report), flush=True)
            print(flush=True)
    if comm.Get_rank() == 0:
        path = folder / "summary.h5"
        attrs = {"command": "dbs-mpi bench " + " ".join(argv), "versions": json.dumps(versions(mpi_library())),
                 "git_revision": git_revision(), "hostnames": json.dumps(hosts), "world_size": comm.Get_size(),
                 "cores": available_cores(), "created": stamp}
        write_report(reports, path, attrs)
        print(format_table(reports))
        print(f"results: {path}")
    return 0
