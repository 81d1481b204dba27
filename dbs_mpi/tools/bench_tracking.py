"""`dbs-mpi bench tracking`: does dbs follow a change of speed in the middle of an epoch,
and give the work back when it ends?

Two ranks (not oversubscribed on 2 cores), equally fast, train side by side with ssgd,
dbs (re-planned every `dbs_interval` steps: the default) and dbs-epoch (the DBS paper's
rule, once per epoch); repeats alternate the order. In the run's steps [A, B) (A and B
in the middle of epochs) rank 1 is made slower:

  emulated    4x slower (heterogeneity.Emulator's slow_steps): the ideal is known
  contention  a real CPU hog shares rank 1's core (heterogeneity.Contention): the ideal
              comes from the speeds ssgd measured in the stretch

Every figure is read from the runs' result files (step/*): a step lasts data + compute +
comm + wait seconds on every rank (their mean is taken).

  stretch     time of steps [A, B), dbs / ssgd, against the ideal min(v) / mean(v)
              (ssgd's step is set by the slowest rank, an ideal split by the sum of speeds)
  follow      steps from A until rank 1's local batch is past the midpoint between its
              batch before A and its ideal share B v_1 / sum v
  give back   steps from B until it is back past the midpoint
  after       mean step time of the 20 steps after B / of the 20 steps before A (the
              steps until the work is given back still run the slowed vector: 4 steps
              at up to 1.6x cost about 12%)
  movement    steps outside [A - 5, B + 30) at which the vector changed, and the samples
              moved per step (share of the global batch): the vector under steady speeds

  steady      (a third scenario, not run by default) speeds 1 : 0.5, nothing disturbed,
              --tracking-epochs long: every variant's vector changes after its first 10
              steps, the samples moved per step, and the range of rank 1's local batch

Targets (checks): the stretch's ratio within 1.25 x the ideal + 0.05 (communication and
the update do not shrink), following and giving back within 8 steps, after <= 1.20.
"""
from __future__ import annotations

import numpy as np

from ..training.results import read_run

VARIANTS = {"ssgd": {"strategy": "ssgd"}, "dbs": {"strategy": "dbs"},
            "dbs-epoch": {"strategy": "dbs", "dbs_interval": "epoch"}}


def variants(intervals: str = "") -> dict:
    """ssgd, dbs (the default interval) and dbs-epoch; with intervals ("1,4,16"), one
    dbs-K variant per interval instead of dbs (the first is the one the checks judge)."""
    if not intervals:
        return dict(VARIANTS)
    steps = [int(k) for k in intervals.split(",") if k]
    return {"ssgd": VARIANTS["ssgd"], **{f"dbs-{k}": {"strategy": "dbs", "dbs_interval": str(k)} for k in steps},
            "dbs-epoch": VARIANTS["dbs-epoch"]}
SCENARIOS = ("emulated", "contention", "steady")
SLOW_RANK = 1
AROUND = 20                 # steps before the stretch and after it compared ("after")
QUIET = (5, 30)             # steps before A and after B not counted as steady ("movement")


STEADY_SPEEDS = (1.0, 0.5)


def scenario_options(name: str, steps: tuple, factor: float) -> dict:
    if name == "emulated":
        return {"slow_rank": SLOW_RANK, "slow_factor": factor, "slow_steps": steps}
    if name == "steady":
        return {"speeds": STEADY_SPEEDS}
    return {"contention_rank": SLOW_RANK, "contention_steps": steps}


def summarize_steady(runs: dict, skip: int = 10) -> dict:
    """The `steady` scenario (speeds 1 : 0.5 all run long, nothing disturbed): how often,
    and by how much, every re-planning variant moved the vector after its first `skip`
    steps, and the range of rank 1's local batch against its proportional share."""
    share = STEADY_SPEEDS[SLOW_RANK] / sum(STEADY_SPEEDS)
    out = {}
    for variant, records in runs.items():
        rows = []
        for r in records:
            batches = r["batches"]
            steady = np.arange(len(batches)) >= skip
            moves, moved = movement(batches, steady)
            full = batches[steady][batches[steady].sum(axis=1) == batches.sum(axis=1).max()]
            rows.append({"steps": int(steady.sum()), "moves": moves, "moved_per_step": moved,
                         "low": int(full[:, SLOW_RANK].min()), "high": int(full[:, SLOW_RANK].max()),
                         "seconds_per_step": float(r["seconds"][steady].mean())})
        out[variant] = rows
    return {"share": share, "metrics": out}


