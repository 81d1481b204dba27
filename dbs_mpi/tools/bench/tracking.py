"""`dbs-mpi bench tracking` (dbs within the epoch): a rank slowed 4x (emulated) or sharing its
core with a CPU hog (real) in the middle of epochs: ssgd, dbs and the per-epoch rule side by
side; the stretch's time against the ideal, steps to follow and to give back, the vector's
movement under steady speeds (the scenarios and their metrics: tools/bench_tracking.py).
"""
from __future__ import annotations

import numpy as np

from ...planning import sharding
from .. import bench_tracking as tracking
from .harness import _config, _on_first, _oversubscribed, _train_epoch, train_samples
from .report import _flag, _med, check


def case_tracking(comm, args, folder) -> dict:
    return _on_first(comm, 2, _tracking, args, folder)


def _tracking(comm, args, folder) -> dict:
    repeats = args.repeats or 3
    start, stop = (int(s) for s in args.tracking_steps.split(","))
    base = _config(args, global_batch=args.global_batch, subset=args.subset or 20000, test_subset=200,
                   epochs=args.tracking_epochs, threads=0)
    scenarios = [s for s in args.scenarios.split(",") if s]
    out = {"case": "tracking", "world_size": comm.Get_size(), "global_batch": base.global_batch, "repeats": repeats,
           "steps": [start, stop], "factor": args.tracking_factor, "epochs": base.epochs,
           "steps_per_epoch": _steps(base), "oversubscribed": _oversubscribed(comm), "scenarios": {}, "checks": []}
    for scenario in scenarios:
        extra = tracking.scenario_options(scenario, (start, stop), args.tracking_factor)
        variants = tracking.variants(args.dbs_intervals)
        runs = {v: [] for v in variants}
        for rep in range(repeats):
            names = list(variants) if rep % 2 == 0 else list(variants)[::-1]
            for variant in names:
                path = folder / f"tracking-{scenario}-{variant}-{rep}.h5"
                _train_epoch(comm, base.replace(**variants[variant], **extra, seed=rep), path)
                if comm.Get_rank() == 0:
                    runs[variant].append(tracking.step_record(path))
        if comm.Get_rank() == 0 and scenario == "steady":
            out["steady"] = tracking.summarize_steady(runs)
            out["checks"] += _steady_checks(out["steady"])
        elif comm.Get_rank() == 0:
            summary = tracking.summarize(runs, start, stop, args.tracking_factor if scenario == "emulated" else None)
            out["scenarios"][scenario] = summary
            out["checks"] += _tracking_checks(scenario, summary)
    return out


def _steady_checks(steady: dict) -> list[dict]:
    return [check(f"steady: {v} % of B moved per step", 100 * _med([r["moved_per_step"] for r in rows]), None)
            for v, rows in steady["metrics"].items() if v.startswith("dbs")]


def _steps(cfg) -> int:
    return sharding.steps_per_epoch(train_samples(cfg), cfg.global_batch, cfg.drop_last)


def _tracking_checks(scenario: str, summary: dict) -> list[dict]:
    m = summary["metrics"]
    dbs = next(v for v in m if v.startswith("dbs") and v != "dbs-epoch")
    med = lambda v, key: tracking.median_of([r[key] for r in m[v]])       # noqa: E731
    return [check(f"{scenario}: stretch {dbs}/ssgd (ideal {summary['ideal']:.2f})",
                  _med(summary["stretch_ratio"][dbs]), summary["ideal"] * 1.25 + 0.05),
            check(f"{scenario}: steps to follow, {dbs}", med(dbs, "follow"), 8),
            check(f"{scenario}: steps to give back, {dbs}", med(dbs, "give_back"), 8),
            check(f"{scenario}: after / before the stretch, {dbs}", med(dbs, "after"), 1.20),
            check(f"{scenario}: after / before the stretch, dbs-epoch", med("dbs-epoch", "after"), None),
            check(f"{scenario}: stretch dbs-epoch/ssgd", _med(summary["stretch_ratio"]["dbs-epoch"]), None)]


def format_tracking(report: dict) -> str:
    start, stop = report["steps"]
    lines = [f"bench tracking: {report['world_size']} ranks, global batch {report['global_batch']}, "
             f"{report['epochs']} epochs of {report['steps_per_epoch']} steps, rank {tracking.SLOW_RANK} slowed in "
             f"steps [{start}, {stop}), {report['repeats']} repeats" + _flag(report)]
    for scenario, summary in report["scenarios"].items():
        lines.append(f"{scenario}: speeds in the stretch {np.round(summary['speeds'], 3).tolist()}, ideal stretch "
                     f"ratio min(v)/mean(v) = {summary['ideal']:.3f}, ideal share of rank {tracking.SLOW_RANK} "
                     f"{summary['share']:.3f}")
        lines.append(f"  {'variant':<10} {'stretch s':>10} {'/ ssgd':>7} {'follow':>7} {'back':>6} {'after':>6} "
                     f"{'moves':>6} {'moved/step':>10} {'slowed b':>8}")
        for variant, runs in summary["metrics"].items():
            ratio = summary["stretch_ratio"].get(variant)
            med = lambda key: tracking.median_of([r[key] for r in runs])   # noqa: E731
            lines.append(f"  {variant:<10} {med('stretch_seconds'):>10.3f} "
                         f"{(_med(ratio) if ratio else 1.0):>7.3f} {med('follow'):>7.1f} {med('give_back'):>6.1f} "
                         f"{med('after'):>6.3f} {med('moves'):>6.1f} {med('moved_per_step'):>10.5f} "
                         f"{med('slowed_batch'):>8.1f}")
    if report["scenarios"]:
        lines.append("  (medians over repeats; follow/back: steps; inf: never)")
    steady = report.get("steady")
    if steady:
        lines.append(f"steady: speeds {list(tracking.STEADY_SPEEDS)}, nothing disturbed; rank {tracking.SLOW_RANK}'s "
                     f"proportional share {steady['share'] * report['global_batch']:.0f}; per run (repeats):")
        for variant, rows in steady["metrics"].items():
            lines.append(f"  {variant:<10} " + "; ".join(
                f"{r['moves']} changes in {r['steps']} steps, {100 * r['moved_per_step']:.3f}% of B moved a step, "
                f"b_1 {r['low']}..{r['high']}, {1e3 * r['seconds_per_step']:.1f} ms a step" for r in rows))
    return "\n".join(lines)
