"""`dbs-mpi bench ddp`: uniform 2-rank training throughput vs torch DistributedDataParallel
(gloo), same model, local batch, data and threads (target: at least 1.0x).
"""
from __future__ import annotations

import socket

from ..train import load_data
from .harness import _config, _on_first, _oversubscribed, _train_epoch
from .plain import _plain_epoch
from .report import _flag, _med, _reps, check


def case_ddp(comm, args, folder) -> dict:
    return _on_first(comm, 2, _ddp, args, folder)


def _free_port(comm) -> int:
    port = 0
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return comm.bcast(port, root=0)


def _ddp(comm, args, folder) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    repeats = args.repeats or 5
    n = comm.Get_size()
    samples = args.local_batch * n * args.steps
    cfg = _config(args, strategy="ssgd", global_batch=args.local_batch * n, subset=samples, synthetic_samples=samples)
    train_set = load_data(cfg)[0]
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port(comm)}", rank=comm.Get_rank(),
                            world_size=n)
    times = {"dbs-mpi": [], "ddp": []}
    try:
        for rep in range(repeats):
            for v in (("dbs-mpi", "ddp") if rep % 2 == 0 else ("ddp", "dbs-mpi")):
                if v == "ddp":
                    torch.set_num_threads(args.threads)
                    times[v].append(_plain_epoch(comm, cfg.replace(seed=rep), train_set, DistributedDataParallel))
                else:
                    rec = _train_epoch(comm, cfg.replace(seed=rep), folder / f"ddp-ours-{rep}.h5")
                    times[v].append(float(rec["duration"]))
    finally:
        dist.destroy_process_group()
    throughput = {v: [samples / t for t in ts] for v, ts in times.items()}
    ratios = [a / b for a, b in zip(throughput["dbs-mpi"], throughput["ddp"])]
    return {"case": "ddp", "world_size": n, "repeats": repeats, "model": cfg.model, "local_batch": args.local_batch,
            "steps": args.steps, "threads": args.threads, "oversubscribed": _oversubscribed(comm), "times": times,
            "throughput": throughput, "ratio": ratios,
            "checks": [check(f"dbs-mpi / DDP gloo throughput ({cfg.model}, {n}x{args.local_batch})", _med(ratios),
                             1.0, ">=")]}


def format_ddp(report: dict) -> str:
    lines = [f"bench ddp: {report['world_size']} ranks, {report['model']}, local batch {report['local_batch']}, "
             f"{report['steps']} steps, {report['threads']} torch thread(s) per rank, {report['repeats']} repeats"
             + _flag(report),
             f"{'variant':<8} {'samples/s (median)':>18}  repeats"]
    for v, xs in report["throughput"].items():
        lines.append(f"{v:<8} {_med(xs):>18.0f}  {_reps(xs, '{:.0f}')}")
    lines.append(f"dbs-mpi/ddp throughput ratio: median {_med(report['ratio']):.3f} (repeats {_reps(report['ratio'])})")
    return "\n".join(lines)
