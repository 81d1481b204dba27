"""Analysis: a folder of HDF5 result files -> pandas tables. No MPI, no plotting.

    from dbs_mpi import analysis
    t = analysis.load("results/grid")        # every *.h5 below the folder
    t.runs      # one row per run: configuration columns and a few summary numbers
    t.epochs    # one row per (run, epoch)
    t.ranks     # one row per (run, epoch, rank)
    t.steps     # one row per (run, step), synchronous strategies
    t.vectors   # one row per (run, step, rank): every step's local batches
    t.replans   # one row per vector change within an epoch (dbs with a step interval)
    t.updates   # one row per applied gradient, asynchronous strategies

Every table has a `run` column (the file's path below the folder, without `.h5`), so
tables join on it, and the per-epoch/rank/step/update tables repeat the columns that
figures group by (KEY_COLUMNS: strategy, aggregation, seed, experiment, ...).

Conventions. `epoch` is 0-based, as in the configuration's `slow_epochs` and
`sleep_epochs` windows (an epoch e is disturbed if start <= e < stop). Times are wall
seconds of *training* only: evaluation after each epoch and the start-up benchmark are
not in `duration`, `wall_time` or `train_time`. `wall_time` in `epochs` is the training
time at the end of the epoch (cumulative durations); in `steps` it is the training time
at the end of the step, each epoch's duration spread over its steps in proportion to the
steps' measured times (compute + communication + wait, mean over ranks), and `samples`
is the step's global batch (its local batches' sum), `noise_scale` the measured gradient
noise scale after it (NaN: not measured); in `updates` it
is the server's clock when the gradient was applied (`update/time`).

`variant` is the strategy, except that dbs under the DBS paper's per-epoch rule
(`dbs_interval = "epoch"`, and every run recorded before the option existed) is
`dbs-epoch`; `dbs` re-plans within the epoch. Runs recorded before step/batch_sizes
existed get their epoch's vector for every step in `vectors`.

A run resumed on another number of ranks (`world_sizes` in `runs`: one entry per launch;
`world_size` is the last) has, in `ranks` and `vectors`, rows for the ranks of each
row's own world only; the epoch in which the world changed describes its last segment.

Speeds: `speeds` is the configuration's tuple (relative, () = all equal);
`heterogeneity` = mean(v)/min(v) over the ranks that compute (every rank for the
synchronous strategies, ranks 1.. for the parameter server's), the best possible
speed-up of a proportional split over an equal one (docs/method.md, section 2).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..planning import allocation
from ..planning.heterogeneity import Emulator
from .config import ASYNC_STRATEGIES, LEGACY
from ..training.results import read_run

# Columns copied from `runs` into every other table, for grouping without a join.
KEY_COLUMNS = ("strategy", "variant", "aggregation", "seed", "world_size", "experiment", "case")

# Root attributes of a result file that become columns of `runs` (when present).
ATTR_COLUMNS = ("status", "strategy", "aggregation", "dataset", "model", "world_size", "num_parameters", "versions",
                "git_revision", "created", "command", "oversubscribed", "torch_threads", "sleep_while_waiting",
                "staleness_mean", "staleness_max", "updates", "gradients", "gradients_per_update", "reply_mode",
                "training_time", "grid_experiment", "grid_case", "grid_scale", "grid_figures", "grid_loadavg",
                "grid_elapsed")


@dataclass
class Tables:
    runs: pd.DataFrame
    epochs: pd.DataFrame
    ranks: pd.DataFrame
    steps: pd.DataFrame
    updates: pd.DataFrame
    vectors: pd.DataFrame = None
    replans: pd.DataFrame = None

    def run(self, name: str) -> pd.Series:
        """The `runs` row of one run (by its name)."""
        return self.runs.set_index("run").loc[name]


def ideal_speedup(speeds, skip_server: bool = False) -> float:
    """mean(v)/min(v): the best speed-up of a proportional split over an equal split."""
    v = np.asarray(speeds, dtype=float)
    if skip_server:
        v = v[1:]
    if v.size == 0:
        return 1.0
    return float(v.mean() / v.min())


def measured_ideal_speedup(equal_batches, equal_times, batches, times, global_batch: int, min_local: int = 1,
                           max_local: int | None = None) -> float:
    """The best speed-up re-allocating can give over equal local batches, from the step
    times the ranks really took: rank i's seconds per step (data + compute) at the
    baseline's equal local batch and at the strategy's, an affine model t_i(b) = a_i + p_i b
    through the two points (proportional, a_i = 0, where the batches are within 20%), then
    max_i t_i(B/n) over max_i t_i(b_i) for the engine's allocation b. Unlike mean(v)/min(v)
    it counts the fixed cost per step and whatever the ranks really did (load, shared
    cores); the collective, the same in both, only lowers the real ratio."""
    b1, t1 = np.asarray(equal_batches, float), np.asarray(equal_times, float)
    b2, t2 = np.asarray(batches, float), np.asarray(times, float)
    apart = np.abs(b2 - b1) >= 0.2 * np.maximum(b1, b2)
    slope = np.where(apart, (t2 - t1) / np.where(apart, b2 - b1, 1.0), 0.0)
    proportional = (t1 + t2) / np.maximum(b1 + b2, 1.0)
    good = apart & (slope > 0)
    per_sample = np.where(good, slope, proportional)
    overhead = np.where(good, np.clip(t1 - slope * b1, 0.0, 0.5 * np.minimum(t1, t2)), 0.0)
    model = allocation.SpeedModel(per_sample=per_sample, overhead=overhead)
    best = model.allocate(global_batch, min_local, max_local)
    return float(np.max(t1) / np.max(model.predict(best)))


def step_times(tables: "Tables", run: str, skip_first: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(local batch, seconds per step before the collective) of every rank of a run: the
    last epoch's vector, and the median over epochs (after the first) of batch / speed."""
    r = tables.ranks[tables.ranks.run == run]
    if skip_first and r.epoch.nunique() > 1:
        r = r[r.epoch > r.epoch.min()]
    last = r[r.epoch == r.epoch.max()].sort_values("rank")
    per_step = (r.batch_size / r.speed).groupby(r["rank"]).median().sort_index()
    return last.batch_size.to_numpy(float), per_step.to_numpy(float)


