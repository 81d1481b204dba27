"""What the cases stand on: a case runs on the first k ranks of the job (a sub-communicator:
library code takes any communicator) while the other ranks wait in a sleeping barrier;
a training run of the engine and its last epoch; a timed call; the models that the
exchange and overlap cases time at their usual inputs.
"""
from __future__ import annotations

import time
from pathlib import Path

from mpi4py import MPI

from ...mpi.collectives import barrier
from ...mpi.placement import oversubscribed, placement
from ...options import UserError
from ..config import load as load_config
from ..models import MLP, build_model
from ..train import train

IDLE_POLL = 0.01            # seconds between polls of a rank that sits a case out


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
    barrier(comm, max_pause=IDLE_POLL)
    return result


def _config(args, **values):
    base = dict(dataset=args.dataset, model=args.model, data_dir=args.data_dir, epochs=1, test_subset=200,
                progress=False, threads=args.threads, device=args.device, exchange=args.exchange,
                data_on_device=args.data_on_device,
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
    return oversubscribed(placement(comm))


def train_samples(cfg) -> int:
    """Training samples of an epoch of cfg (the dataset's size, or its subset)."""
    full = {"fashion-mnist": 60000, "mnist": 60000, "cifar10": 50000}.get(cfg.dataset, cfg.synthetic_samples)
    return min(cfg.subset, full) if cfg.subset else full


SAMPLE_SHAPES = {"resnet20": (3, 32, 32), "cifar-cnn": (3, 32, 32)}   # the others: 1x28x28


def _bench_model(name: str):
    """A model of models.py for its usual inputs, or "mlp-wide": the MLP with two hidden
    layers of 1024 (1.86 M parameters, 7.4 MB of gradients: two buckets at DDP's caps)."""
    if name == "mlp-wide":
        return MLP(784, 10, hidden=(1024, 1024))
    return build_model(name, SAMPLE_SHAPES.get(name, (1, 28, 28)), 10)
