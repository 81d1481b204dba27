"""The adaptive global batch against fixed ones: time to accuracy and final accuracy.

    .venv/bin/python -m dbs_mpi.tools.experiments --only adaptive,adaptive-bn --out results/adaptive
    .venv/bin/python scripts/adaptive-targets.py results/adaptive [--accuracy 0.88]

Reads the grid's result files (dbs_mpi.tools.analysis) and prints, per experiment whose
name starts with "adaptive" and per global batch ("auto" and each fixed B): the training
time (evaluation excluded) to the test accuracy (`--accuracy`, else the lowest of the
runs' best, rounded down to half a point), the median over seeds, and the final test
accuracy's median; then the three figures the adaptive batch is judged by: its time over
B = 512's (today's default), over the best fixed B's, and its final accuracy less the
best fixed B's (in points). A seed that never reached the accuracy counts as infinite.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dbs_mpi.tools import analysis  # noqa: E402


def label_of(runs):
    auto = runs.global_batch_auto.fillna(False).astype(bool)
    return np.where(auto, "auto", runs.global_batch.astype(str))


def ratio(a: float, b: float) -> str:
    """a / b, or what stands in for it where a time is infinite (the accuracy not reached)."""
    if math.isinf(b):
        return "0 (the fixed B never reached it)" if not math.isinf(a) else "- (neither reached it)"
    return f"{a / b:.3f}"


def report(name: str, tables, accuracy: float | None) -> None:
    runs = tables.runs[tables.runs.experiment == name].copy()
    runs["label"] = label_of(runs)
    epochs = tables.epochs[tables.epochs.run.isin(runs.run)].copy()
    epochs["label"] = epochs.run.map(runs.set_index("run").label)
    target = accuracy if accuracy else math.floor(200 * epochs.groupby("label").test_accuracy.max().min()) / 200
    rows = {}
    for label, group in runs.groupby("label"):
        times, finals = [], []
        for run in group.run:
            e = epochs[epochs.run == run].sort_values("epoch")
            hit = e[e.test_accuracy >= target]
            times.append(float(hit.wall_time.iloc[0]) if len(hit) else math.inf)
            finals.append(float(e.test_accuracy.iloc[-1]))
        rows[label] = (float(np.median(times)), float(np.median(finals)), times, finals)
    order = ["auto"] + sorted((k for k in rows if k != "auto"), key=int)
    print(f"\n{name}: {runs.model.iloc[0]}, seeds {sorted(runs.seed.unique().tolist())}, "
          f"time to {100 * target:.1f}% test accuracy (medians over seeds)")
    for label in order:
        t, a, times, finals = rows[label]
        print(f"  {label:>5}: {t:7.2f} s  final {100 * a:6.2f}%   "
              f"(times {', '.join(f'{x:.2f}' for x in times)}; finals {', '.join(f'{100 * x:.2f}' for x in finals)})")
    fixed = [k for k in order if k != "auto"]
    best = min(fixed, key=lambda k: rows[k][0])
    best_final = max(rows[k][1] for k in fixed)
    auto_t, auto_a = rows["auto"][0], rows["auto"][1]
    if "512" in rows:
        print(f"  auto / 512:        {ratio(auto_t, rows['512'][0])}   (target at most 0.8)")
    print(f"  auto / best ({best}): {ratio(auto_t, rows[best][0])}   (target at most 1.05)")
    print(f"  final accuracy, auto less the best fixed: {100 * (auto_a - best_final):+.2f} points   "
          f"(target at least -0.5)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--accuracy", type=float, default=None, help="the test accuracy to reach (a fraction)")
    args = p.parse_args()
    tables = analysis.load(args.folder)
    names = sorted(n for n in tables.runs.experiment.dropna().unique() if str(n).startswith("adaptive"))
    if not names:
        raise SystemExit(f"no run of an 'adaptive' experiment in {args.folder}")
    for name in names:
        report(name, tables, args.accuracy)


if __name__ == "__main__":
    main()