def _attr(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return tuple(_attr(v) for v in value.tolist())
    return value


def read_file(path) -> dict:
    """One result file: {'attrs': {...}, 'config': {...}, 'data': {name: ndarray}}, also
    while the run is still being written (results.read_run)."""
    run = read_run(path)
    return {"attrs": {key: _attr(value) for key, value in run["attrs"].items()}, "data": run["data"],
            "config": run.get("config", {})}


def _speeds(value, world: int) -> tuple:
    """The configured relative speeds, or all 1 (a user's loop may store anything there)."""
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    try:
        speeds = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        speeds = ()
    return speeds if len(speeds) == world else (1.0,) * world


def _run_row(name: str, path: Path, run: dict) -> dict:
    attrs, cfg, data = run["attrs"], run["config"], run["data"]
    row = {"run": name, "path": str(path)}
    for key, value in cfg.items():                       # configuration columns
        row[key] = tuple(value) if isinstance(value, list) else value
    for key in ATTR_COLUMNS:
        if key in attrs:
            row[key] = attrs[key]
    row["experiment"] = attrs.get("grid_experiment", "")
    row["case"] = attrs.get("grid_case", "")
    world = int(attrs.get("world_size", len(cfg.get("speeds", ())) or 1))
    row["world_size"] = world
    row["hostnames"] = tuple(attrs.get("hostnames", ()))
    row["rank_devices"] = tuple(attrs.get("rank_devices", ()))      # cpu, cuda:N per rank ("device": the request)
    row["exchange_used"] = attrs.get("exchange", "")                 # the agreed transport ("exchange": the request)
    row["resumed"] = len(attrs.get("resumed", ()) or ())
    segments = json.loads(attrs.get("segments", "[]"))
    row["world_sizes"] = tuple(seg["world_size"] for seg in segments) or (world,)   # one per launch
    row["speeds"] = _speeds(cfg.get("speeds", ()), world)
    row["dbs_interval"] = str(cfg.get("dbs_interval", LEGACY["dbs_interval"]))   # runs before the option
    row["variant"] = "dbs-epoch" if row.get("strategy") == "dbs" and row["dbs_interval"] == "epoch" \
        else row.get("strategy", "")
    asynchronous = row.get("strategy") in ASYNC_STRATEGIES
    row["asynchronous"] = asynchronous
    row["heterogeneity"] = ideal_speedup(row["speeds"], skip_server=asynchronous and len(row["speeds"]) > 1)
    duration = data.get("epoch/duration", np.zeros(0))
    row["epochs_done"] = int(duration.shape[0])
    row["train_time"] = float(duration.sum())
    row["mean_epoch_time"] = float(duration.mean()) if duration.size else np.nan
    row["median_epoch_time"] = float(np.median(duration)) if duration.size else np.nan
    # Epoch time after the first epoch: dbs re-allocates from epoch 1's measurement.
    row["steady_epoch_time"] = float(np.median(duration[1:])) if duration.size > 1 else row["median_epoch_time"]
    for key in ("train_loss", "test_loss", "test_accuracy"):
        values = data.get(f"epoch/{key}", np.zeros(0))
        row[f"final_{key}"] = float(values[-1]) if values.size else np.nan
    acc = data.get("epoch/test_accuracy", np.zeros(0))
    row["best_test_accuracy"] = float(acc.max()) if acc.size else np.nan
    if "update/staleness" in data and "staleness_mean" not in row:
        st = data["update/staleness"]
        row["staleness_mean"] = float(st.mean()) if st.size else np.nan
        row["staleness_max"] = float(st.max()) if st.size else np.nan
    return row


def _epoch_rows(name: str, data: dict) -> pd.DataFrame:
    n = data["epoch/duration"].shape[0] if "epoch/duration" in data else 0
    cols = {"run": [name] * n, "epoch": np.arange(n)}
    for key, value in data.items():
        group, _, field = key.partition("/")
        if group == "epoch" and value.ndim == 1 and value.shape[0] == n:
            cols[field] = value
    df = pd.DataFrame(cols)
    if n:
        df["wall_time"] = np.cumsum(data["epoch/duration"])
        df["wall_time_start"] = df["wall_time"] - df["duration"]
    return df


def _rank_rows(name: str, data: dict) -> pd.DataFrame:
    per_rank = {key.partition("/")[2]: value for key, value in data.items()
                if key.startswith("epoch/") and value.ndim == 2 and len(value)}
    if not per_rank:
        return pd.DataFrame()
    n, ranks = next(iter(per_rank.values())).shape
    cols = {"run": [name] * (n * ranks), "epoch": np.repeat(np.arange(n), ranks), "rank": np.tile(np.arange(ranks), n)}
    for field, value in per_rank.items():
        if value.shape == (n, ranks):
            cols["batch_size" if field == "batch_sizes" else field] = value.reshape(-1)
    df = pd.DataFrame(cols)
    if "batch_size" in df:                     # a run resumed on another number of ranks: absent ranks are -1
        df = df[df.batch_size >= 0].reset_index(drop=True)
    parts = [c for c in ("compute_time", "comm_time", "wait_time", "data_time") if c in df]
    if parts:
        df["busy_time"] = df[parts].sum(axis=1)
    return df


def _step_rows(name: str, data: dict) -> pd.DataFrame:
    if "step/loss" not in data or not len(data["step/loss"]):
        return pd.DataFrame()
    loss, epoch = data["step/loss"], data["step/epoch"]
    n = loss.shape[0]
    parts = [data[k] for k in ("step/data_time", "step/compute_time", "step/comm_time", "step/wait_time")
             if k in data and len(data[k]) == n]
    step_time = np.nanmean(sum(p for p in parts), axis=1) if parts else np.ones(n)   # NaN: a rank not in that world
    wall = np.zeros(n)
    durations = data.get("epoch/duration", np.zeros(0))
    offset = 0.0
    for e in range(int(epoch.max()) + 1 if n else 0):
        mask = epoch == e
        t = step_time[mask]
        total = durations[e] if e < durations.shape[0] else t.sum()
        share = t / t.sum() if t.sum() > 0 else np.full(t.shape, 1.0 / max(t.size, 1))
        wall[mask] = offset + np.cumsum(share) * total
        offset += total
    index_in_epoch = pd.Series(epoch).groupby(epoch).cumcount().to_numpy()
    batches = data.get("step/batch_sizes")
    samples = batches.sum(axis=1) if batches is not None and len(batches) == n else np.full(n, np.nan)
    noise = data.get("step/noise_scale")
    return pd.DataFrame({"run": [name] * n, "step": np.arange(n), "epoch": epoch, "step_in_epoch": index_in_epoch,
                         "loss": loss, "step_time": step_time, "wall_time": wall, "samples": samples,
                         "noise_scale": noise if noise is not None and len(noise) == n else np.full(n, np.nan)})


def _vector_rows(name: str, data: dict) -> pd.DataFrame:
    """Every step's local batch per rank (older files: the epoch's vector for every step)."""
    if "step/epoch" not in data or not len(data["step/epoch"]):
        return pd.DataFrame()
    epoch = data["step/epoch"]
    if "step/batch_sizes" in data and len(data["step/batch_sizes"]) == len(epoch):
        batches = data["step/batch_sizes"]
    elif "epoch/batch_sizes" in data and len(data["epoch/batch_sizes"]):
        batches = data["epoch/batch_sizes"][np.minimum(epoch, len(data["epoch/batch_sizes"]) - 1)]
    else:
        return pd.DataFrame()
    steps, ranks = batches.shape
    in_epoch = pd.Series(epoch).groupby(epoch).cumcount().to_numpy()
    df = pd.DataFrame({"run": [name] * (steps * ranks), "step": np.repeat(np.arange(steps), ranks),
                       "epoch": np.repeat(epoch, ranks), "step_in_epoch": np.repeat(in_epoch, ranks),
                       "rank": np.tile(np.arange(ranks), steps), "batch_size": batches.reshape(-1)})
    return df[df.batch_size >= 0].reset_index(drop=True)         # -1: a rank not in that step's world


def _replan_rows(name: str, data: dict) -> pd.DataFrame:
    """One row per vector change: where it applied, when it was decided, the new vector
    (a tuple), the predicted step times and the ranks whose speed changed."""
    if "replan/run_step" not in data or not len(data["replan/run_step"]):
        return pd.DataFrame()
    n = data["replan/run_step"].shape[0]
    cols = {"run": [name] * n}
    for field in ("epoch", "step", "run_step", "decided", "predicted_before", "predicted_after"):
        cols[field] = data[f"replan/{field}"]
    cols["batch_sizes"] = [tuple(int(b) for b in row) for row in data["replan/batch_sizes"]]
    cols["changed_ranks"] = [tuple(np.flatnonzero(row).tolist()) for row in data["replan/changed"]]
    return pd.DataFrame(cols)


def _update_rows(name: str, data: dict) -> pd.DataFrame:
    fields = {key.partition("/")[2]: value for key, value in data.items() if key.startswith("update/")}
    if not fields:
        return pd.DataFrame()
    n = max(v.shape[0] for v in fields.values())
    if n == 0:                         # a synchronous run (its update/* datasets are empty)
        return pd.DataFrame()
    df = pd.DataFrame({"run": [name] * n, "gradient": np.arange(n),
                       **{k: v for k, v in fields.items() if v.shape[0] == n}})
    if "time" in df:
        df["wall_time"] = df["time"]
    return df


def run_name(path: Path, root: Path) -> str:
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = Path(path.name)
    return str(rel.with_suffix("")).replace("\\", "/")


def find_runs(folder) -> list[Path]:
    """Result files below `folder` (or `folder` itself if it is a file), sorted."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.rglob("*.h5") if p.is_file())


def load(folder, statuses=("complete",), strict: bool = False) -> Tables:
    """Every result file below `folder` whose status is in `statuses` (None: all).
    Unreadable files are skipped with a warning (raise with strict=True)."""
    import warnings
    root = Path(folder) if Path(folder).is_dir() else Path(folder).parent
    runs, epochs, ranks, steps, updates, vectors, replans = [], [], [], [], [], [], []
    for path in find_runs(folder):
        try:
            run = read_file(path)
        except (OSError, KeyError, ValueError) as exc:
            if strict:
                raise
            warnings.warn(f"skipping {path}: {exc}")
            continue
        if statuses is not None and run["attrs"].get("status") not in statuses:
            continue
        name = run_name(path, root)
        runs.append(_run_row(name, path, run))
        epochs.append(_epoch_rows(name, run["data"]))
        ranks.append(_rank_rows(name, run["data"]))
        steps.append(_step_rows(name, run["data"]))
        updates.append(_update_rows(name, run["data"]))
        vectors.append(_vector_rows(name, run["data"]))
        replans.append(_replan_rows(name, run["data"]))
    runs_df = pd.DataFrame(runs)
    if runs_df.empty:
        runs_df = pd.DataFrame(columns=["run", "path", *KEY_COLUMNS])

    def combine(frames, index):
        frames = [f for f in frames if not f.empty]
        if not frames:
            return pd.DataFrame(columns=["run", *KEY_COLUMNS, *index])
        df = pd.concat(frames, ignore_index=True)
        keys = runs_df[["run", *[c for c in KEY_COLUMNS if c in runs_df]]]
        return df.merge(keys, on="run", how="left")[
            ["run", *[c for c in KEY_COLUMNS if c in runs_df], *[c for c in df.columns if c != "run"]]]

    return Tables(runs=runs_df, epochs=combine(epochs, ["epoch"]), ranks=combine(ranks, ["epoch", "rank"]),
                  steps=combine(steps, ["step"]), updates=combine(updates, ["gradient"]),
                  vectors=combine(vectors, ["step", "rank"]), replans=combine(replans, ["run_step"]))


# --- derived tables the figures use -------------------------------------------------

def utilisation(tables: Tables, by=("strategy",)) -> pd.DataFrame:
    """Share of each rank's training time in compute, communication, waiting and data
    (summed over epochs and runs), one row per (by..., rank)."""
    r = tables.ranks
    parts = ["compute_time", "comm_time", "wait_time", "data_time"]
    g = r.groupby([*by, "rank"])[parts].sum()
    total = g.sum(axis=1)
    share = g.div(total.where(total > 0, 1.0), axis=0)
    share.columns = [c.replace("_time", "") for c in parts]
    return share.reset_index()


def speedup(tables: Tables, baseline: str = "ssgd", strategy: str = "dbs",
            group=("experiment", "speeds", "seed"), time_column: str = "steady_epoch_time") -> pd.DataFrame:
    """Measured speed-up time(baseline)/time(strategy) per group (runs that differ only in
    strategy), with the ideal next to it: `ideal` from both runs' measured step times
    (measured_ideal_speedup; mean(v)/min(v) where per-rank records are missing), and
    `proportional_ideal` = mean(v)/min(v)."""
    runs = tables.runs
    cols = [c for c in group if c in runs]
    base = runs[runs.strategy == baseline].set_index(cols)[[time_column, "run"]]
    other = runs[runs.strategy == strategy].set_index(cols)
    joined = other[[time_column, "heterogeneity", "run", "global_batch", "variant"]].join(
        base.rename(columns={time_column: "baseline_time", "run": "baseline_run"}), how="inner")
    joined = joined.rename(columns={time_column: "time", "heterogeneity": "proportional_ideal"})
    joined["speedup"] = joined["baseline_time"] / joined["time"]
    joined["ideal"] = [_pair_ideal(tables, r.baseline_run, r.run, int(r.global_batch), r.proportional_ideal)
                       for r in joined.itertuples()]
    joined["fraction_of_ideal"] = joined["speedup"] / joined["ideal"]
    return joined.reset_index()


def _pair_ideal(tables: "Tables", baseline_run: str, run: str, global_batch: int, fallback: float) -> float:
    """measured_ideal_speedup of a (baseline, strategy) pair from their ranks' step times,
    or `fallback` where the per-rank records are missing."""
    if tables.ranks is None or not len(tables.ranks) or not (tables.ranks.run == run).any() \
            or not (tables.ranks.run == baseline_run).any():
        return float(fallback)
    equal_b, equal_t = step_times(tables, baseline_run)
    b, t = step_times(tables, run)
    if len(equal_b) != len(b) or not (np.isfinite(equal_t).all() and np.isfinite(t).all()):
        return float(fallback)
    return measured_ideal_speedup(equal_b, equal_t, b, t, global_batch)


def smooth(values, window: int) -> np.ndarray:
    """Centred rolling mean (edges use what is there)."""
    return pd.Series(np.asarray(values, dtype=float)).rolling(max(1, int(window)), center=True,
                                                               min_periods=1).mean().to_numpy()


def disturbances(run: pd.Series | dict, epochs: int | None = None) -> pd.DataFrame:
    """The emulated disturbances of a run, per (epoch, rank), replayed from its
    configuration: `slow_factor` (compute-time multiplier of the --slow-rank window) and
    `extra_sleep` (seconds of the DBS paper's random sleeps in that epoch). The random
    draws are seeded by (seed, rank) and made once per epoch whatever happens, so the
    replay is exactly what the run did (heterogeneity.Emulator)."""
    get = run.get
    epochs = int(epochs if epochs is not None else get("epochs_done", get("epochs", 0)))
    world = int(get("world_size", len(get("speeds", ())) or 1))
    rows = []
    for rank in range(world):
        em = Emulator(rank, 1.0, seed=int(get("seed", 0)), slow_rank=int(get("slow_rank", -1)),
                      slow_factor=float(get("slow_factor", 1.0)), slow_epochs=tuple(get("slow_epochs", (0, 0))),
                      sleep_prob=float(get("sleep_prob", 0.0)), sleep_seconds=tuple(get("sleep_seconds", (5.0, 10.0))),
                      sleep_epochs=tuple(get("sleep_epochs", (4, 20))))
        for epoch in range(epochs):
            em.start_epoch(epoch, 1)
            rows.append((epoch, rank, float(em.factor), float(em.epoch_sleep)))
    return pd.DataFrame(rows, columns=["epoch", "rank", "slow_factor", "extra_sleep"])
