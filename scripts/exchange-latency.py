"""Latency of the gradient exchange at two code revisions, side by side in one MPI job.

    .venv/bin/mpirun -n 2 .venv/bin/python scripts/exchange-latency.py --base dc09c60 --repeats 5

The package at --base is exported (`git archive`) into a temporary folder as
`dbs_mpi_base`, so that both versions of GradientExchange (training/exchange.py; exchange.py
before the layers, comm.py before it had a module of its own) live in the same processes. For each model, both exchanges are built over the same parameters (the .grad
tensors end up viewing the last one; both buffers are filled before each call) and timed
alternately: every repeat times `iterations` calls of each (a barrier before every call,
the order swapped from call to call), and keeps the median. Reported: the median over
repeats of each, and the median of the per-repeat ratios current / base. The wait policy
is "spin" unless --sleep (the spin path is the one the watchdog must not slow down).
With --step B every timed call is a whole training step instead (forward and backward
on B samples, the exchange, an SGD update), the step latency of the spin path.
With --telemetry the current exchange does what a step of `dbs` within the epoch adds:
it carries the balancer's 3 x ranks telemetry slots (every rank's step time, its
sampler's position, rank 0's proposal) and the Replanner reads them after every call
(the step-time estimate, its change check, and a re-estimate every 8 steps), so the
ratio is the whole per-step cost of re-planning within the epoch on the spin path.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def export_base(rev: str, folder: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "dbs_mpi"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    (folder / "dbs_mpi").rename(folder / "dbs_mpi_base")


def timed(comm, call) -> float:
    comm.Barrier()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def training_step(model, local_batch: int):
    """forward and backward of `model` on a fixed batch (the .grad views are the last
    exchange's buffer), and .update(): a plain SGD step from the reduced gradient."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(local_batch, 1, 28, 28, generator=g), torch.randint(10, (local_batch,), generator=g)

    def work():
        torch.nn.functional.cross_entropy(model(x), y).backward()

    def update():
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(1e-4 * p.grad)
    work.update = update
    return work


def make_replanner(comm):
    """The Replanner a 2-rank dbs run holds, its estimate settled on steady step times."""
    from dbs_mpi.planning.allocation import SpeedModel
    from dbs_mpi.planning.dynamic import Replanner
    n = comm.Get_size()
    model = SpeedModel(per_sample=np.full(n, 1e-4), overhead=np.full(n, 1e-3))
    return Replanner(comm.Get_rank(), n, 512, model=model)


def dbs_step(exchange, replanner, weight, step):
    """One exchange as a dbs step does it: telemetry out, the allreduce, the estimate in."""
    n = replanner.world_size
    vector = np.full(n, 512 // n)
    vector[0] += 512 - vector.sum()
    seconds = 1e-3 + 1e-4 * vector[replanner.rank] * (1.0 + 0.02 * np.sin(step))     # steady, a little noise
    telemetry = replanner.outgoing(seconds, step + 1)
    if not hasattr(exchange, "reduce"):                  # a revision before reduce() returned the sums
        loss = exchange.allreduce(weight, 0.5, telemetry)
        replanner.incoming(exchange.extra, vector, vector, step + 1)
        return loss
    sums = exchange.reduce(weight, None, 0.5, telemetry)
    replanner.incoming(sums.extra, vector, vector, step + 1)
    return sums.loss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision to compare with")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--models", default="lenet5,mlp")
    p.add_argument("--sleep", action="store_true", help="time the sleeping wait policy instead")
    p.add_argument("--telemetry", action="store_true", help="the current exchange carries and reads dbs's "
                   "within-epoch telemetry (see above)")
    p.add_argument("--step", type=int, default=0, metavar="LOCAL_BATCH", help="time a whole training step instead "
                   "of the exchange alone: forward and backward on LOCAL_BATCH samples, the exchange, an SGD update")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    folder = comm.bcast(tempfile.mkdtemp(prefix="exchange-latency-") if comm.Get_rank() == 0 else None)
    if comm.Get_rank() == 0:
        export_base(a.base, Path(folder))
    comm.Barrier()
    sys.path.insert(0, folder)
    base_module = next(m for m in ("training.exchange", "exchange", "comm")     # where it lived at that revision
                       if (Path(folder) / "dbs_mpi_base" / (m.replace(".", "/") + ".py")).exists())
    base_exchange = importlib.import_module(f"dbs_mpi_base.{base_module}")

    import dbs_mpi.training.exchange as current_exchange
    from dbs_mpi.tools.models import build_model
    weight = 1.0 / comm.Get_size()
    rows = []
    for name in a.models.split(","):
        model = build_model(name, (1, 28, 28), 10)
        work = training_step(model, a.step) if a.step else (lambda: None)
        replanner = make_replanner(comm) if a.telemetry else None
        extra = replanner.size if replanner is not None else 0
        variants = {"base": base_exchange.GradientExchange(comm, model.parameters(), 60, a.sleep),
                    "current": current_exchange.GradientExchange(comm, model.parameters(), 60, a.sleep, extra=extra)}
        calls = {"base": lambda ex, i: ex.allreduce(weight, 0.5),
                 "current": (lambda ex, i: ex.allreduce(weight, 0.5)) if replanner is None else
                 (lambda ex, i: dbs_step(ex, replanner, weight, i))}
        medians = {v: [] for v in variants}
        for rep in range(a.repeats):
            samples = {v: [] for v in variants}
            names = list(variants)
            for i in range(a.iterations):
                for v in (names if (i + rep) % 2 == 0 else names[::-1]):
                    ex = variants[v]
                    ex.zero_grad(weight)
                    ex.flat.fill_(1.0)
                    samples[v].append(timed(comm, lambda: (work(), calls[v](ex, rep * a.iterations + i),
                                                           work.update() if a.step else None)))
            for v in variants:
                medians[v].append(statistics.median(samples[v]))
        ratios = [c / b for c, b in zip(medians["current"], medians["base"])]
        rows.append((name, 4 * (variants["current"].numel + 1), medians, ratios))
        for ex in variants.values():
            ex.close()
    if comm.Get_rank() == 0:
        policy = "sleep" if a.sleep else "spin"
        print(f"{'step' if a.step else 'exchange'} latency, {comm.Get_size()} ranks, wait policy {policy}, "
              f"{a.repeats} repeats x {a.iterations} calls; base {a.base}, current: the working tree"
              + (", with dbs's within-epoch telemetry and re-planning" if a.telemetry else "")
              + (f"; a whole training step, local batch {a.step}" if a.step else ""))
        for name, size, medians, ratios in rows:
            us = {v: [1e6 * t for t in ts] for v, ts in medians.items()}
            print(f"{name:<7} {size:>8} B  base {statistics.median(us['base']):7.1f} us  current "
                  f"{statistics.median(us['current']):7.1f} us  current/base median {statistics.median(ratios):.3f} "
                  f"(repeats {' '.join(f'{r:.3f}' for r in ratios)})")
        subprocess.run(["rm", "-rf", folder])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
