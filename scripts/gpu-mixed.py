"""A GPU rank beside CPU ranks against the GPU rank alone, side by side in one call.

    python scripts/gpu-mixed.py [--cases lenet5,resnet20,pair,pays] [--repeats 1] [--out-dir DIR]

Every case runs `dbs-mpi train` as one launch per job: the GPU rank alone (`ssgd`, one
rank: plain training) first, then the mixed job (`--strategy`, default `dbs` with
`--participation auto`), in the same repeat:

* lenet5: LeNet-5 on Fashion-MNIST (the first 30,000 images, B = 512, 3 epochs), the
  GPU rank beside `--cpu-ranks` CPU ranks;
* resnet20: ResNet-20 on synthetic 3x32x32 data (4,096 samples, B = 256, 3 epochs);
* pair: LeNet-5 as in lenet5, the GPU rank beside one CPU rank (which gets the node's
  other cores: `--threads 0`); its GPU alone is lenet5's where both run;
* pays: LeNet-5 with the GPU rank slowed by emulation to `--gpu-speed` (0.1: about
  what the 7 CPU ranks of a 16-core node compute together beside an H200), alone and
  beside the CPU ranks: there mixing should beat the GPU alone.

Printed per case as soon as it ran (and medians over repeats at the end): the whole run
over the GPU alone's (the launch's wall time: start-up, imports, evaluation and the
result file included), the training over the GPU alone's (the epochs' `epoch/duration`
summed), each epoch over the GPU alone's same epoch, the seconds behind them, the last
epoch's vector, and in how many steps each CPU rank took part. The result files stay in
`--out-dir` (default: a temporary folder, removed). A launch that fails or outlasts
`--timeout` prints its error's last lines, and the case goes on. MPIRUN (default
`mpirun`, words split as a shell would) launches the jobs; it must match the MPI that
mpi4py loads. `--gpu cpu` runs the same jobs with the "GPU" rank on the CPU (a smoke
test of the script on a machine without a GPU: its figures mean nothing).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
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

CASES = ("lenet5", "resnet20", "pair", "pays")
LENET = ["--model", "lenet5", "--dataset", "fashion-mnist", "--subset", "30000", "--global-batch", "512"]
RESNET = ["--model", "resnet20", "--dataset", "synthetic", "--synthetic-shape", "3,32,32",
          "--synthetic-samples", "4096", "--global-batch", "256"]
COMMON = ["--epochs", "3", "--test-subset", "1000", "--progress", "false", "--checkpoint-every", "0",
          "--comm-timeout", "60", "--startup-timeout", "60"]          # (a stuck rank ends its job in a minute)


RUNNING: list = []       # the job under way: a SIGTERM (gpu-check.sh's time limit) ends it with this script


def _end(signum, frame):
    for proc in RUNNING:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:       # (it ended meanwhile)
            pass
    raise SystemExit(128 + signum)


def launch(args, devices: list, out: Path, timeout: float) -> dict:
    """One `dbs-mpi train` job of len(devices) ranks: its wall seconds, and its result's
    data (None where it failed, with the error's last lines)."""
    cmd = [*shlex.split(os.environ.get("MPIRUN", "mpirun")), "-n", str(len(devices)), sys.executable, "-m",
           "dbs_mpi", "train", *COMMON, *args, "--devices", ",".join(devices), "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)        # (a timeout ends the launcher and every rank)
    RUNNING.append(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n(timed out after {timeout:.0f} s)"
    finally:
        RUNNING.remove(proc)
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"wall": wall, "data": None, "error": "\n    ".join(output.strip().splitlines()[-12:])}
    return {"wall": wall, "data": read_run(out)["data"], "error": ""}


def compare(alone: dict, mixed: dict) -> dict:
    """The figures of one repeat: the mixed job against the GPU alone."""
    a, m = np.asarray(alone["data"]["epoch/duration"]), np.asarray(mixed["data"]["epoch/duration"])
    rows = np.asarray(mixed["data"]["step/batch_sizes"])
    return {"whole": mixed["wall"] / alone["wall"], "training": float(m.sum() / a.sum()),
            "epochs": (m / a).round(3).tolist(), "largest": float((m / a).max()),
            "seconds": f"launch {mixed['wall']:.1f} s against {alone['wall']:.1f} s, training {m.sum():.2f} s "
                       f"against {a.sum():.2f} s",
            "vector": np.asarray(mixed["data"]["epoch/batch_sizes"])[-1].tolist(),
            "took part": (rows[:, 1:] > 0).sum(axis=0).tolist(), "steps": len(rows)}


def jobs(name: str, a: argparse.Namespace) -> tuple[str, list, list, list]:
    """(the GPU alone's key, its options, the mixed job's options, its devices)."""
    cpus = ["cpu"] * (1 if name == "pair" else a.cpu_ranks)
    data = (RESNET if name == "resnet20" else LENET) + (["--data-dir", a.data_dir] if a.data_dir else [])
    alone, mixed = data + ["--strategy", "ssgd"], data + ["--strategy", a.strategy]
    if name == "pays":     # (speeds are relative to the fastest rank's: alone, the GPU's is a slow-down)
        alone += ["--slow-rank", "0", "--slow-factor", str(1.0 / a.gpu_speed), "--slow-steps", "0,1000000"]
        mixed += ["--speeds", ",".join([str(a.gpu_speed)] + ["1"] * len(cpus))]
    key = "resnet20" if name == "resnet20" else "pays" if name == "pays" else "lenet5"
    return key, alone, mixed, [a.gpu] + cpus


def repeat(names: list, a: argparse.Namespace, folder: Path, index: int) -> dict:
    """Every case once: name -> its figures, or the errors of its failed launches."""
    alone_runs, results = {}, {}
    for name in names:
        key, alone, mixed, devices = jobs(name, a)
        if key not in alone_runs:
            alone_runs[key] = launch(alone, devices[:1], folder / f"{key}-alone-{index}.h5", a.timeout)
        runs = {"alone": alone_runs[key],
                "mixed": launch(mixed, devices, folder / f"{name}-mixed-{index}.h5", a.timeout)}
        failed = [f"{which}: {run['error']}" for which, run in runs.items() if run["data"] is None]
        results[name] = "\n  ".join(failed) if failed else compare(runs["alone"], runs["mixed"])
        report(f"{name}, repeat {index + 1}", [results[name]])    # (at once: a time limit may end the script)
    return results


def report(name: str, results: list) -> None:
    done = [r for r in results if isinstance(r, dict)]
    for r in results:
        if not isinstance(r, dict):
            print(f"{name}: failed:\n  {r}")
    if not done:
        return

    def median(key):
        values = [r[key] for r in done]
        return f"{statistics.median(values):.3f} ({', '.join(f'{v:.3f}' for v in values)})"
    print(f"{name}: over the GPU alone, whole run {median('whole')}, training {median('training')}, "
          f"largest epoch {median('largest')}")
    for r in done:
        print(f"  epochs {r['epochs']}; {r['seconds']}; last vector {r['vector']}; "
              f"CPU ranks took part in {r['took part']} of {r['steps']} steps")
    sys.stdout.flush()


def main() -> int:
    signal.signal(signal.SIGTERM, _end)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cpu-ranks", type=int, default=7)
    p.add_argument("--gpu", default="cuda", help="the GPU rank's device (cpu: a smoke test)")
    p.add_argument("--gpu-speed", type=float, default=0.1, help="pays: the GPU rank's emulated speed")
    p.add_argument("--strategy", default="dbs")
    p.add_argument("--data-dir", default="")
    p.add_argument("--out-dir", default="", help="keep the result files here (default: removed)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds a launch may take")
    a = p.parse_args()
    names = a.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown or a.repeats < 1:
        print(f"gpu-mixed: unknown case(s) {unknown} (of {', '.join(CASES)}), or --repeats below 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.out_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        results = [repeat(names, a, folder, i) for i in range(a.repeats)]
    if a.repeats > 1:
        print("medians over the repeats:")
        for name in names:
            report(name, [r[name] for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
