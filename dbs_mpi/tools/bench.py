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
import socket
import statistics
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..mpi import comm as mpi, devices
from ..options import UserError
from ..planning import allocation, sharding
from ..training import sync_batchnorm
from ..training.exchange import BUCKET_BYTES, FIRST_BUCKET_BYTES, GradientExchange
from ..training.results import git_revision, versions
from . import bench_tracking as tracking
from .config import ArgumentParser
from .config import load as load_config
from .data import load_synthetic
from .models import MLP, build_model
from .train import load_data, train

IDLE_POLL = 0.01            # seconds between polls of a rank that sits a case out
CHUNK = 10                  # overlap: steps of one variant before the next variant runs
OVERLAP_BUDGET = 10.0       # overlap: seconds per model and repeat after which no new chunk starts
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


# --- checks and the table ---------------------------------------------------------

def check(name: str, value: float, target: float | None, op: str = "<=") -> dict:
    """One line of the final table: a measured ratio against its target (None = report only)."""
    met = None if target is None else bool(value <= target if op == "<=" else value >= target)
    return {"name": name, "value": float(value), "target": target, "op": op, "met": met}


def format_table(reports: list[dict]) -> str:
    lines = [f"{'case':<9} {'measure':<56} {'median':>8} {'target':>9}  verdict"]
    for r in reports:
        for c in r["checks"]:
            target = "-" if c["target"] is None else f"{c['op']} {c['target']:.2f}"
            verdict = "info" if c["met"] is None else ("met" if c["met"] else "MISSED")
            lines.append(f"{r['case']:<9} {c['name']:<56} {c['value']:>8.3f} {target:>9}  {verdict}")
    return "\n".join(lines)


def _flag(report: dict) -> str:
    return "  [OVERSUBSCRIBED: more ranks than cores]" if report.get("oversubscribed") else ""


def _med(xs) -> float:
    return float(statistics.median(xs))


def _reps(xs, fmt="{:.3f}") -> str:
    return " ".join(fmt.format(x) for x in xs)


# --- helpers ------------------------------------------------------------------------

def _sub(comm, k: int):
    """The first k ranks of comm as a communicator (None on the others). Collective."""
    sub = comm.Split(0 if comm.Get_rank() < k else MPI.UNDEFINED, comm.Get_rank())
    return None if sub == MPI.COMM_NULL else sub


def _on_first(comm, k: int, fn, *args):
    """fn(sub, *args) on the first k ranks; the others sleep until they are done."""
    if comm.Get_size() < k:
        raise UserError(f"this case needs {k} ranks, the job has {comm.Get_size()}: mpirun -n {k} dbs-mpi bench ...")
    sub = _sub(comm, k)
    result = None
    if sub is not None:          # an exception here aborts the job (cli: abort_on_uncaught): nobody waits
        result = fn(sub, *args)
        sub.Free()
    mpi.barrier(comm, max_pause=IDLE_POLL)
    return result


def _config(args, **values):
    base = dict(dataset=args.dataset, model=args.model, data_dir=args.data_dir, epochs=1, test_subset=200,
                progress=False, threads=args.threads, device=args.device, exchange=args.exchange,
                synthetic_shape=args.synthetic_shape, synthetic_samples=args.synthetic_samples)
    if args.devices:
        base["devices"] = args.devices
    base.update(values)
    return load_config(None, base)


def _train_epoch(comm, cfg, path: Path) -> dict:
    """One training run with `train`; its last epoch's record (rank 0's view)."""
    summary = train(comm, cfg, out=str(path), log=lambda msg: None)
    return summary.epochs[-1]


def _timed(fn, barrier) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _oversubscribed(comm) -> bool:
    return mpi.oversubscribed(mpi.placement(comm))


# --- exchange -----------------------------------------------------------------------

SAMPLE_SHAPES = {"resnet20": (3, 32, 32), "cifar-cnn": (3, 32, 32)}   # the others: 1x28x28


