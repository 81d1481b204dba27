"""Final test accuracy of ResNet-20 under dbs with uneven speeds, by normalisation:
BatchNorm synchronised over the global batch (--sync-bn), plain BatchNorm (each rank
normalises over its own local batch), and GroupNorm (the default), over several seeds.

    .venv/bin/python scripts/batchnorm-accuracy.py --seeds 0,1,2 --np 2

Each run is one `dbs-mpi train` launch (bounded by --timeout); result files go to --out.
Prints one line per run and the median accuracy per variant."""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dbs_mpi.training.results import read_run  # noqa: E402

VARIANTS = {"batch, sync": ["--norm", "batch", "--sync-bn"], "batch": ["--norm", "batch"], "group": ["--norm", "group"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--speeds", default="1,0.25")
    p.add_argument("--mpiexec", default=str(ROOT / ".venv" / "bin" / "mpirun"))
    p.add_argument("--out", default="results/batchnorm")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("train_args", nargs="*", default=[], help="more `dbs-mpi train` options (after --)")
    args = p.parse_args()
    common = ["--model", "resnet20", "--dataset", "fashion-mnist", "--subset", "4000", "--test-subset", "2000",
              "--epochs", "3", "--global-batch", "128", "--strategy", "dbs", "--speeds", args.speeds,
              "--progress", "false", *args.train_args]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    accuracy = {v: [] for v in VARIANTS}
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        for variant, options in VARIANTS.items():
            path = out / f"{variant.replace(', ', '-')}-{seed}.h5"
            path.unlink(missing_ok=True)
            Path(str(path) + ".ckpt").unlink(missing_ok=True)      # (a new run never overwrites a checkpoint)
            cmd = [args.mpiexec, "-n", str(args.np), sys.executable, "-m", "dbs_mpi", "train", *common, *options,
                   "--seed", str(seed), "--out", str(path)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            run = read_run(path)
            acc = float(run["data"]["epoch/test_accuracy"][-1])
            vector = run["data"]["epoch/batch_sizes"][-1].tolist()
            accuracy[variant].append(acc)
            print(f"seed {seed}  {variant:<12} test accuracy {acc:.4f}  last epoch's vector {vector}", flush=True)
    print()
    for variant, values in accuracy.items():
        print(f"{variant:<12} median {statistics.median(values):.4f}  (seeds: {', '.join(f'{a:.4f}' for a in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
