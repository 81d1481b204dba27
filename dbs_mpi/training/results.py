"""Results: one HDF5 file per run, written by rank 0 only, flushed after every epoch.

The schema is SCHEMA_ATTRIBUTES and SCHEMA_DATASETS below: every dataset is written with
its `unit` and `description` as HDF5 attributes, and docs/results.md's tables are
generated from them (`python -m dbs_mpi.training.results --markdown`; tests/test_docs.py fails
when the two drift apart). E epochs, R ranks, S steps, U applied gradients, V vector changes within epochs, K checkpoints.
"""
from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..about import __version__
from ..options import UserError

# Root attributes: name -> meaning.
SCHEMA_ATTRIBUTES = {
    "status": "`running` while training, then `complete`, `failed` (an exception or a timeout; written by rank 0 "
              "if it is alive), `interrupted` (stopped on SIGUSR1, a scheduler's warning before a time limit, with "
              "a checkpoint: resume with `dbs-mpi train --resume FILE`; the job scripts requeue it) or `cancelled` "
              "(stopped on SIGTERM, a user's `scancel`/`qdel` or a preemption, with a checkpoint: resumable by hand "
              "the same way, never requeued by the job scripts). A `running` file whose job is gone is a crashed run; the job scripts "
              "mark it `failed` (`dbs-mpi close`) when the launch ends with every rank killed",
    "crashed": "set by `dbs-mpi close`: when and how the launch of a `running` run ended with no rank left to "
               "mark it `failed` (a lost node, SIGKILL)",
    "resumed": "ISO times at which the run was resumed (absent if never)",
    "segments": "JSON list, one entry per launch that trained this run (the first, then every resume): its "
                "`world_size`, `hostnames`, `rank_devices`, `device_names`, where it began (`epoch`, `step` in it, "
                "`run_step`, `time`) and `startup`, the calibration it made (null: none, or the start-up/* datasets "
                "for the first). A run resumed on another number of ranks has per-rank datasets as wide as its "
                "largest world: a rank that did not exist in a row reads NaN (-1 in integer datasets); an epoch "
                "in which the world changed has epoch/* of its last segment's steps",
    "config": "JSON of the whole configuration (`dbs-mpi train`: every field of `config.Config`; a Recorder: what "
              "the loop gave)",
    "strategy": "`ssgd`, `static`, `dbs`, `asgd`, `nsoftsync` or `dbs-sgd` (a Recorder: the balancer's policy)",
    "aggregation": "`weighted` or `mean`",
    "dataset": "built-in name or plug-in spec (`mypkg.data:load`)",
    "model": "built-in name or plug-in spec (`mypkg.nets:ResNet`)",
    "model_class": "the model's class, `module.QualifiedName`",
    "loss": "`cross-entropy` or the loss spec",
    "optimizer": "`sgd`, `adam` or `adamw`",
    "global_batch": "a Recorder's run: B, samples per step over all ranks",
    "world_size": "ranks",
    "num_parameters": "trainable values of the model",
    "hostnames": "host of every rank, rank order",
    "job_id": "the batch job (SLURM_JOB_ID or PBS_JOBID) of the run's latest launch, where there was one",
    "array_index": "its array task (SLURM_ARRAY_TASK_ID or PBS_ARRAYID), where there was one",
    "run_id": "the run's identity across requeues (DBS_MPI_RUN_ID, set by the job scripts): a job continues "
              "only the file with its own run ID (`dbs-mpi job plan`)",
    "rank_cores": "the cores every rank could run on (its affinity set, comma-separated), rank order",
    "versions": "JSON: python, torch, mpi4py, numpy, h5py, dbs_mpi, MPI library",
    "git_revision": "commit of the code that ran (`-dirty` if modified; `unknown` outside git)",
    "command": "the command line",
    "created": "ISO time the run started",
    "torch_threads": "torch threads of rank 0",
    "rank_threads": "torch threads of every rank, rank order (a GPU rank 1; CPU ranks share the node's other cores)",
    "rank_data_on_device": "whether every rank indexed its batches out of data held on its device "
                           "(`--data-on-device`: a GPU rank's in the GPU's memory; a CPU rank's with on), rank order",
    "oversubscribed": "true if some node ran more ranks than its ranks have cores together: times are shared-core "
                      "times",
    "sleep_while_waiting": "true if waiting ranks slept between polls (wait policy) instead of spinning",
    "rank_devices": "every rank's device (cpu, cuda:N), rank order",
    "device_names": "every rank's device name (GPU model, CPU), rank order",
    "exchange": "how gradients were summed: host (MPI on host memory, GPU buckets staged), cuda-aware, nccl, gloo"
                " or local (one rank: nothing to sum); synchronous strategies",
    "staleness_mean": "asynchronous: mean staleness of all applied gradients (server updates between computing "
                      "and applying)",
    "staleness_max": "asynchronous: largest staleness",
    "staleness_percentiles": "asynchronous: staleness percentiles at `staleness_percentile_levels` (50, 90, 99)",
    "staleness_percentile_levels": "asynchronous: the levels of `staleness_percentiles`",
    "updates": "asynchronous: server updates (versions) in all",
    "gradients": "asynchronous: gradients applied in all",
    "gradients_per_update": "asynchronous: c, gradients per update",
    "server_momentum": "asynchronous: the SGD momentum the server used (implicit_momentum)",
    "reply_mode": "asynchronous: `immediate`, `wait` or `rounds (hardsync)`",
    "training_time": "asynchronous: seconds of training (checkpoints and evaluation excluded)",
    "grid_experiment": "experiment grid (`make experiments`): the experiment of jobs/experiments.toml",
    "grid_case": "experiment grid: the case (setting) within the experiment",
    "grid_scale": "experiment grid: `small` or `paper`",
    "grid_figures": "experiment grid: the figures the run is drawn in (comma-separated)",
    "grid_loadavg": "experiment grid: the 1-minute load average before and after the run",
    "grid_elapsed": "experiment grid: seconds of the launch, start-up included",
}

