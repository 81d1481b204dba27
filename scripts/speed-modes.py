"""Does this machine change speed on its own? A plain PyTorch loop, nothing of dbs-mpi's
in it but the model, timed step by step.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/speed-modes.py [--steps 600] [--every 20]

LeNet-5 on random 28x28 images, 512 a step, SGD with momentum, one thread: the median
step time of every `--every` steps, and how the fastest and slowest of those medians
compare. On a steady machine they agree within a few percent; the development VM
switched between two speeds about 1.4x apart every few tens of seconds, in this loop
as in training, with nothing else running. Benchmarks on such a machine need repeats
side by side (medians of ratios), and a replay calibrated in one speed is off by the
ratio in the other.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dbs_mpi.tools.models import build_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--batch", type=int, default=512)
    args = p.parse_args()
    if args.steps < 2 * args.every or args.every < 1 or args.batch < 1:
        raise SystemExit("speed-modes: --steps must be at least twice --every, both and --batch positive")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("lenet5", (1, 28, 28), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8192, 1, 28, 28), torch.randint(0, 10, (8192,))
    times = []
    for _ in range(args.steps):
        i = torch.randint(0, len(x), (args.batch,))
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    medians = [statistics.median(times[k:k + args.every]) * 1e3 for k in range(args.every, args.steps, args.every)]
    print(f"median ms of every {args.every} steps (the first {args.every} left out):")
    print(" ".join(f"{m:.0f}" for m in medians))
    print(f"slowest / fastest: {max(medians) / min(medians):.2f}")


if __name__ == "__main__":
    main()
