#!/usr/bin/env python
"""What a checkpoint every epoch costs: the same run with `--checkpoint-every 1` and
`--checkpoint-every 0` (only the final checkpoint), side by side, alternating, median
over --repeats. Reports the training time (sum of epoch durations: for the
asynchronous strategies it includes the drains before each checkpoint) and the seconds
rank 0 spent writing checkpoints (`checkpoint/seconds`; outside the epoch durations).

    .venv/bin/python scripts/checkpoint-overhead.py --strategies ssgd asgd --repeats 3
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from dbs_mpi.training.results import read_run


def run(mpirun, ranks, strategy, every, args, folder, i):
    out = os.path.join(folder, f"{strategy}-{every}-{i}.h5")
    cmd = [mpirun, "-n", str(ranks), sys.executable, "-m", "dbs_mpi", "train", "--strategy", strategy,
           "--checkpoint-every", str(every), "--out", out, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    d = read_run(out)["data"]
    return float(d["epoch/duration"].sum()), float(d["checkpoint/seconds"].sum()), len(d["checkpoint/seconds"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="+", default=["ssgd", "asgd"])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mpirun", default=os.path.join(os.path.dirname(sys.executable), "mpirun"))
    p.add_argument("--data-dir", default="data")
    p.add_argument("train_args", nargs="*", help="more `dbs-mpi train` options (after --)")
    a = p.parse_args()
    args = ["--dataset", "fashion-mnist", "--data-dir", a.data_dir, "--model", "lenet5", "--epochs", "3",
            "--global-batch", "512", "--speeds", ",".join(["1"] * (a.ranks - 2) + ["0.5", "0.25"]), *a.train_args]
    print(f"{a.ranks} ranks, {' '.join(args)}")
    print(f"{'strategy':<10} {'train s, every epoch':>21} {'train s, at end':>16} {'ratio':>6} "
          f"{'ckpt writes':>11} {'write s / train s':>18}")
    with tempfile.TemporaryDirectory() as folder:
        for strategy in a.strategies:
            every, end, ratios, shares, writes = [], [], [], [], 0
            for i in range(a.repeats):
                t1, w1, n1 = run(a.mpirun, a.ranks, strategy, 1, args, folder, i)
                t0, _, _ = run(a.mpirun, a.ranks, strategy, 0, args, folder, i)
                every.append(t1), end.append(t0), ratios.append(t1 / t0), shares.append(w1 / t1)
                writes = n1
            print(f"{strategy:<10} {statistics.median(every):>21.2f} {statistics.median(end):>16.2f} "
                  f"{statistics.median(ratios):>6.3f} {writes:>11} {100 * statistics.median(shares):>17.2f}%   "
                  f"ratios {' '.join(f'{r:.3f}' for r in ratios)}", flush=True)
    print(f"medians of {a.repeats} pairs; oversubscribed if more ranks than cores ({os.cpu_count()})")


if __name__ == "__main__":
    main()