# What a run records of its start-up calibration (startup/*, below), in this order.
STARTUP = ("local_batch", "step_time", "tiny_time", "batch_sizes", "alone_time", "timed_large")

# Datasets: name -> (shape, unit, meaning). Float64 unless the shape says int.
SCHEMA_DATASETS = {
    "startup/local_batch": ("(2,) int", "samples", "the two local batches of the start-up calibration"),
    "startup/step_time": ("(R, 2)", "s", "median seconds per step of every rank at those local batches (a "
                           "rank 8x slower than the fastest at 2 samples: read off the line through its "
                           "times there and at a batch of its own; a rank slower at the small batch: its "
                           "time at the large one read off the line through its time there and at a "
                           "smaller one; planning/calibration.py)"),
    "startup/tiny_time": ("(R,)", "s", "median seconds per step of every rank at the tiny batch (2 samples); a "
                          "rank 8x slower than the fastest there has its step_time read off, not timed"),
    "startup/alone_time": ("(R,)", "s", "median seconds of the fastest ranks at the larger batch with no other rank "
                           "computing (NaN: not timed; empty: no rank was; planning/coupling.py)"),
    "startup/batch_sizes": ("(R,) int", "samples", "the vector chosen from it (asynchronous: 0 for the server, "
                                                   "rank 0)"),
    "startup/timed_large": ("(R,) int", "samples", "the larger batch each rank timed (0: none, a slow rank; below "
                            "local_batch[1]: its step_time there read off; planning/calibration.py)"),
    "epoch/train_loss": ("(E,)", "loss", "mean training loss over the epoch's samples"),
    "epoch/test_loss": ("(E,)", "loss", "mean loss over the test set"),
    "epoch/test_accuracy": ("(E,)", "fraction", "share of the test set classified right, in [0, 1]"),
    "epoch/duration": ("(E,)", "s", "wall seconds of the epoch's training, evaluation and checkpoints excluded"),
    "epoch/eval_time": ("(E,)", "s", "wall seconds of the evaluation after the epoch"),
    "epoch/lr": ("(E,)", "lr", "synchronous: learning rate of the epoch's last step (`lr_schedule`)"),
    "epoch/batch_sizes": ("(E, R) int", "samples", "local batch of every rank in the epoch's full steps (the last "
                                                  "full step's where `dbs` changed the vector within the epoch: "
                                                  "`step/batch_sizes` has every step's)"),
    "epoch/rank_samples": ("(E, R) int", "samples", "training samples every rank computed in the epoch"),
    "epoch/compute_time": ("(E, R)", "s", "seconds of forward, backward, emulated slow-down and update"),
    "epoch/comm_time": ("(E, R)", "s", "seconds moving gradients (the collectives less waiting)"),
    "epoch/wait_time": ("(E, R)", "s", "seconds idle in collectives, waiting for slower ranks"),
    "epoch/data_time": ("(E, R)", "s", "seconds waiting for batches (DataLoader, indexing)"),
    "epoch/speed": ("(E, R)", "samples/s", "samples per second of pre-collective compute"),
    "epoch/steps": ("(E,) int", "steps", "steps of the epoch (the same on every rank)"),
    "epoch/speed_ratio": ("(E, R)", "ratio", "`dbs`: measured / predicted compute time (docs/method.md, section 5)"),
    "epoch/global_batch": ("(E,) int", "samples", "`global_batch = auto`: B of the epoch's steps (docs/method.md, "
                                                  "section 5.5)"),
    "epoch/next_global_batch": ("(E,) int", "samples", "`global_batch = auto`: B chosen for the next epoch"),
    "epoch/gain": ("(E,)", "steps", "`global_batch = auto`: the gain at the epoch's B and its last noise scale: one "
                                    "step's progress in steps at the start B0 (NaN: no noise scale yet)"),
    "epoch/lr_factor": ("(E,)", "ratio", "`global_batch = auto`: the factor on the lr (`lr_scaling`) at the epoch's "
                                         "end (`epoch/lr` includes it)"),
    "epoch/goodput": ("(E,)", "steps/s", "`global_batch = auto`: predicted progress per second at the epoch's B, in "
                                         "steps at B0 (gain / predicted_step)"),
    "epoch/predicted_step": ("(E,)", "s", "`global_batch = auto`: the predicted seconds of a step at the epoch's B "
                                          "(the planner's compute plus the measured fixed seconds)"),
    "epoch/samples": ("(E,) int", "samples", "asynchronous: samples applied in the epoch"),
    "epoch/updates": ("(E,) int", "updates", "asynchronous: server updates in the epoch"),
    "epoch/gradients": ("(E, R) int", "gradients", "asynchronous: gradients applied (rank 0: all of them), per rank"),
    "epoch/staleness_mean": ("(E,)", "updates", "asynchronous: mean staleness of the epoch's gradients"),
    "epoch/staleness_max": ("(E,)", "updates", "asynchronous: largest staleness of the epoch's gradients"),
    "epoch/staleness_p50": ("(E,)", "updates", "asynchronous: median staleness"),
    "epoch/staleness_p90": ("(E,)", "updates", "asynchronous: 90th percentile of staleness"),
    "epoch/staleness_p99": ("(E,)", "updates", "asynchronous: 99th percentile of staleness"),
    "step/loss": ("(S,)", "loss", "global mean loss of every step"),
    "step/epoch": ("(S,) int", "epoch", "epoch (from 0) of every step"),
    "step/batch_sizes": ("(S, R) int", "samples", "local batch of every rank in every step (0: the rank sat out, "
                                                 "or had no share of the epoch's last, partial step)"),
    "step/compute_time": ("(S, R)", "s", "compute seconds per step and rank"),
    "step/comm_time": ("(S, R)", "s", "communication seconds per step and rank"),
    "step/wait_time": ("(S, R)", "s", "waiting seconds per step and rank"),
    "step/data_time": ("(S, R)", "s", "seconds waiting for the step's batch per step and rank (a step lasts "
                                      "data + compute + comm + wait on every rank)"),
    "step/probe_samples": ("(S, R) int", "samples", "a probe that a rank sitting out ran on its own time and "
                           "reported with the step (its samples; 0: none): the ranks taking part did not wait for it"),
    "step/probe_time": ("(S, R)", "s", "... and its measured seconds (NaN: none)"),
    "step/pre_time": ("(S, R)", "s", "compute before the step's collective (forward, backward, emulated slow-down): "
                                     "what `dbs` measures and re-plans from"),
    "step/noise_scale": ("(S,)", "samples", "`noise_scale`: the gradient noise scale tr(Sigma) / G^2 after the "
                         "step, smoothed over steps (NaN: not measured, or not yet known)"),
    "step/grad_sq": ("(S,)", "(grad)^2", "`noise_scale`: G^2, the squared norm of the whole data's gradient, "
                     "fitted to the step's gradient norms alone "
                     "(unsmoothed; NaN: none, as for an epoch's last step, whose sum is heard in the next epoch)"),
    "step/grad_trace": ("(S,)", "(grad)^2", "... and tr(Sigma), the summed variance of one sample's gradient"),
    "step/gain": ("(S,)", "steps", "`global_batch = auto`: AdaScale's gain at the step's global batch and its "
                  "`noise_scale` (steps at the starting batch; under `lr_scaling = adascale`, the next step's lr factor; "
                  "NaN: B fixed, or no noise scale yet)"),
    "step/goodput": ("(S,)", "steps/s", "... and the predicted goodput: that gain over the step time the planner "
                     "predicts at the epoch's end for the epoch's B (`epoch/predicted_step`)"),
    "replan/epoch": ("(V,) int", "epoch", "`dbs` within the epoch (a step `dbs_interval`): epoch (from 0) of "
                                          "every vector change"),
    "replan/step": ("(V,) int", "step", "the epoch's first step under the new vector (the epoch's step count: "
                                        "from the next epoch on)"),
    "replan/run_step": ("(V,) int", "step", "the same step counted over the run (an index into step/*)"),
    "replan/decided": ("(V,) int", "step", "the run's step whose measured times led to it (its proposal was "
                                           "announced with the step after)"),
    "replan/batch_sizes": ("(V, R) int", "samples", "the new vector (0: the rank sits out from that step; a change "
                                                   "of who takes part is a row like any other)"),
    "replan/per_sample": ("(V, R)", "s", "the estimate that caused it: seconds per sample of every rank (NaN: a "
                                         "vector given by hand, `Balancer.propose`)"),
    "replan/overhead": ("(V, R)", "s", "... and seconds of fixed cost per step"),
    "replan/predicted_before": ("(V,)", "s", "step time (slowest rank) the estimate predicted for the old vector"),
    "replan/predicted_after": ("(V,)", "s", "... and for the new one"),
    "replan/changed": ("(V, R) int", "bool", "1 for a rank whose speed changed (followed at once), 0 for drift"),
    "replan/cause": ("(V,) int", "code", "why: 0 a plan from the estimate, 1 a probe in the step (a rank held small "
                     "or sitting out given samples to measure it), 2 a revert (the set of ranks taking part measured "
                     "slower than the one before: back to the vector before), 3 a trial of the fastest ranks alone "
                     "(ranks share a host), 4 forced (propose()), 5 a lift: a plan into a set whose coupling ban it ends "
                     "(the set, priced with the coupling seen, predicted 10% faster; the estimate recorded is the "
                     "per-rank one, unpriced)"),
    "checkpoint/seconds": ("(K,)", "s", "seconds rank 0 spent writing each checkpoint"),
    "checkpoint/position": ("(K, 2) int", "(epoch, step)", "where each checkpoint continues; asynchronous runs: "
                                                           "(epoch, samples of it already applied)"),
    "update/staleness": ("(U,) int", "updates", "asynchronous: staleness of every applied gradient"),
    "update/worker": ("(U,) int", "rank", "asynchronous: the worker that computed it"),
    "update/time": ("(U,)", "s", "asynchronous: seconds since the start of training when it was applied"),
    "update/local_batch": ("(U,) int", "samples", "asynchronous: samples it was computed on"),
    "update/loss": ("(U,)", "loss", "asynchronous: the worker's mean loss on its local batch"),
    "update/epoch": ("(U,) int", "epoch", "asynchronous: epoch of its samples"),
    "update/version": ("(U,) int", "update", "asynchronous: server version it was applied at"),
    "update/timestamp": ("(U,) int", "update", "asynchronous: server version it was computed on"),
    "update/weight": ("(U,)", "ratio", "asynchronous: its weight in the update's gradient (b_i / (c B / lambda) "
                                       "sample-weighted, 1 / c per gradient; times 1/staleness with staleness_lr)"),
    "update/step_norm": ("(U,)", "parameter units", "asynchronous: Euclidean norm of the weight change of the "
                                                     "update it was applied in"),
}


