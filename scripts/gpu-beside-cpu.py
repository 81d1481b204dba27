"""Why a GPU rank computes slower beside CPU ranks (docs/performance.md, "GPU figures"): its training
step alone and beside CPU processes that train as a mixed job's CPU ranks do.

The GPU process runs a plain PyTorch loop (LeNet-5 or ResNet-20, CUDA events around each
step, median over the steps after a warm-up); beside it, K worker processes train the
same model on the CPU with T torch threads each, for as long as the GPU is timed. One
line per condition: the GPU's median step, its samples/s and the ratio to alone.

    python scripts/gpu-beside-cpu.py [--model lenet5] [--batch 512] [--workers 7] [--threads 2]

Conditions: alone; beside K workers of T threads (what `mpirun -n 8` with one GPU gives
on a 16-core node); beside K workers of 1 thread; beside K workers of T threads with the
GPU process on a core of its own (and that core's SMT sibling) and the workers on the
rest; beside K processes that only spin (no memory traffic: busy cores alone).
No MPI: the question is what the node's cores do to the GPU rank's host thread.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import os, sys, torch, torch.nn.functional as F
cores, threads, model_name, spin = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
if cores:
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
torch.set_num_threads(threads)
sys.path.insert(0, os.getcwd())
from dbs_mpi.tools.models import build_model
print("ready", flush=True)
if spin:
    while True:
        pass
shape = (1, 28, 28) if model_name == "lenet5" else (3, 32, 32)
model = build_model(model_name, shape, 10)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, *shape), torch.randint(10, (32,))
while True:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
"""

GPU = r"""
import json, os, statistics, sys
cores, model_name, batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if cores:
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
import torch, torch.nn.functional as F
torch.set_num_threads(1)
sys.path.insert(0, os.getcwd())
from dbs_mpi.tools.models import build_model
shape = (1, 28, 28) if model_name == "lenet5" else (3, 32, 32)
model = build_model(model_name, shape, 10).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(batch, *shape).pin_memory(), torch.randint(10, (batch,)).pin_memory()
times = []
for i in range(steps + 20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    xs, ys = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    start.record()
    opt.zero_grad()
    loss = F.cross_entropy(model(xs), ys)
    loss.backward()
    opt.step()
    end.record()
    loss.item()
    if i >= 20:
        times.append(start.elapsed_time(end) / 1e3)
print(json.dumps({"median": statistics.median(times)}))
"""


def siblings(cpu: int) -> set:
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        text = open(path).read().strip()
    except OSError:
        return {cpu}
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def measure(args, workers: int, threads: int, own_core: bool, spin: bool) -> float:
    cpus = sorted(os.sched_getaffinity(0))
    gpu_cores = siblings(cpus[0]) if own_core else set()
    worker_cores = ",".join(str(c) for c in cpus if c not in gpu_cores) if own_core else ""
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, worker_cores, str(threads), args.model, "1" if spin else "0"],
                              stdout=subprocess.PIPE, text=True) for _ in range(workers)]
    try:
        for p in procs:
            p.stdout.readline()
        time.sleep(1.0)                                   # the workers are computing
        out = subprocess.run([sys.executable, "-c", GPU, ",".join(map(str, sorted(gpu_cores))), args.model,
                              str(args.batch), str(args.steps)], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise SystemExit(out.stderr)
        return json.loads(out.stdout.strip().splitlines()[-1])["median"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lenet5", choices=("lenet5", "resnet20"))
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"{len(cpus)} cores, SMT siblings of core {cpus[0]}: {sorted(siblings(cpus[0]))}; {args.model}, batch "
          f"{args.batch}, {args.steps} timed steps")
    k, t = args.workers, args.threads
    conditions = [("alone", 0, t, False, False),
                  (f"beside {k} CPU trainers x {t} threads", k, t, False, False),
                  (f"beside {k} CPU trainers x 1 thread", k, 1, False, False),
                  (f"beside {k} CPU trainers x {t} threads, GPU process on its own core", k, t, True, False),
                  (f"beside {k} spinning processes", k, 1, False, True)]
    alone = None
    for name, workers, threads, own, spin in conditions:
        step = measure(args, workers, threads, own, spin)
        alone = alone or step
        print(f"{name:<62} step {1e3 * step:7.3f} ms  {args.batch / step:>10,.0f} samples/s  "
              f"x{step / alone:.2f} of alone", flush=True)


if __name__ == "__main__":
    main()
