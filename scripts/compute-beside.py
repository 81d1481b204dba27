"""A model's forward and backward timed three ways, to find what a training step's compute
costs beyond the simulator's table (issue 55; docs/simulator.md, "A machine new to the
simulator"):

    flock /work/cpu.lock .venv/bin/mpirun -n 2 .venv/bin/python scripts/compute-beside.py
    flock /work/cpu.lock .venv/bin/mpirun -n 2 .venv/bin/python scripts/compute-beside.py --loop --slow 4

Without --loop, rank 0 times LeNet-5 at each local batch alone (rank 1 sleeping), then
with rank 1 computing the same at once, then alone again: medians of 15 steps, as the
calibration's table. With --loop, both ranks run a step as training does (forward and
backward, rank 1 then sleeping (slow - 1) times its compute's CPU time as the emulator
does, an allreduce of the gradient's size, an SGD update); the compute's median wall and
CPU seconds per rank, and the mean step. One torch thread a rank.
"""
import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from dbs_mpi.planning.heterogeneity import precise_sleep
from dbs_mpi.tools.models import build_model


def forward_backward(model, x, y, b):
    model.zero_grad(set_to_none=False)
    F.cross_entropy(model(x[:b]), y[:b]).backward()


def sleeping_barrier(comm):
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


def beside(comm, model, x, y, batches, steps=15):
    for b in batches:
        for mode in ("alone", "both", "alone"):
            sleeping_barrier(comm)
            if comm.Get_rank() == 0 or mode == "both":
                times = []
                for i in range(steps + 3):
                    start = time.perf_counter()
                    forward_backward(model, x, y, b)
                    times.append(time.perf_counter() - start)
                median = statistics.median(times[3:])
            sleeping_barrier(comm)
            if comm.Get_rank() == 0:
                print(f"b={b} {mode:5s} rank 0: {median * 1e3:.2f} ms", flush=True)


def loop(comm, model, x, y, batches, slow, steps=40):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    flat = np.zeros(sum(p.numel() for p in model.parameters()), np.float32)
    total = np.zeros_like(flat)
    for b in batches:
        walls, cpus, lasted = [], [], []
        for i in range(steps + 3):
            begin, cpu = time.perf_counter(), time.process_time()
            forward_backward(model, x, y, b)
            wall, cpu = time.perf_counter() - begin, time.process_time() - cpu
            if comm.Get_rank() == 1:
                precise_sleep((slow - 1) * cpu)
            request = comm.Iallreduce(flat, total)
            while not request.Test():
                pass
            optimizer.step()
            if i >= 3:
                walls.append(wall), cpus.append(cpu), lasted.append(time.perf_counter() - begin)
        rows = comm.gather((statistics.median(walls), statistics.median(cpus), statistics.mean(lasted)))
        if comm.Get_rank() == 0:
            print(f"b={b} slow x{slow}: " + "; ".join(f"rank {r} compute {w * 1e3:.2f} ms (CPU {c * 1e3:.2f}), step "
                                                      f"{s * 1e3:.1f} ms" for r, (w, c, s) in enumerate(rows)), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="512,256,128,64", help="local batches, in this order")
    p.add_argument("--loop", action="store_true", help="time steps as training runs them")
    p.add_argument("--slow", type=float, default=4.0, help="--loop: rank 1's emulated slow-down")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    comm = MPI.COMM_WORLD
    model = build_model("lenet5", (1, 28, 28), 10)
    x, y = torch.randn(512, 1, 28, 28), torch.randint(10, (512,))
    batches = [int(b) for b in args.batches.split(",")]
    if args.loop:
        loop(comm, model, x, y, batches, args.slow)
    else:
        beside(comm, model, x, y, batches)


if __name__ == "__main__":
    main()
