"""`dbs-mpi bench wait`: epoch time with wait_policy spin vs sleep, 3-4 ranks on a 2-core node.
"""
from __future__ import annotations

from ...mpi.placement import available_cores
from .harness import _config, _on_first, _oversubscribed, _train_epoch
from .report import _flag, _med, _reps, check


def case_wait(comm, args, folder) -> dict:
    speeds = [s for s in args.wait_speeds.split(",") if s]
    k = min(len(speeds), comm.Get_size())
    return _on_first(comm, k, _wait, args, folder, ",".join(speeds[:k]))


def _wait(comm, args, folder, speeds) -> dict:
    repeats = args.repeats or 3
    strategies = [s for s in args.wait_strategies.split(",") if s]
    base = _config(args, global_batch=args.global_batch, speeds=speeds, subset=args.subset, test_subset=200,
                   threads=args.threads)
    times = {s: {"spin": [], "sleep": []} for s in strategies}
    for rep in range(repeats):
        for strategy in strategies:
            for policy in (("spin", "sleep") if rep % 2 == 0 else ("sleep", "spin")):
                cfg = base.replace(strategy=strategy, wait_policy=policy, seed=rep)
                rec = _train_epoch(comm, cfg, folder / f"wait-{strategy}-{policy}-{rep}.h5")
                times[strategy][policy].append(float(rec["duration"]))
    ratios = {s: [a / b for a, b in zip(t["spin"], t["sleep"])] for s, t in times.items()}
    return {"case": "wait", "world_size": comm.Get_size(), "speeds": list(base.speeds), "cores": available_cores(),
            "global_batch": base.global_batch, "repeats": repeats, "times": times, "ratios": ratios,
            "oversubscribed": _oversubscribed(comm),
            "checks": [check(f"{s} epoch time: spin / sleep ({comm.Get_size()} ranks)", _med(r), None)
                       for s, r in ratios.items()]}


def format_wait(report: dict) -> str:
    lines = [f"bench wait: {report['world_size']} ranks on {report['cores']} cores, speeds {report['speeds']}, "
             f"global batch {report['global_batch']}, {report['repeats']} repeats" + _flag(report),
             f"{'strategy':<8} {'policy':<6} {'epoch s (median)':>16}  repeats"]
    for s, t in report["times"].items():
        for policy, ts in t.items():
            lines.append(f"{s:<8} {policy:<6} {_med(ts):>16.3f}  {_reps(ts)}")
        lines.append(f"{s:<8} spin/sleep epoch-time ratio: median {_med(report['ratios'][s]):.3f} "
                     f"(repeats {_reps(report['ratios'][s])})")
    return "\n".join(lines)
