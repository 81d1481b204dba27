"""Replaying a recorded run: its configuration, placement and start-up calibration (never
its epoch or step timings) simulated on the machine's constants, the measured epoch times
set beside the prediction.
"""
from __future__ import annotations

import json
import time

import numpy as np

from .. import config as config_mod
from ..data import SPLIT_SIZES
from ..machine import Machine, ModelCost
from ...options import parse_couple
from ...planning import calibration
from .cluster import DEFAULT_NOISE, Cluster, Compute, emulators, step_factor
from .job import SYNC, Job
from .network import Network
from .parameter_server import simulate_async
from .sync import calibration_step, recorded_start, simulate_sync, startup_fit

# What a run recorded before these options existed did (dbs re-planned once per epoch).
LEGACY = {**config_mod.LEGACY, "dbs_window": 32, "slow_steps": (0, 0), "slow_seconds": (0.0, 0.0), "couple": ""}


def job_from_config(cfg: dict, model: ModelCost, data_per_sample: float) -> Job:
    samples = SPLIT_SIZES.get(cfg["dataset"], {}).get("train", cfg.get("synthetic_samples", 0))
    if cfg.get("subset"):
        samples = min(samples, cfg["subset"])
    cfg = {**LEGACY, **cfg}
    disturbances = {k: tuple(cfg[k]) if isinstance(cfg[k], list) else cfg[k]
                    for k in ("slow_rank", "slow_factor", "slow_epochs", "slow_steps", "slow_seconds", "sleep_prob",
                              "sleep_seconds", "sleep_epochs")}
    return Job(strategy=cfg["strategy"], model=model, samples=samples, global_batch=cfg["global_batch"],
               epochs=cfg["epochs"], speeds=tuple(cfg.get("speeds") or ()), couple=parse_couple(cfg["couple"]),
               drop_last=cfg["drop_last"],
               min_local_batch=cfg["min_local_batch"], max_local_batch=_share_bound(cfg),
               dbs_model=cfg["dbs_model"], dbs_smoothing=cfg["dbs_smoothing"], dbs_follow=cfg["dbs_follow"],
               dbs_min_gain=cfg["dbs_min_gain"], dbs_interval=str(cfg["dbs_interval"]), dbs_window=cfg["dbs_window"],
               participation=cfg["participation"], benchmark_steps=cfg["benchmark_steps"],
               softsync_n=cfg["softsync_n"], softsync_wait=cfg["softsync_wait"], seed=cfg["seed"],
               disturbances=disturbances, data_per_sample=data_per_sample, bucket_mb=cfg["bucket_mb"],
               first_bucket_mb=cfg["first_bucket_mb"])


def _share_bound(cfg: dict) -> int:
    """max_local_batch bounds the shares only where a rank cannot accumulate (Config.share_bound)."""
    return 0 if config_mod.accumulates(cfg["strategy"], cfg.get("sync_bn", False)) else cfg["max_local_batch"]


def replay_job(path, machine: Machine) -> tuple[Job, Cluster, Network, dict, dict]:
    """(job, cluster, network, config, start-up calibration) of a recorded run's inputs."""
    inputs = read_inputs(path)
    cfg = inputs["config"]
    if cfg["model"] not in machine.models:
        raise ValueError(f"{path}: the machine file has no costs for model {cfg['model']!r}")
    shape = tuple(cfg["synthetic_shape"]) if cfg["dataset"] == "synthetic" else \
        ((3, 32, 32) if cfg["dataset"] == "cifar10" else (1, 28, 28))
    job = job_from_config(cfg, machine.models[cfg["model"]], machine.data_cost(shape))
    job.residual, job.compute_extra = dict(machine.residual), dict(machine.compute_extra)
    job.global_batches = inputs.get("global_batches", ())
    nodes, cores = placement_of(inputs, machine)
    cluster = Cluster(nodes=nodes, cores=cores, device=np.ones(len(nodes)), sleeping=inputs["sleeping"],
                      hosts=np.array(inputs["hostnames"]))
    network = Network(machine.alpha, machine.beta, "auto", machine.sleep_wait, machine.oversubscribed_message)
    timed = len(inputs["startup"].get("step_time", ()))
    if timed and timed != cluster.size:           # (a resume keeps the first launch's startup/*, its own hosts)
        raise ValueError(f"{path}: its calibration timed {timed} rank(s) and its last launch ran {cluster.size}; "
                         f"a run resumed on another number of ranks is not replayed")
    return job, cluster, network, cfg, inputs["startup"]


