"""`dbs-mpi bench exchange`: the framework's gradient exchange vs a raw mpi4py Allreduce of
the same bytes, LeNet-5 and MLP sizes, 2 ranks (target: at most 1.10x).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ...training.exchange import GradientExchange
from .harness import _bench_model, _on_first, _oversubscribed, _timed
from .report import _flag, _med, _reps, check


def case_exchange(comm, args, folder) -> dict:
    return _on_first(comm, 2, _exchange, args)


def _exchange(comm, args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    repeats = args.repeats or 5
    iters = args.iterations
    weight = 1.0 / comm.Get_size()
    out = {"case": "exchange", "world_size": comm.Get_size(), "repeats": repeats, "iterations": iters,
           "oversubscribed": _oversubscribed(comm), "models": {}}
    checks = []
    for name in [m for m in args.models.split(",") if m]:
        model = _bench_model(name)
        sleep = GradientExchange(comm, model.parameters(), sleep_while_waiting=True)
        spin = GradientExchange(comm, model.parameters())    # last: the .grad tensors view its buffer
        times = _alternating(_exchange_variants(comm, model, spin, sleep, weight), repeats, iters, comm.Barrier)
        ratios = [f / r for f, r in zip(times["framework"], times["raw"])]
        record = out["models"][name] = {
            "bytes": 4 * (spin.numel + 1), "times": times, "ratio": ratios,
            "ratio_loss_apart": [a / r for a, r in zip(times["raw, loss apart"], times["raw"])],
            "ratio_sleep": [s / r for s, r in zip(times["framework, sleep"], times["raw"])],
            "ratio_scaling": [s / r for s, r in zip(times["framework, scaling"], times["raw"])]}
        checks += [check(f"{name} exchange / raw Allreduce ({record['bytes'] // 1000} kB)", _med(ratios), 1.10, "<="),
                   check(f"{name} loss in own Allreduce / in the buffer", _med(record["ratio_loss_apart"]), None),
                   check(f"{name} plain backward + scaling pass / raw", _med(record["ratio_scaling"]), None),
                   check(f"{name} sleeping exchange / raw Allreduce", _med(record["ratio_sleep"]), None)]
        spin.close()
        sleep.close()
    out["checks"] = checks
    return out


def _exchange_variants(comm, model, spin, sleep, weight) -> dict:
    """{variant: (prepare, run)}: the framework's exchange (spinning, without the seeded
    backward's scaling, sleeping) and a raw Allreduce of the same bytes (loss in the
    buffer, or apart)."""
    raw = np.ones(spin.numel + 1, dtype=np.float32)
    grads_only = raw[:-1]
    loss = raw[-1:]
    params = list(model.parameters())

    def step_start(ex, seeded=True, last=None):
        """What a training step does before the exchange (untimed, the same for every
        variant: it changes the caches): zero_grad with the weight, a backward (seeded
        with the weight as strategy.backward does, or plain), non-zero gradients. The
        buffer that the timed call sends is written last (warm in cache for everybody)."""
        ex.zero_grad(weight)
        dummy = sum((p * 0).sum() for p in params)
        ex.backward(dummy) if seeded else dummy.backward()
        if last is raw:
            ex.flat.fill_(1.0)
            raw.fill(1.0)
        else:
            raw.fill(1.0)
            ex.flat.fill_(1.0)

    return {
        "framework": (lambda: step_start(spin), lambda: spin.allreduce(weight, 0.5)),
        "raw": (lambda: step_start(spin, last=raw), lambda: comm.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)),
        "raw, loss apart": (lambda: step_start(spin, last=raw),
                            lambda: (comm.Allreduce(MPI.IN_PLACE, grads_only, op=MPI.SUM),
                                     comm.Allreduce(MPI.IN_PLACE, loss, op=MPI.SUM))),
        "framework, scaling": (lambda: step_start(spin, False), lambda: spin.allreduce(weight, 0.5)),
        "framework, sleep": (lambda: step_start(sleep), lambda: sleep.allreduce(weight, 0.5)),
    }


def _alternating(variants: dict, repeats: int, iters: int, barrier) -> dict:
    """{variant: per repeat, the median seconds of its run()}: every iteration runs each
    variant's prepare() untimed, then its run() timed after a barrier, the variants in
    alternating order so that drift favours none."""
    times = {v: [] for v in variants}
    names = list(variants)
    for rep in range(repeats):
        samples = {v: [] for v in variants}
        for i in range(iters):
            for v in (names if (i + rep) % 2 == 0 else names[::-1]):
                prepare, run = variants[v]
                prepare()
                samples[v].append(_timed(run, barrier))
        for v in variants:
            times[v].append(_med(samples[v]))
    return times


def format_exchange(report: dict) -> str:
    lines = [f"bench exchange: {report['world_size']} ranks, {report['repeats']} repeats x {report['iterations']} "
             f"exchanges, median microseconds per exchange" + _flag(report),
             f"{'model':<8} {'bytes':>9} {'variant':<18} {'median us':>10}  repeats"]
    for name, m in report["models"].items():
        for v, ts in m["times"].items():
            us = [1e6 * t for t in ts]
            lines.append(f"{name:<8} {m['bytes']:>9} {v:<18} {_med(us):>10.1f}  {_reps(us, '{:.1f}')}")
        lines.append(f"{name:<8} framework/raw ratio: median {_med(m['ratio']):.3f} (repeats {_reps(m['ratio'])})")
    return "\n".join(lines)