def step_record(path) -> dict:
    """Every step's local batches and seconds (mean over ranks of data + compute + comm +
    wait), and every rank's compute seconds, from a result file."""
    d = read_run(path)["data"]
    seconds = sum(d[f"step/{k}_time"] for k in ("data", "compute", "comm", "wait"))
    return {"batches": d["step/batch_sizes"], "seconds": seconds.mean(axis=1), "compute": d["step/compute_time"]}


def measured_speeds(record: dict, start: int, stop: int) -> np.ndarray:
    """Samples per second of compute of every rank over steps [start, stop)."""
    window = slice(start, stop)
    return record["batches"][window].sum(axis=0) / record["compute"][window].sum(axis=0)


def steps_until(batches: np.ndarray, start: int, condition) -> int | None:
    """Steps from `start` to the first full step whose vector meets condition (None:
    never; an epoch's partial last step is not a vector)."""
    full = batches.sum(axis=1) == batches.sum(axis=1).max()
    for s in range(start, len(batches)):
        if full[s] and condition(batches[s]):
            return s - start
    return None


def movement(batches: np.ndarray, steady: np.ndarray) -> tuple[int, float]:
    """(vector changes, samples moved per step as a share of the global batch) between
    consecutive full steps (an epoch's partial last step skipped) that are both steady."""
    full = batches.sum(axis=1) == batches.sum(axis=1).max()
    index = np.flatnonzero(full)
    pairs = steady[index[1:]] & steady[index[:-1]]
    moved = np.abs(np.diff(batches[index], axis=0)).sum(axis=1)[pairs] / 2
    return int(np.count_nonzero(moved)), float(moved.mean() / batches[0].sum()) if len(moved) else 0.0


def run_metrics(record: dict, start: int, stop: int, share: float) -> dict:
    """The figures of one run; share: rank 1's ideal share of the global batch in the stretch."""
    batches, seconds = record["batches"], record["seconds"]
    global_batch = int(batches[0].sum())
    full = np.flatnonzero(batches[:start].sum(axis=1) == global_batch)     # not an epoch's partial last step
    before = int(batches[full[-1], SLOW_RANK])
    middle = (before + share * global_batch) / 2
    steady = np.ones(len(batches), bool)
    steady[max(start - QUIET[0], 0):stop + QUIET[1]] = False
    moves, moved = movement(batches, steady)
    return {"stretch_seconds": float(seconds[start:stop].sum()),
            "follow": steps_until(batches, start, lambda v: v[SLOW_RANK] < middle),
            "give_back": steps_until(batches, stop, lambda v: v[SLOW_RANK] > middle),
            "after": float(seconds[stop:stop + AROUND].mean() / seconds[start - AROUND:start].mean()),
            "moves": moves, "moved_per_step": moved, "slowed_batch": float(np.median(batches[start:stop, SLOW_RANK]))}


def summarize(runs: dict, start: int, stop: int, factor: float | None) -> dict:
    """runs: variant -> list of step records (one per repeat). factor: the emulated
    slow-down (None: the speeds ssgd measured in the stretch give the ideal)."""
    if factor is not None:
        speeds = np.array([1.0, 1.0 / factor])
    else:
        speeds = np.median([measured_speeds(r, start, stop) for r in runs["ssgd"]], axis=0)
    ideal = float(speeds.min() / speeds.mean())
    share = float(speeds[SLOW_RANK] / speeds.sum())
    metrics = {v: [run_metrics(r, start, stop, share) for r in rs] for v, rs in runs.items()}
    ratio = {v: [m["stretch_seconds"] / s["stretch_seconds"] for m, s in zip(metrics[v], metrics["ssgd"])]
             for v in metrics if v != "ssgd"}
    return {"speeds": speeds.tolist(), "ideal": ideal, "share": share, "metrics": metrics, "stretch_ratio": ratio}


def median_of(values) -> float:
    values = [np.inf if v is None else v for v in values]
    return float(np.median(values))