def schema_markdown() -> str:
    """The schema's two tables, as docs/results.md shows them."""
    lines = ["| attribute | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in SCHEMA_ATTRIBUTES.items()]
    lines += ["", "| dataset | shape, type | unit | meaning |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {shape} | {unit} | {meaning} |" for name, (shape, unit, meaning) in SCHEMA_DATASETS.items()]
    return "\n".join(lines) + "\n"


STATUS_RUNNING, STATUS_COMPLETE, STATUS_FAILED = "running", "complete", "failed"
STATUS_INTERRUPTED = "interrupted"   # stopped on request with a checkpoint: `dbs-mpi train --resume FILE`
STATUS_CANCELLED = "cancelled"       # stopped by a cancel (SIGTERM) with a checkpoint: resumable by hand


def versions(mpi_library: str = "") -> dict:
    import h5py
    import mpi4py
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "mpi4py": mpi4py.__version__,
            "numpy": np.__version__, "h5py": h5py.__version__, "dbs_mpi": __version__, "mpi_library": mpi_library}


def git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def default_path(strategy: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{strategy}-{stamp}.h5"


def _finite_or_none(value):
    """A list (nested) with NaN and infinities as None: strict JSON has no NaN."""
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _dims(shape: str) -> list[str]:
    """'(E, R) int' -> ['E', 'R']: the dimensions of a SCHEMA_DATASETS shape."""
    return [d.strip() for d in shape[shape.index("(") + 1:shape.index(")")].split(",") if d.strip()]


def pad_columns(rows: np.ndarray, width: int) -> np.ndarray:
    """rows (n, k) with columns k.. width-1 of ranks that did not exist: NaN, or -1."""
    if rows.shape[1] >= width:
        return rows
    fill = -1 if rows.dtype.kind in "iu" else np.nan
    out = np.full((rows.shape[0], width), fill, dtype=rows.dtype)
    out[:, :rows.shape[1]] = rows
    return out


def check_new_file(path) -> None:
    """A new run's result file must not exist: nothing already written is overwritten."""
    if Path(path).exists():
        raise UserError(f"out: {path} exists already; choose another --out or remove it")


def checkpoint_path(out) -> Path:
    """The checkpoint file of the run whose result file is `out`, where --checkpoint names
    none: <out>.ckpt, beside it."""
    return Path(str(out) + ".ckpt")


def check_new_checkpoint(path, out, writable: bool = True) -> None:
    """A new run's checkpoint file (`--checkpoint`, or <out>.ckpt): not its result file
    `out`, not a file that exists (nothing already written is overwritten, an earlier
    run's checkpoint included), and (`writable`) in a directory that can be made and
    written: found now, not after the first epoch."""
    path = Path(path)
    if out and path.resolve() == Path(out).resolve():
        raise UserError(f"checkpoint: {path} is the result file (--out); choose another --checkpoint")
    if path.exists():
        raise UserError(f"checkpoint: {path} exists already (an earlier run's?); resume that run with --resume, "
                        f"remove it, or choose another --checkpoint")
    if writable:
        check_writable(path, "checkpoint")


def check_writable(path, what: str) -> None:
    """`path`'s directory exists or can be made, and a file can be written in it (`what`:
    the option that named it)."""
    parent = Path(path).parent
    try:                                            # (as root, os.access says yes to /proc)
        parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        raise UserError(f"{what}: cannot write in {parent} ({exc.strerror or exc})") from None


class RunWriter:
    """Appends a run's records to its HDF5 file; every call leaves the file readable."""

    def __init__(self, path, attrs: dict, world_size: int):
        import h5py
        self.path = Path(path)
        check_new_file(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = h5py.File(self.path, "w")
        except OSError as exc:
            raise UserError(f"out: cannot write {self.path} ({exc})") from None
        self.world_size = world_size
        f = self.file
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs["status"] = STATUS_RUNNING
        f.attrs["command"] = " ".join(sys.argv)
        f.attrs["created"] = datetime.datetime.now().isoformat(timespec="seconds")
        f.attrs["git_revision"] = git_revision()
        self._create_schema()
        f.flush()

    @classmethod
    def reopen(cls, path, attrs: dict, world_size: int, epochs: int, steps: int,
               updates: int | None = None, replans: int | None = None) -> "RunWriter":
        """Continue a stopped run's file: rows past the checkpoint (`epochs` epochs,
        `steps` steps, `updates` applied gradients of an asynchronous run, `replans`
        vector changes) are dropped, so no epoch or update is duplicated or missing."""
        import h5py
        self = cls.__new__(cls)
        self.path = Path(path)
        self.world_size = world_size
        try:
            self.file = h5py.File(self.path, "r+")          # ("a" would make a new file: never)
        except OSError as exc:
            raise UserError(f"resume: cannot open {self.path} ({exc})") from None
        f = self.file
        for group, keep in (("epoch", epochs), ("step", steps), ("update", updates), ("replan", replans)):
            if keep is None:
                continue
            for name in list(f.get(group, {})):
                ds = f[f"{group}/{name}"]
                if ds.shape[0] > keep:
                    ds.resize(keep, axis=0)
        resumed = list(f.attrs.get("resumed", [])) + [datetime.datetime.now().isoformat(timespec="seconds")]
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs["resumed"] = resumed
        f.attrs["status"] = STATUS_RUNNING
        self._create_schema()               # a file of an older version: what it lacks
        f.flush()
        return self

    def _create_schema(self) -> None:
        """Every documented dataset, empty (0 rows; a per-rank one as wide as the world)
        unless it exists: the file has the same groups and datasets from its creation on."""
        for name, (shape, _, _) in SCHEMA_DATASETS.items():
            if name in self.file:
                continue
            dims = (0, *[self.world_size if d == "R" else int(d) for d in _dims(shape)[1:]])
            self.file.create_dataset(name, shape=dims, maxshape=(None,) * len(dims), chunks=(256, *dims[1:]),
                                     dtype=np.int64 if "int" in shape else np.float64)
            self._describe(name)

    def _describe(self, name: str) -> None:
        """The dataset's unit and meaning as attributes (SCHEMA_DATASETS; a loop's own extras
        have none)."""
        if name in SCHEMA_DATASETS:
            _, unit, meaning = SCHEMA_DATASETS[name]
            self.file[name].attrs["unit"], self.file[name].attrs["description"] = unit, meaning

    def _append(self, name: str, rows, dtype=np.float64) -> None:
        rows = np.asarray(rows, dtype=dtype)
        if name not in self.file:
            chunks = True if rows.size else (1024, *rows.shape[1:])   # h5py cannot guess for 0 rows
            self.file.create_dataset(name, data=rows, maxshape=(None, *[None] * (rows.ndim - 1)), chunks=chunks)
            self._describe(name)
            return
        ds = self.file[name]
        if rows.ndim == 2 and ds.ndim == 2 and rows.shape[1] != ds.shape[1]:     # the world changed size
            if rows.shape[1] > ds.shape[1]:
                ds = self._widen(name, rows.shape[1])
            rows = pad_columns(rows, ds.shape[1])
        n = ds.shape[0]
        ds.resize(n + rows.shape[0], axis=0)
        ds[n:] = rows

    def _widen(self, name: str, width: int):
        """A per-rank dataset rewritten `width` columns wide (the new ranks' earlier rows
        missing: NaN, or -1 for integers)."""
        old = self.file[name]
        data, attrs = pad_columns(old[()], width), dict(old.attrs)
        del self.file[name]
        ds = self.file.create_dataset(name, data=data, maxshape=(None, None), chunks=True)
        ds.attrs.update(attrs)
        return ds

    def write_startup(self, startup: dict) -> None:
        """A calibration: startup/* if this is the run's first launch, else its segment's."""
        segments = json.loads(self.file.attrs.get("segments", "[]"))
        if len(segments) <= 1 and not any(len(ds) for ds in self.file.get("startup", {}).values()):
            for name, value in startup.items():
                self.write(f"startup/{name}", value)
            return
        segments[-1]["startup"] = {name: _finite_or_none(np.asarray(value).tolist()) for name, value in startup.items()}
        self.file.attrs["segments"] = json.dumps(segments)
        self.file.flush()

    def begin_segment(self, segment: dict) -> None:
        """Append a launch's entry to the `segments` attribute (the first one at creation)."""
        segments = json.loads(self.file.attrs.get("segments", "[]"))
        self.file.attrs["segments"] = json.dumps([*segments, segment])
        self.file.flush()

    def append_rows(self, name: str, rows, dtype=np.float64) -> None:
        self._append(name, rows, dtype)
        self.file.flush()

    def write(self, name: str, data) -> None:
        data = np.asarray(data)
        if name in self.file and self.file[name].ndim == data.ndim:     # created empty with the file
            self.file[name].resize(data.shape)
            self.file[name][...] = data
            return
        self.file.create_dataset(name, data=data)
        self._describe(name)

    def append_epoch(self, epoch: dict, steps: dict, replans: dict | None = None) -> None:
        """epoch: name -> value or per-rank vector for one epoch; steps: name -> per-step rows;
        replans: name -> rows of the epoch's vector changes."""
        for name, value in epoch.items():
            value = np.asarray(value)
            self._append(f"epoch/{name}", value[None], value.dtype if value.dtype.kind in "iu" else np.float64)
        for group, rows_of in (("step", steps), ("replan", replans or {})):
            for name, rows in rows_of.items():
                rows = np.asarray(rows)
                kind = np.int64 if rows.dtype.kind in "iub" else np.float64
                self._append(f"{group}/{name}", rows, kind)
        self.file.flush()

    def read_epochs(self) -> list[dict]:
        """The epoch records already in the file (one dict per epoch), e.g. after reopen."""
        group = self.file.get("epoch")
        if group is None:
            return []
        columns = {name: group[name][()] for name in group if len(group[name])}   # (not another kind of run's)
        count = min((len(v) for v in columns.values()), default=0)
        return [{name: values[i] for name, values in columns.items()} for i in range(count)]

    def set_attrs(self, **attrs) -> None:
        for key, value in attrs.items():
            self.file.attrs[key] = value
        self.file.flush()

    def close(self, status: str) -> None:
        if self.file.id.valid:
            self.file.attrs["status"] = status
            self.file.flush()
            self.file.close()


class NullWriter:
    """What ranks other than 0 hold: every call does nothing."""
    path = None

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def describe_config(config) -> str:
    """JSON of a run's configuration: a config.Config, a dict or an argparse Namespace."""
    if config is None:
        return "{}"
    if hasattr(config, "to_json"):
        return config.to_json()
    values = vars(config) if not isinstance(config, dict) else config
    return json.dumps(values, sort_keys=True, default=str)


class Recorder:
    """A run's HDF5 result file, written from a training loop: every rank calls, rank 0
    writes (the same schema as `dbs-mpi train`, so dbs_mpi.tools.analysis and the notebooks read
    user runs too).

        with Recorder(comm, "results/my-run.h5", config=vars(args)) as recorder:
            recorder.startup(balancer)                  # after balancer.calibrate()
            for epoch in range(epochs):
                ...                                     # the epoch's steps
                stats = balancer.end_epoch()
                loss, accuracy = dbs_mpi.evaluate(comm, model, test_set, loss_fn)
                recorder.epoch(stats, test_loss=loss, test_accuracy=accuracy)

    Leaving the `with` block marks the file complete, interrupted (checkpoint.Stopped or
    exit status 3) or failed (any other exception). The constructor is collective: if the
    file cannot be created (it exists, the folder is not writable) every rank raises
    AgreedError (mpi/agreement.py). resume: the `state_dict()` of a recorder saved in a checkpoint;
    the file is then continued (rows past that state are dropped), not created."""

    def __init__(self, comm, path, *, config=None, attrs: dict | None = None, resume: dict | None = None,
                 position: tuple[int, int] | None = None, timeout: float = 600.0):
        from ..mpi.agreement import collective
        from ..mpi.placement import hostnames, mpi_library
        from ..mpi.supervisor import SUPERVISOR
        self.comm, self.path, self.timeout = comm, str(path), timeout
        attrs = {"config": describe_config(config), "world_size": comm.Get_size(),
                 "hostnames": hostnames(comm, timeout), "versions": json.dumps(versions(mpi_library())),
                 **(attrs or {})}
        rank, world = comm.Get_rank(), comm.Get_size()
        self.attrs = attrs
        self.records = dict(resume) if resume else {"epochs": 0, "steps": 0, "replans": 0}

        def open_file():
            if rank != 0:
                return NullWriter()
            if resume:
                return RunWriter.reopen(path, attrs, world, resume["epochs"], resume["steps"], resume.get("updates"),
                                        resume.get("replans", 0))
            return RunWriter(path, attrs, world)
        self.writer = collective(comm, open_file, timeout=timeout)
        self.writer.begin_segment(self._segment(position))
        # If the job fails on any rank while rank 0 is alive, rank 0 marks the file failed
        # before the abort (supervisor.py).
        self._unregister = SUPERVISOR.on_failure(lambda: self.writer.close(STATUS_FAILED))

    def _segment(self, position) -> dict:
        """This launch's entry of the `segments` attribute. position: (epoch, step) where it
        begins (default: after the epochs recorded)."""
        epoch, step = position if position is not None else (self.records["epochs"], 0)
        plain = lambda key: [str(v) for v in self.attrs.get(key, [])]       # noqa: E731
        return {"world_size": self.comm.Get_size(), "hostnames": plain("hostnames"),
                "rank_devices": plain("rank_devices"), "device_names": plain("device_names"),
                "epoch": int(epoch), "step": int(step), "run_step": int(self.records["steps"]) + int(step),
                "time": datetime.datetime.now().isoformat(timespec="seconds"), "startup": None}

    def startup(self, balancer) -> None:
        """The balancer's policy and global batch (as the attributes strategy and
        global_batch, unless given), and its start-up calibration if any: startup/* for the
        run's first launch, its `segments` entry for a later one (a resume that calibrated
        its new ranks)."""
        self.writer.set_attrs(**{k: v for k, v in (("strategy", balancer.policy),
                                                   ("global_batch", balancer.global_batch))
                                 if k not in self.attrs})
        if balancer.startup:
            self.writer.write_startup({name: balancer.startup[name] for name in STARTUP
                                       if name in balancer.startup})

    def append_steps(self, rows: dict) -> None:
        """Step rows of the epoch in progress that another world ran before a resume on
        another number of ranks (its epoch/* row will be its last segment's)."""
        if rows:
            self.writer.append_epoch({}, rows)
            self.records = {**self.records, "steps": self.records["steps"] + len(rows["loss"])}

    def epoch(self, stats, *, test_loss: float = float("nan"), test_accuracy: float = float("nan"),
              eval_time: float = 0.0, **extra) -> dict:
        """Append an epoch (balancer.end_epoch()'s EpochStats) and its steps; returns the
        epoch's record (the same on every rank)."""
        record = {**stats.record(), "test_loss": float(test_loss), "test_accuracy": float(test_accuracy),
                  "eval_time": float(eval_time), **extra}
        replans = stats.replan_rows() if hasattr(stats, "replan_rows") else {}
        self.writer.append_epoch(record, stats.step_rows(self.records["epochs"]), replans)
        self.records = {**self.records, "epochs": self.records["epochs"] + 1,
                        "steps": self.records["steps"] + stats.steps,
                        "replans": self.records.get("replans", 0) + len(replans.get("step", ()))}
        return record

    def state_dict(self) -> dict:
        """Rows written so far, for a checkpoint (resume= continues from there)."""
        return dict(self.records)

    def close(self, status: str = STATUS_COMPLETE) -> None:
        self._unregister()
        self.writer.close(status)

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, kind, value, tb) -> bool:
        from .checkpoint import EXIT_STOPPED, Stopped
        if kind is None:
            self.close(STATUS_COMPLETE)
        elif issubclass(kind, Stopped) and value.cancelled:
            self.close(STATUS_CANCELLED)
        elif issubclass(kind, Stopped) or (issubclass(kind, SystemExit) and value.code == EXIT_STOPPED):
            self.close(STATUS_INTERRUPTED)
        else:
            self.close(STATUS_FAILED)
        return False


def close_crashed(path, exit_status: int | None = None, timeout: float = 10.0) -> tuple[str, str]:
    """After a launch that ended with none of its ranks left: a result file still `running`
    (rank 0 was killed before it could write `failed`: a lost node, SIGKILL, a launcher
    that tore the job down) becomes `failed`, and `crashed` says how it ended; a file in
    any other state is left as it is. Returns its status before and after. A live run
    holds HDF5's lock on its file: if the lock is not free within `timeout` seconds (a
    rank still exiting), this raises UserError instead of touching the file."""
    import h5py
    path = Path(path)
    if not path.is_file():
        raise UserError(f"close: no result file {path}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            f = h5py.File(path, "r+")
            break
        except OSError as exc:
            if "lock" not in str(exc):
                raise UserError(f"close: {path} is not a readable result file ({exc})") from None
            if time.monotonic() > deadline:
                raise UserError(f"close: {path} is still open for writing after {timeout:g} s "
                                "(is its run alive?); left as it is") from None
            time.sleep(0.2)
    with f:
        before = f.attrs.get("status", b"")
        before = before.decode() if isinstance(before, bytes) else str(before)
        if before != STATUS_RUNNING:
            return before, before
        f.attrs["status"] = STATUS_FAILED
        how = f"exit status {exit_status}" if exit_status is not None else "an unknown exit status"
        f.attrs["crashed"] = (f"{datetime.datetime.now().isoformat(timespec='seconds')}: the launch ended with "
                              f"{how} and no rank had marked the run")
    return before, STATUS_FAILED


def open_readonly(path):
    """h5py.File(path, "r") without HDF5's file lock, so that a file a running job holds
    open for writing can be read; with the lock where this process has the file open
    already (HDF5 insists that the flags match)."""
    import h5py
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as exc:
        if "locking" not in str(exc):
            raise
        return h5py.File(path, "r")


READ_TRIES = 5          # a read that met the writer in the middle of a flush is tried again ...
READ_PAUSE = 0.2        # ... after this many seconds


def read_run(path, datasets: bool = True) -> dict:
    """A run's attributes and datasets as plain Python/numpy objects, also while its job
    writes it: opened without HDF5's lock, read again if it met the writer in the middle
    of a flush, and a `running` file's tables cut to the rows every column has (the
    writer appends a row column by column). datasets=False: the attributes only."""
    if not Path(path).exists():
        raise FileNotFoundError(f"no result file {path}")
    for attempt in range(READ_TRIES):
        try:
            return _read_once(path, datasets)
        except (OSError, KeyError, ValueError, RuntimeError):     # h5py's errors of a file read mid-flush
            if attempt + 1 == READ_TRIES:
                raise
            time.sleep(READ_PAUSE)


def _read_once(path, datasets: bool) -> dict:
    out = {"attrs": {}, "data": {}}
    with open_readonly(path) as f:
        for key, value in f.attrs.items():
            out["attrs"][key] = value.decode() if isinstance(value, bytes) else value
        if datasets:
            f.visititems(lambda name, obj: out["data"].__setitem__(name, obj[()]) if hasattr(obj, "shape") else None)
    if "config" in out["attrs"]:
        out["config"] = json.loads(out["attrs"]["config"])
    if out["attrs"].get("status") == STATUS_RUNNING:
        _complete_rows(out["data"])
    return out


def _complete_rows(data: dict) -> None:
    """Cut every table (epoch/, step/, update/, replan/) of a live file to its complete rows
    (the columns a run writes; one it never writes stays empty and does not count)."""
    tables: dict[str, list] = {}
    for name, value in data.items():
        group, _, _ = name.partition("/")
        if group in ("epoch", "step", "update", "replan") and getattr(value, "ndim", 0) >= 1 and len(value):
            tables.setdefault(group, []).append(name)
    for names in tables.values():
        rows = min(len(data[name]) for name in names)
        for name in names:
            data[name] = data[name][:rows]


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m dbs_mpi.training.results --markdown   (the schema's tables for docs/results.md)")
    sys.stdout.write(schema_markdown())
