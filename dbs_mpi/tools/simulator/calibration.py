"""The machine constants' calibration (`mpirun -n 2 dbs-mpi simulate calibrate`): the
network and compute constants (tools/machine.py), then the residuals: seconds real runs
of the engine take beyond the model, and the spread of a step's compute time. `--quick`
measures all of them from a few points (machine.QUICK: seconds, for a test).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ...mpi.collectives import barrier, bcast_object
from ...options import UserError
from ...planning import sharding
from ..config import ArgumentParser, Config
from ..fingerprint import MACHINES, describe, fingerprint
from ..machine import FULL, QUICK, Effort, Machine, calibrate, drift_note, steadiness
from .job import SYNC
from .replaying import load_factor, replay, replay_job


def mpi_bcast_tmp(comm) -> str:
    """A temporary folder that every rank of comm agrees on (rank 0 makes it)."""
    import tempfile

    return bcast_object(comm, tempfile.mkdtemp(prefix="dbs-mpi-calibrate-") if comm.Get_rank() == 0 else None)


EMULATED = (1.0, 0.25)        # speeds of the "emulated" run: a fast rank beside one whose slow-down sleeps


def residual_runs(cores: int, world: int) -> dict:
    """The real runs whose time beyond the model is the machine's residual: name ->
    (ranks, strategy). LeNet-5 on synthetic data, equal speeds but for "emulated"
    (speeds EMULATED, local batches of 256: the compute a training step adds, compute_extra)."""
    runs = {"emulated": (2, "ssgd"), "sync": (min(max(cores, 2), world), "ssgd"), "async": (min(cores + 1, world), "asgd")}
    if world > cores:
        runs["sync_crowded"] = (world, "ssgd")
    return runs


def measure_residuals(comm, machine: Machine, folder: Path, effort: Effort = FULL) -> dict:
    """Collective. First the compute a training step adds to the model's table
    (machine.compute_extra, from the "emulated" run), then the seconds real runs of this
    machine take beyond the model, per synchronous step ("sync": ranks on their own cores;
    "sync_crowded": more ranks than cores) and per gradient of a parameter-server worker
    ("async"): each is one short run of the engine (train.train on a sub-communicator; the
    other ranks sleep), replayed without residual; the median over its epochs after the
    first of (measured - predicted) / steps."""
    from ..train import train            # the engine (torch): only calibrating runs it
    runs, residual = residual_runs(machine.cores, comm.Get_size()), {}
    for name, (ranks, strategy) in runs.items():
        member = comm.Get_rank() < ranks
        sub = comm.Split(0 if member else 1)
        if member and ranks >= 2:
            local = 256 if name == "emulated" else 64
            cfg = Config(dataset="synthetic", synthetic_samples=effort.residual_samples, test_subset=100,
                         model="lenet5", epochs=effort.residual_epochs, speeds=EMULATED if name == "emulated" else (),
                         global_batch=local * (ranks - (strategy == "asgd")), strategy=strategy, benchmark_steps=3,
                         checkpoint_every=0, progress=False, threads=1)
            train(sub, cfg, out=str(folder / f"{name}.h5"), log=lambda msg: None)
        sub.Free()
        barrier(comm, timeout=3600)
    if comm.Get_rank() == 0:
        job, cluster, _, _, startup = replay_job(folder / "emulated.h5", machine)
        machine.compute_extra = compute_extra(folder / "emulated.h5", machine, load_factor(job, cluster, startup))
        machine.residual = {}
        machine.noise = {"alone": _spread(folder / "sync.h5")}
        machine.noise["crowded"] = _spread(folder / "sync_crowded.h5") if "sync_crowded" in runs else \
            machine.noise["alone"]
        for name in runs:
            if name != "emulated":
                residual[name] = _residual(folder / f"{name}.h5", machine)
    return residual


def compute_extra(path: Path, machine: Machine, load: float = 1.0) -> dict:
    """Seconds a training step's compute takes beyond the model's table (measured one rank
    at a time, nothing between the steps) on a rank of the "emulated" run that waits
    spinning (rank 0) and on one whose emulated slow-down sleeps (rank 1, which the
    engine stretches by its CPU time: its pre-collective time is factor x its compute):
    the means over the steps after the first epoch of pre_time / (factor x load) - table
    (means: an epoch lasts the sum of its steps, and a step's compute time has a long
    tail). load: the run's own load factor, as a replay reads it (replaying.load_factor):
    a machine that moved between its table and this run (a VM's speed moves by itself)
    would otherwise put the move into every replay's steps."""
    import h5py
    with h5py.File(path, "r") as f:
        pre, batches, epoch = f["step/pre_time"][()], f["step/batch_sizes"][()], f["step/epoch"][()]
    keep = (epoch > 0) & np.all(batches > 0, axis=1)
    factor = max(EMULATED) / np.asarray(EMULATED)
    extra = pre[keep] / (factor * load) - machine.models["lenet5"].compute(batches[keep])
    return {"spinning": max(0.0, float(extra[:, 0].mean())), "sleeping": max(0.0, float(extra[:, 1].mean()))}


def _spread(path: Path) -> float:
    """Lognormal sigma of a step's compute time in a run of equal ranks, from one step to
    the next: the standard deviation of the change of log(compute time) between
    consecutive steps after the first epoch, over sqrt(2), median over ranks. The spread
    around the run's mean would count the machine's slow moves (a VM's speed moves by
    itself, every rank's at once) as noise drawn afresh for every rank at every step,
    and so make the slowest rank's draw of a step too slow."""
    import h5py
    with h5py.File(path, "r") as f:
        times, epoch = f["step/compute_time"][()], f["step/epoch"][()]
    logs = np.log(np.maximum(times[epoch > 0], 1e-9))
    if len(logs) < 3:
        return 0.0                  # (no spread to read from a step or two)
    return float(np.median(np.diff(logs, axis=0).std(axis=0)) / np.sqrt(2))


def _residual(path: Path, machine: Machine) -> float:
    """Seconds per step (synchronous) or per gradient (a parameter-server worker) that a
    residual run took beyond its replay (machine.residual is empty while it is measured)."""
    out = replay(path, machine, seed=0)
    job = replay_job(path, machine)[0]
    if job.strategy in SYNC:
        per = sharding.steps_per_epoch(job.samples, job.global_batch, job.drop_last)
    else:
        per = job.samples / job.global_batch           # gradients per worker and epoch (equal local batches)
    pairs = list(zip(out["epoch_time_measured"], out["epoch_time_predicted"]))[1:]
    return max(0.0, float(np.median([(m - p) / per for m, p in pairs])))


def _calibrate(comm, argv) -> int:
    p = ArgumentParser(prog="dbs-mpi simulate calibrate", description="Measure the machine constants (run under "
                "mpirun -n 2 on one node, nothing else running).")
    p.add_argument("--out", metavar="FILE.json", help="where to write the constants (default: this machine's file, "
                   "results/machine/<fingerprint>.json, which replays on this hardware then read)")
    p.add_argument("--name", default="this machine")
    p.add_argument("--quick", action="store_true", help="a few points of each constant: seconds, not minutes "
                   "(a sane file for a test, not one to keep)")
    args = p.parse_args(argv)
    if comm.Get_size() < 2:
        raise UserError("simulate calibrate: run it under mpirun -n 2 or more, on one node (mpirun -n 4 on a "
                        "2-core machine also measures crowded collectives)")
    effort = QUICK if args.quick else FULL
    args.out = args.out or str(MACHINES / f"{fingerprint(describe())}.json")
    machine = calibrate(comm, args.name, effort)
    folder = Path(mpi_bcast_tmp(comm))
    machine.residual = measure_residuals(comm, machine, folder, effort)
    if comm.Get_rank() == 0:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
        machine.drift = steadiness(machine)
        machine.save(args.out)
        print(f"machine constants: {args.out} (alpha {machine.alpha * 1e6:.2f} us, beta "
              f"{1 / machine.beta / 1e9:.2f} GB/s, sleeping wait {machine.sleep_wait * 1e6:.0f} us, crowded "
              f"message {machine.oversubscribed_message * 1e6:.0f} us, {machine.cores} cores; step-time spread "
              + ", ".join(f"{k} {v:.3f}" for k, v in machine.noise.items()) + "; residuals "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in machine.residual.items()) + "; a training step's compute "
              + ", ".join(f"{k} +{v * 1e3:.2f} ms" for k, v in machine.compute_extra.items())
              + f"; the machine moved {machine.drift:+.1%} while it was measured)")
        if drift_note(machine.drift):
            print(drift_note(machine.drift), file=sys.stderr)
    return 0
