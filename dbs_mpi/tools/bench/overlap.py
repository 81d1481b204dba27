"""`dbs-mpi bench overlap`: gradient buckets reduced during backward vs one bucket after it
(is overlap worth it here?), 2 ranks, lean step loop.
"""
from __future__ import annotations

import time

from ...training.exchange import BUCKET_BYTES, FIRST_BUCKET_BYTES, GradientExchange
from ..data import load_synthetic
from .harness import SAMPLE_SHAPES, _bench_model, _on_first, _oversubscribed
from .report import _flag, _med, _reps, check

CHUNK = 10                  # overlap: steps of one variant before the next variant runs
OVERLAP_BUDGET = 10.0       # overlap: seconds per model and repeat after which no new chunk starts


def case_overlap(comm, args, folder) -> dict:
    return _on_first(comm, 2, _overlap, args)


def _overlap(comm, args) -> dict:
    """Median step time of a lean loop (zero_grad, forward, backward, exchange, SGD
    step) with one bucket, with small buckets reduced during backward, and with the
    same small buckets all reduced after backward."""
    import torch

    torch.set_num_threads(args.threads)
    repeats = args.repeats or 5
    steps, warmup = max(args.steps // 3, CHUNK), 2
    b = args.local_batch
    rows = slice(comm.Get_rank() * b, (comm.Get_rank() + 1) * b)
    small = int(args.bucket_kb * 1024), int(args.first_bucket_kb * 1024)
    ddp_caps = (BUCKET_BYTES, FIRST_BUCKET_BYTES)
    variants = {"one bucket": ((0, 0), True), "DDP caps, overlap": (ddp_caps, True), "buckets, overlap": (small, True),
                "buckets, after backward": (small, False)}
    out = {"case": "overlap", "world_size": comm.Get_size(), "repeats": repeats, "steps": steps, "local_batch": b,
           "bucket_kb": args.bucket_kb, "first_bucket_kb": args.first_bucket_kb,
           "oversubscribed": _oversubscribed(comm), "models": {}}
    checks = []
    for name in [m for m in args.overlap_models.split(",") if m]:
        torch.manual_seed(0)
        model = _bench_model(name)
        data = load_synthetic("train", b * comm.Get_size(), SAMPLE_SHAPES.get(name, (1, 28, 28)), 10, seed=1)
        x, y = data.x[rows], data.y[rows]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        times = {v: [] for v in variants}
        buckets = {}
        for rep in range(repeats):
            per_step = {v: [] for v in variants}
            began = time.perf_counter()
            for chunk in range(max(steps // CHUNK, 1)):       # variants interleaved every CHUNK steps: noise hits all
                # the same number of chunks on every rank: rank 0's clock decides (big models: fewer steps)
                if chunk and comm.bcast(time.perf_counter() - began > OVERLAP_BUDGET, root=0):
                    break
                names = list(variants)
                for v in (names if (chunk + rep) % 2 == 0 else names[::-1]):
                    seconds, buckets[v] = _lean_steps(comm, model, optimizer, x, y, *variants[v], warmup)
                    per_step[v] += seconds
            for v in variants:
                times[v].append(_med(per_step[v]))
        ratio = [a / o for a, o in zip(times["one bucket"], times["buckets, overlap"])]
        ratio_ddp = [a / o for a, o in zip(times["one bucket"], times["DDP caps, overlap"])]
        ratio_after = [a / o for a, o in zip(times["buckets, after backward"], times["buckets, overlap"])]
        out["models"][name] = {"times": times, "buckets": buckets, "ratio": ratio, "ratio_ddp": ratio_ddp,
                               "ratio_after": ratio_after}
        if buckets["DDP caps, overlap"] > 1:
            checks.append(check(f"{name} step: 1 bucket / {buckets['DDP caps, overlap']} (DDP caps) overlapped",
                                _med(ratio_ddp), None))
        checks.append(check(f"{name} step: 1 bucket / {buckets['buckets, overlap']} small overlapped",
                            _med(ratio), None))
        checks.append(check(f"{name} step: small buckets after backward / overlapped", _med(ratio_after), None))
    out["checks"] = checks
    return out


def _lean_steps(comm, model, optimizer, x, y, caps, overlap: bool, warmup: int) -> tuple[list[float], int]:
    """CHUNK timed steps (after `warmup` untimed ones) of the lean loop with an exchange of
    these bucket caps (bytes: buckets, first bucket), reducing during backward or after;
    returns their seconds and the exchange's number of buckets."""
    import torch.nn.functional as F
    weight = 1.0 / comm.Get_size()
    ex = GradientExchange(comm, model.parameters(), bucket_bytes=caps[0], first_bucket_bytes=caps[1], overlap=overlap)
    buckets, seconds = ex.num_buckets, []
    for i in range(warmup + CHUNK):
        start = time.perf_counter()
        ex.zero_grad(weight)
        loss = F.cross_entropy(model(x), y)
        ex.backward(loss)
        ex.allreduce(weight, loss.item() * weight)
        optimizer.step()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    ex.close()
    return seconds, buckets


def format_overlap(report: dict) -> str:
    lines = [f"bench overlap: {report['world_size']} ranks, local batch {report['local_batch']}, buckets of "
             f"{report['bucket_kb']:g} KiB (first {report['first_bucket_kb']:g} KiB), {report['steps']} steps, "
             f"{report['repeats']} repeats" + _flag(report),
             f"{'model':<8} {'variant':<24} {'buckets':>7} {'step ms (median)':>16}  repeats"]
    for name, m in report["models"].items():
        for v, ts in m["times"].items():
            lines.append(f"{name:<8} {v:<24} {m['buckets'][v]:>7} {1e3 * _med(ts):>16.3f}  "
                         f"{_reps([1e3 * t for t in ts])}")
        lines.append(f"{name:<8} one bucket / small buckets overlapped: median {_med(m['ratio']):.3f} (repeats "
                     f"{_reps(m['ratio'])}); > 1 means overlap helps")
    return "\n".join(lines)
