"""The adaptive global batch against fixed ones: time to accuracy and final accuracy.

    .venv/bin/python -m dbs_mpi.tools.experiments --only adaptive,adaptive-bn --out results/adaptive
    .venv/bin/python scripts/adaptive-targets.py results/adaptive [--accuracy 0.88]

Reads the grid's result files (dbs_mpi.tools.analysis, time_to_accuracy) and prints, per
experiment whose name starts with "adaptive" and per global batch ("auto" and each fixed
B): the training time (evaluation excluded) to the test accuracy (`--accuracy`, else a
point below the fixed B's highest final accuracy, rounded down to half a point), the
median over seeds, and the final test accuracy's median; then the three figures the
adaptive batch is judged by: its time over B = 512's (today's default), over the best
fixed B's, and its final accuracy less the best fixed B's (in points). A seed that never
reached the accuracy counts as infinite.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dbs_mpi.tools import analysis, time_to_accuracy  # noqa: E402


def ratio(a: float, b: float) -> str:
    """a / b, or what stands in for it where a time is infinite (the accuracy not reached)."""
    if math.isinf(b):
        return "0 (the fixed B never reached it)" if not math.isinf(a) else "- (neither reached it)"
    return f"{a / b:.3f}"


def report(name: str, tables, accuracy: float | None) -> None:
    judged = time_to_accuracy.judge(tables, name, accuracy)
    runs, times, finals = judged.runs, judged.median_time, judged.median_final
    print(f"\n{name}: {runs.model.iloc[0]}, seeds {sorted(runs.seed.unique().tolist())}, "
          f"time to {100 * judged.target:.1f}% test accuracy (medians over seeds)")
    for label in judged.order:
        each_time, each_final = judged.times[label], judged.finals[label]
        print(f"  {label:>5}: {times[label]:7.2f} s  final {100 * finals[label]:6.2f}%   "
              f"(times {', '.join(f'{x:.2f}' for x in each_time)}; "
              f"finals {', '.join(f'{100 * x:.2f}' for x in each_final)})")
    best = judged.best_fixed
    if "512" in times:
        print(f"  auto / 512:        {ratio(times['auto'], times['512'])}   (target at most 0.8)")
    print(f"  auto / best ({best}): {ratio(times['auto'], times[best])}   (target at most 1.05)")
    print(f"  final accuracy, auto less the best fixed: {100 * (finals['auto'] - finals[judged.fixed].max()):+.2f} "
          f"points   (target at least -0.5)")


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
