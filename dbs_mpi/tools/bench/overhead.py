"""`dbs-mpi bench overhead`: one rank, the framework's epoch vs a plain PyTorch loop over the
same batches (target: at most 1.05x).
"""
from __future__ import annotations

from ..train import load_data
from .harness import _config, _on_first, _train_epoch
from .plain import _plain_epoch
from .report import _med, _reps, check


def case_overhead(comm, args, folder) -> dict:
    return _on_first(comm, 1, _overhead, args, folder)


def _overhead(comm, args, folder) -> dict:
    import torch

    repeats = args.repeats or 5
    samples = args.local_batch * args.steps
    cfg = _config(args, strategy="ssgd", global_batch=args.local_batch, subset=samples, synthetic_samples=samples)
    train_set = load_data(cfg)[0]
    times = {"dbs-mpi": [], "plain": []}
    for rep in range(repeats):
        for v in (("dbs-mpi", "plain") if rep % 2 == 0 else ("plain", "dbs-mpi")):
            if v == "plain":
                torch.set_num_threads(args.threads)
                times[v].append(_plain_epoch(comm, cfg.replace(seed=rep), train_set))
            else:
                times[v].append(float(_train_epoch(comm, cfg.replace(seed=rep), folder / f"overhead-{rep}.h5")
                                      ["duration"]))
    ratios = [a / b for a, b in zip(times["dbs-mpi"], times["plain"])]
    per_step = [(a - b) / args.steps for a, b in zip(times["dbs-mpi"], times["plain"])]
    return {"case": "overhead", "world_size": 1, "repeats": repeats, "model": cfg.model,
            "local_batch": args.local_batch,
            "steps": args.steps, "threads": args.threads, "times": times, "ratio": ratios,
            "overhead_per_step": per_step, "oversubscribed": False,
            "checks": [check(f"1 rank epoch / plain PyTorch loop ({cfg.model}, batch {args.local_batch})",
                             _med(ratios), 1.05, "<=")]}


def format_overhead(report: dict) -> str:
    lines = [f"bench overhead: 1 rank, {report['model']}, batch {report['local_batch']}, {report['steps']} steps, "
             f"{report['threads']} torch thread(s), {report['repeats']} repeats",
             f"{'variant':<8} {'epoch s (median)':>16}  repeats"]
    for v, ts in report["times"].items():
        lines.append(f"{v:<8} {_med(ts):>16.3f}  {_reps(ts)}")
    lines.append(f"dbs-mpi/plain epoch-time ratio: median {_med(report['ratio']):.3f} (repeats "
                 f"{_reps(report['ratio'])}); overhead per step: median "
                 f"{1e6 * _med(report['overhead_per_step']):.0f} us")
    return "\n".join(lines)
