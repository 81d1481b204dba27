"""The simulator against real runs: predicted and measured epoch times, and the error.

    .venv/bin/python scripts/simulator-validation.py --generate results/validation   # fresh runs (~7 min)
    .venv/bin/python scripts/simulator-validation.py results/validation results/grid  # the error table

--generate runs the validation set into the folder (runs already complete are kept):
ssgd, static and dbs at 2 ranks (emulated speeds 1:0.5) and at 4 ranks (1:0.5:0.25:0.25,
oversubscribed on 2 cores), asgd at 3 and 4 ranks, and real contention with no emulated
speeds: 4 equal ranks on 2 cores, and 3 ranks pinned so that ranks 1 and 2 share a core
(rank 0 is then about twice as fast as each of them). The dbs runs without a suffix
re-plan once per epoch (the rule they were recorded with); `-steps` runs re-plan every
step, and the `-midepoch` pair has rank 1 slowed 4x from the middle of epoch 1 to the
middle of epoch 3. LeNet-5 on Fashion-MNIST (first 30,000 images), global batch 512, 3
epochs.

Without --generate, every complete run in the folders is replayed (`dbs-mpi simulate
--from`, which reads only the run's configuration and start-up calibration) and set
beside its measured epoch times. Error of a run: predicted total training time over
measured, less 1. Printed: one row per run and the mean absolute error (MAE) per folder.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
COMMON = ["--dataset", "fashion-mnist", "--model", "lenet5", "--subset", "30000", "--test-subset", "2000",
          "--epochs", "3", "--global-batch", "512", "--progress", "false"]
PIN_3 = 'exec taskset -c $(( PMI_RANK > 0 )) "$@"'          # rank 0: core 0; ranks 1, 2: core 1
RUNS = {   # name: (ranks, options, pinned)
    "ssgd-2r": (2, ["--strategy", "ssgd", "--speeds", "1,0.5"], False),
    "static-2r": (2, ["--strategy", "static", "--speeds", "1,0.5"], False),
    "dbs-2r": (2, ["--strategy", "dbs", "--speeds", "1,0.5", "--dbs-interval", "epoch"], False),
    "dbs-2r-steps": (2, ["--strategy", "dbs", "--speeds", "1,0.5"], False),
    "ssgd-4r": (4, ["--strategy", "ssgd", "--speeds", "1,0.5,0.25,0.25"], False),
    "static-4r": (4, ["--strategy", "static", "--speeds", "1,0.5,0.25,0.25"], False),
    "dbs-4r": (4, ["--strategy", "dbs", "--speeds", "1,0.5,0.25,0.25", "--dbs-interval", "epoch"], False),
    "dbs-4r-steps": (4, ["--strategy", "dbs", "--speeds", "1,0.5,0.25,0.25"], False),
    "ssgd-2r-midepoch": (2, ["--strategy", "ssgd", "--slow-rank", "1", "--slow-factor", "4", "--slow-steps", "30,150"],
                         False),
    "dbs-2r-midepoch": (2, ["--strategy", "dbs", "--slow-rank", "1", "--slow-factor", "4", "--slow-steps", "30,150"],
                        False),
    "asgd-3r": (3, ["--strategy", "asgd", "--speeds", "1,1,0.5"], False),
    "asgd-4r": (4, ["--strategy", "asgd", "--speeds", "1,1,0.5,0.25"], False),
    "ssgd-4r-real": (4, ["--strategy", "ssgd"], False),
    "ssgd-3r-pinned": (3, ["--strategy", "ssgd"], True),
    "dbs-3r-pinned": (3, ["--strategy", "dbs", "--dbs-interval", "epoch"], True),
}


def generate(folder: Path, mpiexec: str) -> None:
    from dbs_mpi.training.results import read_run
    folder.mkdir(parents=True, exist_ok=True)
    for name, (ranks, options, pinned) in RUNS.items():
        out = folder / f"{name}.h5"
        if out.exists() and read_run(out)["attrs"].get("status") == "complete":
            continue
        out.unlink(missing_ok=True)
        Path(str(out) + ".ckpt").unlink(missing_ok=True)            # (a run that timed out left it)
        train = [sys.executable, "-m", "dbs_mpi", "train", *COMMON, *options, "--data-dir", str(ROOT / "data"),
                 "--out", str(out)]
        cmd = [mpiexec, "-n", str(ranks), *(["bash", "-c", PIN_3, "pin"] if pinned else []), *train]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=900)
        Path(str(out) + ".ckpt").unlink(missing_ok=True)
        print(f"ran {name}", flush=True)


def replay_folder(folder: Path) -> list[dict]:
    from dbs_mpi.tools.machine import Machine
    from dbs_mpi.tools.simulator import replay
    machine, rows = Machine.load(), []
    for path in sorted(folder.glob("*.h5")):
        with h5py.File(path, "r") as f:
            if f.attrs.get("status") != "complete":
                continue
        out = replay(path, machine)
        pred, meas = np.sum(out["epoch_time_predicted"]), np.sum(out["epoch_time_measured"])
        rows.append({"run": path.name, "strategy": out["strategy"], "ranks": out["world_size"],
                     "predicted": float(pred), "measured": float(meas), "error": float(pred / meas - 1),
                     "load": out["load_factor"]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="*", type=Path)
    p.add_argument("--generate", type=Path, metavar="FOLDER")
    p.add_argument("--mpiexec", default=str(Path(sys.executable).parent / "mpirun"))
    p.add_argument("--json", type=Path, help="also write the table as JSON")
    a = p.parse_args()
    if a.generate:
        generate(a.generate, a.mpiexec)
        return 0
    table = {}
    for folder in a.folders:
        rows = replay_folder(folder)
        table[str(folder)] = rows
        print(f"\n{folder}: {len(rows)} runs")
        print(f"{'run':<34} {'strategy':<9} {'ranks':>5} {'predicted s':>11} {'measured s':>10} {'error':>7} {'load':>5}")
        for r in rows:
            print(f"{r['run']:<34} {r['strategy']:<9} {r['ranks']:>5} {r['predicted']:>11.2f} {r['measured']:>10.2f} "
                  f"{100 * r['error']:>+6.1f}% {r['load']:>5.2f}")
        print(f"mean absolute error {100 * np.mean([abs(r['error']) for r in rows]):.1f}% over {len(rows)} runs")
    if a.json:
        a.json.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
