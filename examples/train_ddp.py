"""Your DistributedDataParallel loop, with uneven local batches and the right gradient.

    mpirun -n 2 python examples/train_ddp.py --speeds 1,0.5

PyTorch DDP averages the ranks' gradients, (1/n) sum_i g_i: with local batches of
different sizes that is not the gradient of the global batch. One line,
`dbs_mpi.sample_weighted(model, balancer=balancer)`, registers a DDP communication hook
that reduces sum_i (b_i / B) g_i instead; the rest is an ordinary DDP script. The
process group comes from the MPI communicator (NCCL on GPUs, gloo on CPUs), the local
batches from the dbs policy (each rank's share follows its measured speed, here
emulated: rank 1 computes at half speed).
"""
import argparse

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import dbs_mpi
from my_project import SmallNet, Squares

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--global-batch", type=int, default=256, help="samples per step over all ranks")
parser.add_argument("--speeds", default="", help="emulated relative speed per rank, e.g. 1,0.5")
parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
args = parser.parse_args()

comm = dbs_mpi.init()
device = dbs_mpi.select_device(comm, args.device)
dbs_mpi.init_process_group(comm, device=device)   # nccl if every rank has a GPU of its own, else gloo
torch.manual_seed(0)                        # the same initial weights on every rank (DDP also broadcasts them)
train_set, test_set = Squares("train"), Squares("test")
model = DistributedDataParallel(SmallNet(len(Squares.classes)).to(device),
                                device_ids=[device.index] if device.type == "cuda" else None)
loss_fn = torch.nn.CrossEntropyLoss()

speeds = [float(s) for s in args.speeds.split(",")] if args.speeds else None
balancer = dbs_mpi.Balancer(comm, args.global_batch, policy="dbs", speeds=speeds)
balancer.calibrate_model(model.module, loss_fn, train_set)
dbs_mpi.sample_weighted(model, balancer=balancer)          # sum_i (b_i / B) g_i instead of DDP's average
sampler = dbs_mpi.HeteroSampler(train_set, balancer, seed=0)
loader = DataLoader(train_set, batch_sampler=sampler, pin_memory=device.type == "cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    stats = balancer.end_epoch()            # every rank's compute times; dbs re-plans
    test_loss, accuracy = dbs_mpi.evaluate(comm, model.module, test_set, loss_fn)
    if comm.Get_rank() == 0:
        print(f"epoch {epoch + 1}: test loss {test_loss:.4f}  accuracy {100 * accuracy:.1f}%  "
              f"time {stats.duration:.2f} s  local batches {stats.batch_sizes.tolist()} -> "
              f"{stats.next_batch_sizes.tolist()}", flush=True)
dbs_mpi.destroy_process_group()