def read_inputs(path) -> dict:
    """What a replay may read of a run: its configuration, placement and start-up
    calibration, and where its global batch adapted the B of every epoch (chosen from the
    noise scale the run measured, which a simulation cannot); never its epoch or step timings."""
    import h5py
    with h5py.File(path, "r") as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        startup = {k: f[f"startup/{k}"][()] for k in ("local_batch", "step_time", "tiny_time", "batch_sizes",
                                                        "alone_time", "timed_large")
                   if f"startup/{k}" in f and len(f[f"startup/{k}"])}      # (empty: killed before its calibration)
        sizes = tuple(int(b) for b in f["epoch/global_batch"][()]) if "epoch/global_batch" in f else ()
    return {"config": json.loads(attrs["config"]), "hostnames": list(attrs["hostnames"]),
            "rank_cores": list(attrs.get("rank_cores", [])), "sleeping": bool(attrs.get("sleep_while_waiting", False)),
            "startup": startup, "global_batches": sizes}


def placement_of(inputs: dict, machine: Machine) -> tuple[np.ndarray, list]:
    """(node of every rank, cores of every node): ranks of a host with the same affinity set
    share those cores; without affinity sets (older files), a host's ranks share its cores."""
    hosts, sets = inputs["hostnames"], inputs["rank_cores"] or [""] * len(inputs["hostnames"])
    keys = [(h, c) for h, c in zip(hosts, sets)]
    groups = sorted(set(keys))
    nodes = np.array([groups.index(k) for k in keys])
    cores = [len(c.split(",")) if c else machine.cores for _, c in groups]
    return nodes, cores


def load_factor(job: Job, cluster: Cluster, startup: dict) -> float:
    """How much slower (above 1) or faster (below) than the machine constants the run's own
    calibration was: the smallest ratio over ranks and local batches of measured to
    simulated step times (noise only ever adds time), over the times that were timed, not
    read off (calibration.timed: a rank much slower at the tiny batch, by `tiny_time`, has
    both read off, a rank that timed a smaller large batch, by `timed_large`, its time at
    the large one; a file without them, none). Background load makes it larger; a machine
    whose speed moves on its own, as VMs' does, makes it either."""
    if "step_time" not in startup:
        return 1.0
    factor = step_factor(emulators(job, cluster.size), cluster)     # the calibration: every rank computes
    compute = Compute(job, cluster, 0.0, None)
    simulated = np.stack([calibration_step(compute, cluster, factor, b) for b in startup["local_batch"]], axis=1)
    times = np.asarray(startup["step_time"])
    timed = calibration.timed(startup.get("tiny_time", ()), times, *startup["local_batch"][:2],
                              startup.get("timed_large"))
    load = float(np.min(times[timed] / simulated[timed], initial=np.inf))
    return load if np.isfinite(load) and load > 0 else 1.0       # (a calibration without a time: none)


def replay(path, machine: Machine, noise: float | None = None, seed: int = 0) -> dict:
    """Predict a recorded run's epoch times from its inputs (read_inputs), then set the
    measured ones beside them. noise: the machine's measured step-time spread unless given."""
    job, cluster, network, cfg, startup = replay_job(path, machine)
    if noise is None:
        noise = machine_noise(machine, cluster)
    load = load_factor(job, cluster, startup)
    fit = startup_fit(job, startup, cluster.size)
    start = time.perf_counter()
    if job.strategy in SYNC:
        result = simulate_sync(job, cluster, network, noise, seed, load, startup.get("batch_sizes"), fit,
                               recorded_start(job, cluster, startup, fit))
    else:
        result = simulate_async(job, cluster, network, noise, seed, load, None, fit, cfg["checkpoint_every"])
    result.simulate_seconds = time.perf_counter() - start
    return {"run": str(path), "strategy": job.strategy, "world_size": cluster.size, "load_factor": load,
            "status": inputs_status(path), **result.as_dict(), "epoch_time_measured": measured_epochs(path)}


def machine_noise(machine: Machine, cluster: Cluster) -> np.ndarray:
    """Every rank's spread of a step's compute time on the machine: larger on a node with
    more ranks than cores (the scheduler's time slices); 0.03 if the machine file does not say."""
    crowded = (np.bincount(cluster.nodes) > cluster.node_cores())[cluster.nodes]
    return np.where(crowded, machine.noise.get("crowded", DEFAULT_NOISE), machine.noise.get("alone", DEFAULT_NOISE))


def inputs_status(path) -> str:
    import h5py
    with h5py.File(path, "r") as f:
        status = f.attrs.get("status", "unknown")
    return status.decode() if isinstance(status, bytes) else str(status)


def measured_epochs(path) -> list[float]:
    import h5py
    with h5py.File(path, "r") as f:
        return [float(t) for t in f["epoch/duration"][()]] if "epoch/duration" in f else []


def _measured_note(out: dict) -> str:
    """A replayed run that recorded no epoch (it stopped, failed or was killed first)."""
    if "run" not in out or out.get("epoch_time_measured"):
        return ""
    return (f"{out['run']}: the run recorded no epoch (status {out.get('status', 'unknown')}): predictions "
            f"only, nothing measured to compare them with")
