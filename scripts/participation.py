"""Participation measured: `dbs-mpi train` runs side by side, medians over repeats.

    .venv/bin/python scripts/participation.py --repeats 3 [--cases slow,third,stretch,coupled,steady,crossover]

LeNet-5 on Fashion-MNIST (`--subset`, default 30,720 samples: 60 steps of B = 512), the
steps timed on rank 0 (data, compute, wait, collective and update of every step, from
the result file), each case against its baseline in the same repeat:

* slow: 2 ranks at emulated speeds 1:0.02, dbs with `--participation auto` and `all`,
  against 1 rank: the second epoch's time over the 1-rank run's;
* third: 3 ranks at 1,1,0.02 against 2 ranks at 1,1 (3 ranks on 2 cores are
  oversubscribed while all compute: the calibration; the rank that sits out sleeps);
* stretch: 2 equal ranks, rank 1 50x slower in the run's steps [20, 60): the stretch's
  time over 1 rank's same steps, the same for its steps 30-59 (after the first moves:
  the first slowed steps take 50x whatever the planner does), and the steps after 60
  until rank 1 has 80% of its share again (auto and all);
* coupled: 2 ranks at 1:0.25, rank 0 at half its speed whenever the other computes
  (`--couple 0:2`): its second epoch and the whole run (3 epochs, start-up included,
  the launch's wall time) over 1 rank's, and the steps (of 180) in which rank 1 took
  part, rank 0 then at half speed; "slow" reports the whole run at 1:0.02 too;
* steady: 2 ranks at 1:0.1, dbs (3 epochs): the slow rank's local batch over epochs 2-3,
  its median, range (largest less smallest) and largest jump between two steps (and
  between two steps it took part in), the re-plans of those epochs by cause (plan,
  probe in the step, revert, trial, lift: balancer.Change.CAUSES), and what an in-step probe
  cost: rank 0's step while it ran over the 5 steps before;
* crossover: 2 ranks at 1:x for x in 0.5, 0.2, 0.1, 0.05, 0.02, dbs with participation
  auto and all, each over 1 rank alone (the best subset is the smaller of all's and 1).

Nothing else should compute beside it (2 cores: two ranks fill them).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dbs_mpi import read_run  # noqa: E402
from dbs_mpi.training.balancer import Change  # noqa: E402

BASE = ["--model", "lenet5", "--dataset", "fashion-mnist", "--global-batch", "512", "--strategy", "dbs",
        "--test-subset", "500", "--progress", "false", "--checkpoint-every", "0"]


WALL = {}            # result file -> the launch's wall seconds


def run(ranks: int, args: list, out: Path) -> dict:
    """One `dbs-mpi train` job (launched with mpirun, 1 rank too); returns its result file's data."""
    launcher = [str(ROOT / ".venv/bin/mpirun"), "-n", str(ranks)]
    cmd = launcher + [str(ROOT / ".venv/bin/dbs-mpi"), "train", *BASE, *args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    WALL[out] = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return read_run(out)["data"]


def step_seconds(d: dict) -> np.ndarray:
    """Every step's time on rank 0 (its phases, the wait included)."""
    parts = ("data_time", "pre_time", "wait_time", "comm_time")
    return sum(np.asarray(d[f"step/{k}"])[:, 0] for k in parts)


def epoch_seconds(d: dict, epoch: int) -> float:
    return float(step_seconds(d)[np.asarray(d["step/epoch"]) == epoch].sum())


def case_slow(tmp: Path, subset: list) -> dict:
    alone = epoch_seconds(run(1, subset + ["--epochs", "3", "--threads", "1"], tmp / "alone.h5"), 1)
    out = {}
    for mode in ("auto", "all"):
        d = run(2, subset + ["--epochs", "3", "--speeds", "1,0.02", "--participation", mode], tmp / f"{mode}.h5")
        out[f"1:0.02 {mode} / 1 rank"] = epoch_seconds(d, 1) / alone
        out[f"1:0.02 {mode} whole run / 1 rank"] = WALL[tmp / f"{mode}.h5"] / WALL[tmp / "alone.h5"]
    out["1:0.02 auto / all"] = out["1:0.02 auto / 1 rank"] / out["1:0.02 all / 1 rank"]
    return out


def case_third(tmp: Path, subset: list) -> dict:
    two = epoch_seconds(run(2, subset + ["--epochs", "2", "--speeds", "1,1"], tmp / "two.h5"), 1)
    three = run(3, subset + ["--epochs", "2", "--speeds", "1,1,0.02"], tmp / "three.h5")
    return {"1,1,0.02 / 1,1": epoch_seconds(three, 1) / two}


def case_stretch(tmp: Path, subset: list) -> dict:
    steps = step_seconds(run(1, subset + ["--epochs", "2", "--threads", "1"], tmp / "alone.h5"))
    alone, alone_steady = steps[20:60].sum(), steps[30:60].sum()
    out = {}
    for mode in ("auto", "all"):
        d = run(2, subset + ["--epochs", "2", "--slow-rank", "1", "--slow-factor", "50", "--slow-steps", "20,60",
                             "--participation", mode], tmp / f"stretch-{mode}.h5")
        rows = np.asarray(d["step/batch_sizes"])
        share = np.median(rows[:20, 1])
        back = next((s - 60 for s in range(60, len(rows)) if rows[s, 1] >= 0.8 * share), len(rows) - 60)
        out[f"50x stretch {mode} / 1 rank"] = step_seconds(d)[20:60].sum() / alone
        out[f"50x steps 30-59 {mode} / 1 rank"] = step_seconds(d)[30:60].sum() / alone_steady
        out[f"50x stretch {mode}: steps to come back"] = back
    return out


def case_coupled(tmp: Path, subset: list) -> dict:
    alone = run(1, subset + ["--epochs", "3", "--threads", "1"], tmp / "alone.h5")
    d = run(2, subset + ["--epochs", "3", "--speeds", "1,0.25", "--couple", "0:2"], tmp / "coupled.h5")
    return {"coupled 1:0.25, 0 at 1/2 / 1 rank": epoch_seconds(d, 1) / epoch_seconds(alone, 1),
            "coupled whole run / 1 rank": WALL[tmp / "coupled.h5"] / WALL[tmp / "alone.h5"],
            "coupled: steps rank 1 took part": float((np.asarray(d["step/batch_sizes"])[:, 1] > 0).sum())}


def case_steady(tmp: Path, subset: list) -> dict:
    d = run(2, subset + ["--epochs", "3", "--speeds", "1,0.1"], tmp / "steady.h5")
    slow = np.asarray(d["step/batch_sizes"])[np.asarray(d["step/epoch"]) >= 1, 1]
    jumps = np.abs(np.diff(slow))
    taking_part = (slow[1:] > 0) & (slow[:-1] > 0)
    causes = np.asarray(d["replan/cause"])[np.asarray(d["replan/epoch"]) >= 1]
    figures = {"1:0.1 slow rank's batch, epochs 2-3: median": float(np.median(slow)),
               "1:0.1 slow rank's batch: range": float(slow.max() - slow.min()),
               "1:0.1 slow rank's batch: largest jump": float(jumps.max()),
               "1:0.1 ... largest jump while it takes part": float(jumps[taking_part].max(initial=0))}
    for code, cause in enumerate(Change.CAUSES):        # the re-plans of epochs 2-3 by cause (forced: none)
        if cause == "forced":
            continue
        figures[f"1:0.1 re-plans in epochs 2-3: {cause}"] = float((causes == code).sum())
    cost = probe_cost(d)
    if cost is not None:
        figures["1:0.1 in-step probes' steps over the 5 before (rank 0's step)"] = cost
    return figures


def probe_cost(d: dict) -> float | None:
    """The median over the run's in-step probes of rank 0's median step while the probe's
    vector ran over its median of the 5 steps before (None: no in-step probe)."""
    steps, rows = step_seconds(d), np.asarray(d["step/batch_sizes"])
    ratios = []
    for start, cause in zip(np.asarray(d["replan/run_step"]), np.asarray(d["replan/cause"])):
        if Change.CAUSES[int(cause)] != "probe" or start < 5:
            continue
        end = start + 1
        while end < len(rows) and np.array_equal(rows[end], rows[start]):
            end += 1
        if end - start < 2:
            continue                                      # the run ended in its first step
        ratios.append(np.median(steps[start + 1:end]) / np.median(steps[start - 5:start]))  # (its first: new shapes)
    return float(np.median(ratios)) if ratios else None


def case_crossover(tmp: Path, subset: list) -> dict:
    alone = epoch_seconds(run(1, subset + ["--epochs", "2", "--threads", "1"], tmp / "alone.h5"), 1)
    out = {}
    for x in (0.5, 0.2, 0.1, 0.05, 0.02):
        speeds = ["--epochs", "2", "--speeds", f"1,{x}"]
        auto = epoch_seconds(run(2, subset + speeds, tmp / f"x{x}.h5"), 1)
        both = epoch_seconds(run(2, subset + speeds + ["--participation", "all"], tmp / f"x{x}-all.h5"), 1)
        out[f"1:{x} auto / 1 rank"] = auto / alone
        out[f"1:{x} all / 1 rank"] = both / alone
    return out


CASES = {"slow": case_slow, "third": case_third, "stretch": case_stretch, "coupled": case_coupled,
         "steady": case_steady, "crossover": case_crossover}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--subset", type=int, default=30720)
    args = p.parse_args()
    subset = ["--subset", str(args.subset), "--data-dir", str(ROOT / "data")]
    figures: dict[str, list] = {}
    for repeat in range(args.repeats):
        for name in args.cases.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                for key, value in CASES[name](Path(tmp), subset).items():
                    figures.setdefault(key, []).append(value)
        print(f"repeat {repeat + 1} of {args.repeats} done", file=sys.stderr, flush=True)
    for key, values in figures.items():
        print(f"{key:42s} median {statistics.median(values):7.3f}   "
              f"({', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