def _bench_model(name: str):
    """A model of models.py for its usual inputs, or "mlp-wide": the MLP with two hidden
    layers of 1024 (1.86 M parameters, 7.4 MB of gradients: two buckets at DDP's caps)."""
    if name == "mlp-wide":
        return MLP(784, 10, hidden=(1024, 1024))
    return build_model(name, SAMPLE_SHAPES.get(name, (1, 28, 28)), 10)


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


# --- ddp ------------------------------------------------------------------------------

def case_ddp(comm, args, folder) -> dict:
    return _on_first(comm, 2, _ddp, args, folder)


def _free_port(comm) -> int:
    port = 0
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return comm.bcast(port, root=0)


def _plain_epoch(comm, cfg, train_set, wrap=None, warmup: int = 5) -> float:
    """Seconds of one epoch of a plain PyTorch loop over this rank's batches (the same
    shards as `train` with equal local batches); `wrap` turns the model into e.g. DDP."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(cfg.seed)
    device = devices.select(comm, cfg.device, cfg.devices or None, threads=False)
    model = build_model(cfg.model, train_set.sample_shape, train_set.num_classes).to(device)
    if wrap is not None:
        model = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    vector = allocation.equal(cfg.global_batch, comm.Get_size())
    shard = sharding.epoch_shard(len(train_set), 0, cfg.seed, cfg.global_batch, vector, comm.Get_rank())

    def step(idx):
        x, y = devices.to_device((train_set.x[idx], train_set.y[idx]), device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        loss.item()                     # (on a GPU: waits for the step, as dbs-mpi's loop does)
        optimizer.step()

    for idx in shard[:warmup]:
        step(idx)
    mpi.barrier(comm)
    start = time.perf_counter()
    for idx in shard:
        step(idx)
    devices.synchronize(device)
    return time.perf_counter() - start


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


# --- hetero ----------------------------------------------------------------------------

def case_hetero(comm, args, folder) -> dict:
    if args.speeds == "none":
        return _on_first(comm, comm.Get_size(), _hetero, args, folder)
    speeds = [float(s) for s in args.speeds.split(",") if s]
    return _on_first(comm, len(speeds), _hetero, args, folder)


def train_samples(cfg) -> int:
    """Training samples of an epoch of cfg (the dataset's size, or its subset)."""
    full = {"fashion-mnist": 60000, "mnist": 60000, "cifar10": 50000}.get(cfg.dataset, cfg.synthetic_samples)
    return min(cfg.subset, full) if cfg.subset else full


def ideal_epoch_time(record: dict, samples: int, global_batch: int) -> dict:
    """N / sum_i v_i plus what no allocation can divide: the measured communication,
    optimiser update and data time (means over ranks). v_i is rank i's measured speed
    in this epoch (samples per second of pre-collective compute)."""
    if "rank_samples" in record:                  # dbs may have changed the vector within the epoch
        per_rank = np.asarray(record["rank_samples"])
    else:
        per_rank = sharding.step_batch_sizes(samples, global_batch, np.asarray(record["batch_sizes"])).sum(axis=0)
    speed = np.asarray(record["speed"], dtype=float)
    update = np.asarray(record["compute_time"], dtype=float) - per_rank / np.maximum(speed, 1e-12)
    compute = samples / float(speed.sum())
    comm_t = float(np.mean(record["comm_time"]))
    rest = float(np.mean(update + np.asarray(record["data_time"], dtype=float)))
    return {"compute": compute, "comm": comm_t, "update_data": rest, "ideal": compute + comm_t + rest}


def _hetero(comm, args, folder) -> dict:
    strategies = [s for s in args.strategies.split(",") if s]
    repeats = args.repeats or 3
    base = _config(args, global_batch=args.global_batch, speeds="" if args.speeds == "none" else args.speeds,
                   subset=args.subset, test_subset=1000, threads=0)
    samples = train_samples(base)
    times = {s: [] for s in strategies}
    ideal = {s: [] for s in strategies}
    parts = {s: [] for s in strategies}
    accuracy = {s: [] for s in strategies}
    vectors, measured = {}, {}
    for rep in range(repeats):
        for strategy in (strategies if rep % 2 == 0 else strategies[::-1]):
            rec = _train_epoch(comm, base.replace(strategy=strategy, seed=rep), folder / f"{strategy}-{rep}.h5")
            measured[strategy] = np.asarray(rec["speed"], dtype=float).tolist()
            part = ideal_epoch_time(rec, samples, base.global_batch)
            times[strategy].append(float(rec["duration"]))
            accuracy[strategy].append(float(rec["test_accuracy"]))
            ideal[strategy].append(part["ideal"])
            parts[strategy].append(part)
            vectors[strategy] = np.asarray(rec["batch_sizes"]).tolist()
    # mean(v)/min(v): the emulated speeds, or (real heterogeneity) the speeds ssgd measured
    speeds = np.array(base.speeds) if base.speeds else np.asarray(measured[strategies[0]], dtype=float)
    ideal_ratio = float(speeds.mean() / speeds.min())
    baseline = strategies[0]
    ratios = {s: [b / t for b, t in zip(times[baseline], times[s])] for s in strategies[1:]}
    to_ideal = {s: [t / i for t, i in zip(times[s], ideal[s])] for s in strategies}
    checks = [check(f"{baseline}/{s} epoch time / ideal mean(v)/min(v)={ideal_ratio:.2f}",
                    _med(ratios[s]) / ideal_ratio, 0.90, ">=") for s in strategies[1:]]
    checks += [check(f"{s} epoch time / (N/sum v_i + comm)", _med(to_ideal[s]), 1.10, "<=")
               for s in strategies if s != "ssgd"]
    return {"case": "hetero", "speeds": list(base.speeds) or "measured", "measured_speeds": measured,
            "devices": list(base.devices) or base.device, "global_batch": base.global_batch, "samples": samples,
            "ideal": ideal_ratio, "world_size": comm.Get_size(), "repeats": repeats, "times": times,
            "test_accuracy": accuracy, "batch_sizes": vectors, "ideal_time": ideal, "ideal_parts": parts,
            "oversubscribed": _oversubscribed(comm), "folder": str(folder), "ratios": ratios,
            "median_ratio": {s: _med(r) for s, r in ratios.items()}, "to_ideal": to_ideal, "checks": checks}


def format_hetero(report: dict) -> str:
    measured = {k: [round(v) for v in vs] for k, vs in report.get("measured_speeds", {}).items()}
    lines = [f"bench hetero: {report['world_size']} ranks, devices {report.get('devices', 'cpu')}, speeds "
             f"{report['speeds']}, global batch {report['global_batch']}, {report['repeats']} repeats" + _flag(report),
             f"measured speeds (samples/s of compute, last repeat): {measured}",
             f"{'strategy':<10} {'batch sizes':<22} {'epoch s (median)':>16} {'ideal s':>8} {'test acc':>8} "
             f"{'all repeats':<28}"]
    for s, ts in report["times"].items():
        accuracy = report.get("test_accuracy", {}).get(s, [float("nan")])
        lines.append(f"{s:<10} {str(report['batch_sizes'][s]):<22} {_med(ts):>16.3f} "
                     f"{_med(report['ideal_time'][s]):>8.3f} {_med(accuracy):>8.3f} {_reps(ts):<28}")
    ideal = report["ideal"]
    base = next(iter(report["times"]))
    for s, ratio in report["median_ratio"].items():
        verdict = "meets" if ratio >= 0.9 * ideal else "misses"
        lines.append(f"{base}/{s} epoch-time ratio: median {ratio:.3f} (repeats {_reps(report['ratios'][s])}); "
                     f"ideal mean(v)/min(v) = {ideal:.3f}; {ratio / ideal:.2f} of ideal, target >= 0.90: {verdict}")
    for s, r in report["to_ideal"].items():
        part = report["ideal_parts"][s][0]
        lines.append(f"{s} epoch time / ideal (N/sum v_i {part['compute']:.3f} s + comm {part['comm']:.3f} s + "
                     f"update and data {part['update_data']:.3f} s, first repeat): median {_med(r):.3f} "
                     f"(repeats {_reps(r)})")
    return "\n".join(lines)


# --- overhead -------------------------------------------------------------------------

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


# --- scaling ----------------------------------------------------------------------------

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
            "cores": mpi.available_cores(), "oversubscribed": any(over.values()), "checks": checks}


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


