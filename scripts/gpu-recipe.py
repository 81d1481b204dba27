"""The GPU recipe's steps side by side: samples/s and data time of each run's last epoch.

    python scripts/gpu-recipe.py results/gpu/recipe-*.h5

Each file is one `dbs-mpi train` run (scripts/gpu-check.sh runs ResNet-20 on synthetic
3x32x32 data, one GPU rank, a step of the recipe added at each run: the data on the
device, channels-last, bf16, torch.compile). Prints, per run in the order given, its
options that differ from the first run's, the last epoch's samples per second (samples
over `epoch/duration`), its data time (`epoch/data_time`, the slowest rank's: gathering and copying batches)
and the samples/s over the first run's; an epoch's evaluation is not part of either.
The data time is host time: with the data on the device, the gather and augmentation are
kernels queued on the GPU, counted in the compute time that follows (samples/s is what
compares the runs).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dbs_mpi.training.results import read_run  # noqa: E402

SHOWN = ("data_on_device", "channels_last", "amp", "compile")


def last_epoch(path: str) -> dict:
    run = read_run(path)
    config, data = json.loads(run["attrs"]["config"]), run["data"]
    duration = float(data["epoch/duration"][-1])
    samples = float(data["epoch/rank_samples"][-1].sum())        # every rank's samples of the epoch
    return {"path": path, "config": config, "status": run["attrs"]["status"], "duration": duration,
            "per_second": samples / duration, "data_time": float(data["epoch/data_time"][-1].max())}


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    runs = [last_epoch(p) for p in paths]
    first = runs[0]
    print(f"{'run':<28} {'options':<44} {'samples/s':>10} {'x first':>8} {'data s':>8} {'epoch s':>8}")
    for r in runs:
        options = ", ".join(f"{k}={r['config'].get(k)}" for k in SHOWN) if r is first else ", ".join(
            f"{k}={r['config'].get(k)}" for k in SHOWN if r["config"].get(k) != first["config"].get(k))
        print(f"{Path(r['path']).stem:<28} {options or '-':<44} {r['per_second']:>10.0f} "
              f"{r['per_second'] / first['per_second']:>8.2f} {r['data_time']:>8.3f} {r['duration']:>8.3f}"
              + ("" if r["status"] == "complete" else f"  ({r['status']})"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
