"""Time to accuracy: how long each global batch of an experiment took to reach a test
accuracy, and where it ended. No MPI, no plotting: the adaptive notebook's caption and
scripts/adaptive-targets.py read the same numbers from here.

    from dbs_mpi.tools import analysis, time_to_accuracy
    t = time_to_accuracy.judge(analysis.load("results/grid"), "adaptive")
    t.median_time["auto"] / t.median_time["512"]

A run is labelled by its global batch: "auto" for `--global-batch auto`, else B. Its
time to the target is the training time (evaluation excluded) at the end of the first
epoch whose test accuracy reached it; a seed that never reached it counts as infinite,
so a median is finite only where most seeds reached it. The target, unless given, is
a trained model's quality, set by the fixed global batches alone: the highest of their
final accuracies (medians of seeds) less NEAR_FINAL, rounded down to half a point (as
benchmarks of time to train set their targets a little below what the reference
reaches). An accuracy every global batch reached, the rule before, raced the first
epochs wherever one B (1024 in 10 epochs) never trained far.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

AUTO = "auto"
NEAR_FINAL = 0.01        # the default target: this far below the fixed B's highest final accuracy


@dataclass(frozen=True)
class Judged:
    """One experiment's runs judged by time to `target` (a fraction)."""
    runs: pd.DataFrame           # the experiment's rows of Tables.runs, with a `label` column
    target: float
    times: pd.Series             # seconds to the target per (label, seed); inf: never reached
    finals: pd.Series            # the last epoch's test accuracy per (label, seed)

    @property
    def order(self) -> list[str]:
        """"auto" first (where the experiment has it), then the fixed global batches, ascending."""
        labels = set(self.runs.label)
        return ([AUTO] if AUTO in labels else []) + sorted((b for b in labels if b != AUTO), key=int)

    @property
    def fixed(self) -> list[str]:
        return [b for b in self.order if b != AUTO]

    @property
    def median_time(self) -> pd.Series:
        return self.times.groupby("label").median().reindex(self.order)

    @property
    def median_final(self) -> pd.Series:
        return self.finals.groupby("label").median().reindex(self.order)

    @property
    def best_fixed(self) -> str:
        """The fixed global batch with the shortest median time to the target."""
        return str(self.median_time[self.fixed].idxmin())


def labels(runs: pd.DataFrame) -> np.ndarray:
    """Each run's label: "auto" for an adaptive global batch, else the global batch."""
    auto = runs.global_batch_auto.fillna(False).astype(bool) if "global_batch_auto" in runs else False
    return np.where(auto, AUTO, runs.global_batch.astype(int).astype(str))


def judge(tables, experiment: str, accuracy: float | None = None) -> Judged:
    """The runs of `experiment` in `tables` (analysis.Tables), judged by their time to
    `accuracy` (a fraction; None: near the fixed global batches' highest final accuracy)."""
    runs = tables.runs[tables.runs.experiment == experiment].copy()
    if runs.empty:
        raise ValueError(f"no run of experiment {experiment!r}")
    runs["label"] = labels(runs)
    key = runs.set_index("run")[["label", "seed"]]
    epochs = tables.epochs[tables.epochs.run.isin(runs.run)].sort_values(["run", "epoch"])
    epochs = epochs.assign(label=epochs.run.map(key.label), seed=epochs.run.map(key.seed))
    every = pd.MultiIndex.from_frame(runs[["label", "seed"]]).sort_values()
    finals = epochs.groupby(["label", "seed"]).test_accuracy.last().reindex(every)
    target = accuracy if accuracy is not None else near_final(finals)
    times = epochs[epochs.test_accuracy >= target].groupby(["label", "seed"]).wall_time.min()
    return Judged(runs, float(target), times.reindex(every, fill_value=np.inf), finals)


def near_final(finals: pd.Series) -> float:
    """The default target: the highest median final accuracy of the fixed global batches
    less NEAR_FINAL, rounded down to half a point (finals: per (label, seed), the last
    evaluated epoch's; "auto" unused)."""
    fixed = finals[finals.index.get_level_values("label") != AUTO]
    best = fixed.groupby("label").median().max() if not fixed.empty else np.nan
    if not np.isfinite(best):
        raise ValueError("no run with a fixed global batch and a test accuracy to set the target by: give the accuracy")
    return float(np.floor(200 * (best - NEAR_FINAL) + 1e-9) / 200)
