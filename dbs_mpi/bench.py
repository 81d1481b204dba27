"""Benchmarks: `dbs-mpi bench CASE`. Each case runs its variants side by side in one
MPI job, repeats them, and reports medians and ratios (machines are noisy; a ratio
measured in one run is the honest figure). Results go to HDF5 under results/bench/.

  hetero   one epoch each of ssgd and dbs (and static) under emulated heterogeneous
           speeds; ratio ssgd epoch time / dbs epoch time against the ideal
           mean(v)/min(v) (RESEARCH.md section 2).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import numpy as np

from . import comm as mpi
from .config import Config, UserError
from .config import load as load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dbs-mpi bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=["hetero"], help="which benchmark")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every variant (median reported)")
    p.add_argument("--strategies", default="ssgd,dbs", help="variants of the hetero case, ssgd first")
    p.add_argument("--speeds", default="1,0.25", help="emulated relative speed of every rank")
    p.add_argument("--global-batch", type=int, default=512, help="samples per step over all ranks")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default="lenet5")
    p.add_argument("--data-dir", default="")
    p.add_argument("--subset", type=int, default=0, help="first N training samples (0 = all)")
    p.add_argument("--out-dir", default="results/bench", help="folder of the result files")
    return p


def hetero(comm, args) -> dict:
    from .train import train
    strategies = [s for s in args.strategies.split(",") if s]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(args.out_dir) / f"hetero-{stamp}"
    base = load_config(None, dict(dataset=args.dataset, model=args.model, data_dir=args.data_dir, epochs=1,
                                  global_batch=args.global_batch, speeds=args.speeds, subset=args.subset,
                                  test_subset=1000, progress=False))
    times = {s: [] for s in strategies}
    vectors = {}
    for rep in range(args.repeats):
        order = strategies if rep % 2 == 0 else strategies[::-1]   # alternate, so drift favours nobody
        for strategy in order:
            cfg = base.replace(strategy=strategy, seed=rep)
            summary = train(comm, cfg, out=str(folder / f"{strategy}-{rep}.h5"), log=lambda msg: None)
            times[strategy].append(summary.epochs[0]["duration"])
            vectors[strategy] = summary.epochs[0]["batch_sizes"].tolist()
    speeds = np.array(base.speeds) / max(base.speeds)
    ideal = float(speeds.mean() / speeds.min())
    baseline = strategies[0]
    report = {"case": "hetero", "speeds": list(base.speeds), "global_batch": base.global_batch, "ideal": ideal,
              "world_size": comm.Get_size(), "repeats": args.repeats, "times": times, "batch_sizes": vectors,
              "oversubscribed": mpi.oversubscribed(mpi.hostnames(comm)), "folder": str(folder)}
    report["ratios"] = {s: [b / t for b, t in zip(times[baseline], times[s])] for s in strategies[1:]}
    report["median_ratio"] = {s: statistics.median(r) for s, r in report["ratios"].items()}
    return report


def format_hetero(report: dict) -> str:
    lines = [f"bench hetero: {report['world_size']} ranks, speeds {report['speeds']}, global batch "
             f"{report['global_batch']}, {report['repeats']} repeats"
             + ("  [OVERSUBSCRIBED: more ranks than cores]" if report["oversubscribed"] else ""),
             f"{'strategy':<10} {'batch sizes':<22} {'epoch s (median)':>16} {'all repeats':<28}"]
    for s, ts in report["times"].items():
        lines.append(f"{s:<10} {str(report['batch_sizes'][s]):<22} {statistics.median(ts):>16.3f} "
                     f"{' '.join(f'{t:.3f}' for t in ts):<28}")
    ideal = report["ideal"]
    base = next(iter(report["times"]))
    for s, ratio in report["median_ratio"].items():
        verdict = "meets" if ratio >= 0.9 * ideal else "misses"
        lines.append(f"{base}/{s} epoch-time ratio: median {ratio:.3f} (repeats "
                     f"{' '.join(f'{r:.3f}' for r in report['ratios'][s])}); ideal mean(v)/min(v) = {ideal:.3f}; "
                     f"{ratio / ideal:.2f} of ideal, target >= 0.90: {verdict}")
    return "\n".join(lines)


def write_report(report: dict, path: Path) -> None:
    import h5py
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs["report"] = json.dumps(report)
        for s, ts in report["times"].items():
            f[f"{s}/epoch_time"] = np.asarray(ts)
            f[f"{s}/batch_sizes"] = np.asarray(report["batch_sizes"][s])
        for s, r in report["ratios"].items():
            f[f"ratio/{s}"] = np.asarray(r)


def main(comm, argv) -> int:
    args = mpi.agree(comm, _parser().parse_args, argv)
    report = hetero(comm, args)
    if comm.Get_rank() == 0:
        path = Path(report["folder"]) / "summary.h5"
        write_report(report, path)
        print(format_hetero(report))
        print(f"results: {path}")
    return 0
