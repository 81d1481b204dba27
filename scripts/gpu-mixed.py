"""A GPU rank beside CPU ranks against the GPU rank alone, side by side in one call.

    python scripts/gpu-mixed.py [--cases lenet5,resnet20,pair,pays] [--repeats 1] [--cpu-ranks 7]

Every case runs `dbs-mpi train` as one launch per job: the GPU rank alone (`ssgd`, one
rank: plain training) first, then the mixed job (`--strategy`, default `dbs` with
`--participation auto`), in the same repeat:

* lenet5: LeNet-5 on Fashion-MNIST (the first 30,000 images, B = 512, 3 epochs), the
  GPU rank beside `--cpu-ranks` CPU ranks;
* resnet20: ResNet-20 on synthetic 3x32x32 data (4,096 samples, B = 256, 3 epochs);
* pair: LeNet-5 as in lenet5, the GPU rank beside one CPU rank (which gets the node's
  other cores: `--threads 0`);
* pays: LeNet-5 with the GPU rank slowed by emulation to `--gpu-speed` (0.1: about
  what the 7 CPU ranks of a 16-core node compute together beside an H200), alone and
  beside the CPU ranks: there mixing should beat the GPU alone.

Printed per case: the whole run over the GPU alone's (the launch's wall time, start-up
and imports included), each epoch over the GPU alone's same epoch (`epoch/duration`),
the last epoch's vector, and how many steps each CPU rank took part in. Medians over
repeats; a failed launch prints its error's last line and the case goes on.
`--gpu cpu` runs the same jobs with the "GPU" rank on the CPU (a smoke test of the
script on a machine without a GPU: its figures mean nothing).
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

LENET = ["--model", "lenet5", "--dataset", "fashion-mnist", "--subset", "30000", "--global-batch", "512"]
RESNET = ["--model", "resnet20", "--dataset", "synthetic", "--synthetic-shape", "3,32,32",
          "--synthetic-samples", "4096", "--global-batch", "256"]
COMMON = ["--epochs", "3", "--test-subset", "1000", "--progress", "false", "--checkpoint-every", "0"]


def launch(args, ranks: int, devices: list, out: Path, timeout: float) -> tuple[float, dict | None, str]:
    """One `dbs-mpi train` job: (wall seconds, its result's data or None, the error's last line)."""
    mpirun = os.environ.get("MPIRUN", "mpirun")
    cmd = [mpirun, "-n", str(ranks), sys.executable, "-m", "dbs_mpi", "train", *COMMON, *args,
           "--devices", ",".join(devices), "--out", str(out)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, None, f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - start
    if proc.returncode:
        return wall, None, (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
    return wall, read_run(out)["data"], ""


def compare(alone, mixed) -> dict:
    """The figures of one repeat: ratios of the mixed job to the GPU alone."""
    (wall_a, a, _), (wall_m, m, _) = alone, mixed
    epochs = np.asarray(m["epoch/duration"]) / np.asarray(a["epoch/duration"])
    rows = np.asarray(m["step/batch_sizes"])
    return {"whole run / alone": wall_m / wall_a, "epoch ratios": epochs.round(3).tolist(),
            "largest epoch / alone": float(epochs.max()),
            "last vector": np.asarray(m["epoch/batch_sizes"])[-1].tolist(),
            "steps each CPU rank took part in": (rows[:, 1:] > 0).sum(axis=0).tolist(), "steps": len(rows)}


def case(name: str, a: argparse.Namespace, tmp: Path) -> dict | str:
    gpu, cpus = a.gpu, ["cpu"] * (1 if name == "pair" else a.cpu_ranks)
    data = RESNET if name == "resnet20" else LENET
    extra = ["--strategy", a.strategy] + (["--data-dir", a.data_dir] if a.data_dir else [])
    slow_alone, slow_mixed = [], []
    if name == "pays":     # (speeds are relative to the fastest rank's: alone, the GPU's is a slow-down)
        slow_alone = ["--slow-rank", "0", "--slow-factor", str(1.0 / a.gpu_speed), "--slow-steps", "0,1000000"]
        slow_mixed = ["--speeds", ",".join([str(a.gpu_speed)] + ["1"] * len(cpus))]
    alone = launch(data + ["--strategy", "ssgd"] + extra[2:] + slow_alone, 1, [gpu], tmp / "alone.h5", a.timeout)
    mixed = launch(data + extra + slow_mixed, 1 + len(cpus), [gpu] + cpus, tmp / "mixed.h5", a.timeout)
    failed = [f"{which}: {r[2]}" for which, r in (("alone", alone), ("mixed", mixed)) if r[1] is None]
    return "; ".join(failed) if failed else compare(alone, mixed)


def report(name: str, results: list) -> None:
    done = [r for r in results if isinstance(r, dict)]
    for r in results:
        if not isinstance(r, dict):
            print(f"{name}: failed: {r}")
    if not done:
        return
    whole = [r["whole run / alone"] for r in done]
    largest = [r["largest epoch / alone"] for r in done]
    runs = ", ".join(f"{w:.3f}" for w in whole)
    print(f"{name}: whole run / GPU alone median {statistics.median(whole):.3f} ({runs}); "
          f"largest epoch / alone median {statistics.median(largest):.3f}")
    for r in done:
        print(f"  epochs / alone {r['epoch ratios']}, last vector {r['last vector']}, "
              f"CPU ranks took part in {r['steps each CPU rank took part in']} of {r['steps']} steps")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="lenet5,resnet20,pair,pays")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cpu-ranks", type=int, default=7)
    p.add_argument("--gpu", default="cuda", help="the GPU rank's device (cpu: a smoke test)")
    p.add_argument("--gpu-speed", type=float, default=0.1, help="pays: the GPU rank's emulated speed")
    p.add_argument("--strategy", default="dbs")
    p.add_argument("--data-dir", default="")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a launch may take")
    a = p.parse_args()
    for name in a.cases.split(","):
        if name not in ("lenet5", "resnet20", "pair", "pays"):
            print(f"gpu-mixed: unknown case {name!r}", file=sys.stderr)
            return 2
        results = []
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(case(name, a, Path(tmp)))
        report(name, results)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
