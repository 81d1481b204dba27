"""The optimizer's update alone, per tensor, foreach and fused, for the project's models
(docs/performance.md, "Where a step's host time goes"; named_optimizers.fused).

    python scripts/optimizer-update.py [--models lenet5,resnet20,mlp] [--device cpu] [--updates 300]

Each line: a model and an optimizer (SGD with momentum and weight decay, AdamW), the
microseconds of one `step()` on random gradients with torch's three implementations,
medians of 5 runs of `--updates` steps each after 20 to warm up; one torch thread. An
implementation this torch lacks for the device is named with the error it gave.
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
from dbs_mpi.training import named_optimizers  # noqa: E402

SHAPES = {"resnet20": (3, 32, 32), "cifar-cnn": (3, 32, 32)}      # the others: 1x28x28
OPTIMIZERS = {"SGD": (named_optimizers.SGD, dict(lr=0.05, momentum=0.9, weight_decay=5e-4)),
              "AdamW": (named_optimizers.AdamW, dict(lr=1e-3, weight_decay=1e-2))}
KINDS = {"per tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def update_time(model: str, device: str, cls, options: dict, updates: int) -> float:
    """Microseconds of one step() of `cls` on `model`'s parameters, median of 5 runs."""
    torch.manual_seed(0)
    params = list(build_model(model, SHAPES.get(model, (1, 28, 28)), 10).to(device).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    optimizer = cls(params, **options)
    for _ in range(20):
        optimizer.step()
    runs = []
    for _ in range(5):
        torch.cuda.synchronize() if device == "cuda" else None
        start = time.perf_counter()
        for _ in range(updates):
            optimizer.step()
        torch.cuda.synchronize() if device == "cuda" else None
        runs.append((time.perf_counter() - start) / updates * 1e6)
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="lenet5,resnet20,mlp")
    p.add_argument("--device", default="cpu")
    p.add_argument("--updates", type=int, default=300)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"optimizer-update: torch {torch.__version__}, device {a.device}, us a step (median of 5 x {a.updates})")
    for model in a.models.split(","):
        for name, (cls, options) in OPTIMIZERS.items():
            cells = []
            for kind, flags in KINDS.items():
                try:
                    cells.append(f"{kind} {update_time(model, a.device, cls, {**options, **flags}, a.updates):8.1f}")
                except (TypeError, RuntimeError) as error:
                    cells.append(f"{kind}: {type(error).__name__}")
            print(f"{model:9s} {name:6s} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