# --- overlap ----------------------------------------------------------------------------

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


# --- wait policy --------------------------------------------------------------------------

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
    return {"case": "wait", "world_size": comm.Get_size(), "speeds": list(base.speeds), "cores": mpi.available_cores(),
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


# --- batchnorm ------------------------------------------------------------------------------

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
            parts[v]["sync"].append(float(np.max(mpi.allgather_array(comm, [in_sync]))) / steps)
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
    return _med([_timed(lambda: mpi.broadcast_flat(floating, comm), comm.Barrier) for _ in range(calls)])


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


# --- tracking (dbs within the epoch) -------------------------------------------------------

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


# --- running and writing --------------------------------------------------------------------

RUNNERS = {"exchange": case_exchange, "ddp": case_ddp, "hetero": case_hetero, "overhead": case_overhead,
           "scaling": case_scaling, "overlap": case_overlap, "wait": case_wait, "tracking": case_tracking,
           "batchnorm": case_batchnorm}
FORMATTERS = {"exchange": format_exchange, "ddp": format_ddp, "hetero": format_hetero, "overhead": format_overhead,
              "scaling": format_scaling, "overlap": format_overlap, "wait": format_wait, "tracking": format_tracking,
              "batchnorm": format_batchnorm}
# `make bench` (all): shorter hetero and wait runs than their stand-alone defaults
ALL_DEFAULTS = {"subset": 20000}


def _write_arrays(group, prefix: str, value) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _write_arrays(group, f"{prefix}/{k}" if prefix else str(k), v)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        group[prefix] = np.asarray(value, dtype=float)


def write_report(reports: list[dict], path: Path, attrs: dict) -> None:
    """One HDF5 file: per case a group with the report (JSON attribute) and its number
    lists as datasets; the run's versions and hosts as root attributes."""
    import h5py
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        for r in reports:
            g = f.create_group(r["case"])
            g.attrs["report"] = json.dumps(r)
            _write_arrays(g, "", {k: v for k, v in r.items() if k != "checks"})
            g["check_value"] = np.asarray([c["value"] for c in r["checks"]], dtype=float)
            g.attrs["check_names"] = json.dumps([c["name"] for c in r["checks"]])


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


def _setup(argv, world_size: int):
    args = _parser().parse_args(argv)
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
    args = mpi.agree(comm, _setup, argv, comm.Get_size())
    cases = list(CASES) if args.case == "all" else [args.case]
    stamp = comm.bcast(datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), root=0)
    folder = Path(args.out_dir) / f"{args.case}-{stamp}"
    hosts = mpi.hostnames(comm)
    reports = []
    for case in cases:      # every rank runs every case (idle ranks sleep); a failure aborts the job
        report = RUNNERS[case](comm, args, folder)
        if comm.Get_rank() == 0:
            reports.append(report)
            print(FORMATTERS[case](report), flush=True)
            print(flush=True)
    if comm.Get_rank() == 0:
        path = folder / "summary.h5"
        attrs = {"command": "dbs-mpi bench " + " ".join(argv), "versions": json.dumps(versions(mpi.mpi_library())),
                 "git_revision": git_revision(), "hostnames": json.dumps(hosts), "world_size": comm.Get_size(),
                 "cores": mpi.available_cores(), "created": stamp}
        write_report(reports, path, attrs)
        print(format_table(reports))
        print(f"results: {path}")
    return 0
