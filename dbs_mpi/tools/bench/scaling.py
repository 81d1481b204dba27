"""`dbs-mpi bench scaling`: throughput at 1, 2 and 4 ranks (sub-communicators of the job),
local batch fixed; runs with more ranks than cores are marked.
"""
from __future__ import annotations

from ...mpi.placement import available_cores
from ...options import UserError
from .harness import _config, _on_first, _oversubscribed, _train_epoch
from .report import _med, _reps, check


def case_scaling(comm, args, folder) -> dict:
    sizes = sorted({int(k) for k in args.sizes.split(",") if k and int(k) <= comm.Get_size()})
    if not sizes:
        raise UserError(f"--sizes {args.sizes}: no size fits in the job's {comm.Get_size()} ranks")
    repeats = args.repeats or 3
    times = {k: [] for k in sizes}
    over = {}
    for rep in range(repeats):
        for k in (sizes if rep % 2 == 0 else sizes[::-1]):
            result = _on_first(comm, k, _scaling_run, args, folder, rep)
            if comm.Get_rank() == 0:
                times[k].append(result[0])
                over[k] = result[1]
    if comm.Get_rank() != 0:
        return {}
    throughput = {k: [args.local_batch * k * args.steps / t for t in ts] for k, ts in times.items()}
    one = throughput[sizes[0]]
    speedup = {k: [x / b for x, b in zip(xs, one)] for k, xs in throughput.items()}
    checks = [check(f"throughput {k} / {sizes[0]} rank(s){' [oversubscribed]' if over[k] else ''}",
                    _med(speedup[k]), None) for k in sizes[1:]]
    return {"case": "scaling", "sizes": sizes, "repeats": repeats, "model": args.model, "local_batch": args.local_batch,
            "steps": args.steps, "threads": args.threads, "times": {str(k): v for k, v in times.items()},
            "throughput": {str(k): v for k, v in throughput.items()},
            "speedup": {str(k): v for k, v in speedup.items()},
            "oversubscribed_at": {str(k): v for k, v in over.items()},
            "cores": available_cores(), "oversubscribed": any(over.values()), "checks": checks}


def _scaling_run(comm, args, folder, rep):
    k = comm.Get_size()
    cfg = _config(args, strategy="ssgd", global_batch=args.local_batch * k, subset=args.local_batch * k * args.steps,
                  seed=rep)
    rec = _train_epoch(comm, cfg, folder / f"scaling-{k}-{rep}.h5")
    return float(rec["duration"]), _oversubscribed(comm)


def format_scaling(report: dict) -> str:
    lines = [f"bench scaling: {report['model']}, local batch {report['local_batch']} per rank, {report['steps']} "
             f"steps, "
             f"{report['threads']} torch thread(s) per rank, {report['cores']} cores, {report['repeats']} repeats",
             f"{'ranks':>5} {'samples/s (median)':>18} {'speed-up':>9} {'efficiency':>10}  repeats"]
    for k in report["sizes"]:
        xs = report["throughput"][str(k)]
        sp = _med(report["speedup"][str(k)])
        mark = "  [oversubscribed]" if report["oversubscribed_at"][str(k)] else ""
        lines.append(f"{k:>5} {_med(xs):>18.0f} {sp:>9.2f} {sp * report['sizes'][0] / k:>10.2f}  "
                     f"{_reps(xs, '{:.0f}')}{mark}")
    return "\n".join(lines)
