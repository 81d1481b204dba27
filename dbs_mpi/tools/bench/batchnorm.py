"""`dbs-mpi bench batchnorm`: ResNet-20 with GroupNorm, with BatchNorm, with synchronised
BatchNorm (sync_batchnorm.py), 2 ranks, even batches: time per step, the time in
SyncBatchNorm's collectives and the exchange's exposed wait.
"""
from __future__ import annotations

import numpy as np

from ...mpi.collectives import allgather_array, broadcast_flat
from ...training import sync_batchnorm
from ..train import train
from .harness import _config, _on_first, _oversubscribed, _timed
from .report import _flag, _med, _reps, check


BATCHNORM_VARIANTS = {"group": dict(norm="group"), "batch": dict(norm="batch"),
                      "batch, sync": dict(norm="batch", sync_bn=True)}


def case_batchnorm(comm, args, folder) -> dict:
    return _on_first(comm, 2, _batchnorm, args, folder)


def _batchnorm(comm, args, folder) -> dict:
    """ResNet-20's step with each normalisation, side by side (even local batches: the
    cost, not the allocation)."""
    repeats, steps = args.repeats or 3, args.batchnorm_steps
    n = comm.Get_size()
    base = _config(args, strategy="ssgd", model="resnet20", dataset="synthetic", synthetic_shape="3,32,32",
                   global_batch=args.local_batch * n, synthetic_samples=args.local_batch * n * steps,
                   test_subset=64, device="cpu", devices="", exchange="auto")
    times = {v: [] for v in BATCHNORM_VARIANTS}
    parts = {v: {"sync": [], "exposed": [], "buffers": []} for v in BATCHNORM_VARIANTS}
    for rep in range(repeats):
        for v in (list(BATCHNORM_VARIANTS) if rep % 2 == 0 else list(BATCHNORM_VARIANTS)[::-1]):
            summary = train(comm, base.replace(seed=rep, **BATCHNORM_VARIANTS[v]),
                            out=str(folder / f"batchnorm-{rep}-{v.replace(', ', '-')}.h5"), log=lambda msg: None)
            record = summary.epochs[-1]
            times[v].append(float(record["duration"]) / steps)
            layers = sync_batchnorm.layers(summary.model)
            in_sync = layers[0].channel.seconds if layers else 0.0
            parts[v]["sync"].append(float(np.max(allgather_array(comm, [in_sync]))) / steps)
            parts[v]["exposed"].append(float(np.mean(record["comm_time"])) / steps)
            parts[v]["buffers"].append(_buffer_broadcast(comm, summary.model))
    ratio = {v: [t / g for t, g in zip(times[v], times["group"])] for v in BATCHNORM_VARIANTS}
    checks = [check(f"resnet20 step, {v} / group", _med(ratio[v]), None) for v in ("batch", "batch, sync")]
    checks.append(check("resnet20 step, batch sync / batch", _med([a / b for a, b in zip(times["batch, sync"],
                                                                                          times["batch"])]), None))
    return {"case": "batchnorm", "world_size": n, "repeats": repeats, "steps": steps, "local_batch": args.local_batch,
            "threads": args.threads, "oversubscribed": _oversubscribed(comm), "times": times, "ratio": ratio,
            "parts": parts, "checks": checks}


def _buffer_broadcast(comm, model, calls: int = 30) -> float:
    """Median seconds of DistributedOptimizer's per-step broadcast of the model's
    floating-point buffers (0 when it has none: nothing is sent)."""
    floating = [b for b in model.buffers() if b.is_floating_point()]
    if not floating:
        return 0.0
    return _med([_timed(lambda: broadcast_flat(floating, comm), comm.Barrier) for _ in range(calls)])


def format_batchnorm(report: dict) -> str:
    lines = [f"bench batchnorm: {report['world_size']} ranks, resnet20, {report['local_batch']} samples a rank, "
             f"{report['steps']} steps, {report['repeats']} repeats" + _flag(report),
             f"{'variant':<12} {'ms/step':>8} {'/ group':>8} {'sync-BN ms':>10} {'exposed ms':>10} {'buffers us':>10}"
             f"  repeats (ms)"]
    for v, ts in report["times"].items():
        p = report["parts"][v]
        lines.append(f"{v:<12} {1e3 * _med(ts):>8.1f} {_med(report['ratio'][v]):>8.3f} {1e3 * _med(p['sync']):>10.2f} "
                     f"{1e3 * _med(p['exposed']):>10.2f} {1e6 * _med(p.get('buffers', [0.0])):>10.1f}  "
                     f"{_reps([1e3 * t for t in ts], '{:.1f}')}")
    lines.append("sync-BN ms: time in the layers' collectives per step, waits for slower ranks included; exposed ms: "
                 "the gradient exchange's wait after backward; buffers us: the per-step broadcast of the float buffers")
    return "\n".join(lines)
