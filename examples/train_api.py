"""Your model, your data, your loop: dbs-mpi's library API in a plain PyTorch script.

    mpirun -n 2 python examples/train_api.py --speeds 1,0.5 --out results/example.h5

The user's SmallNet on the user's Squares dataset (examples/my_project.py), read by a
DataLoader with worker processes, trained with AdamW under the `dbs` policy: each rank's
local batch follows its measured speed (here emulated: rank 1 computes at half speed)
and is re-planned after every epoch; gradients are combined sample-weighted.
"""
import argparse

import torch
from torch.utils.data import DataLoader

import dbs_mpi
from my_project import SmallNet, Squares

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--global-batch", type=int, default=256, help="samples per step over all ranks")
parser.add_argument("--speeds", default="", help="emulated relative speed per rank, e.g. 1,0.5")
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
parser.add_argument("--out", default="results/example.h5", help="HDF5 result file (must not exist)")
parser.add_argument("--device", default="auto", help="auto (a node's GPUs by local rank, then CPU) | cpu | cuda | cuda:N")
args = parser.parse_args()

comm = dbs_mpi.init()                       # MPI.COMM_WORLD; one process without mpirun works too
device = dbs_mpi.select_device(comm, args.device)
torch.manual_seed(0)
train_set, test_set = Squares("train"), Squares("test")
model, loss_fn = SmallNet(len(Squares.classes)).to(device), torch.nn.CrossEntropyLoss()
dbs_mpi.broadcast_parameters(model, comm)

speeds = [float(s) for s in args.speeds.split(",")] if args.speeds else None
balancer = dbs_mpi.Balancer(comm, args.global_batch, policy="dbs", speeds=speeds)
balancer.calibrate_model(model, loss_fn, train_set)     # times every rank: fast ranks get more
sampler = dbs_mpi.HeteroSampler(train_set, balancer, seed=0)
loader = DataLoader(train_set, batch_sampler=sampler, num_workers=args.workers,
                    persistent_workers=args.workers > 0, pin_memory=device.type == "cuda")
optimizer = dbs_mpi.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=2e-3), model, balancer)

with dbs_mpi.Recorder(comm, args.out, config=vars(args)) as recorder:
    recorder.startup(balancer)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step(loss=loss)       # sample-weighted allreduce, then AdamW
        stats = balancer.end_epoch()        # gathers every rank's times; dbs re-plans
        test_loss, accuracy = dbs_mpi.evaluate(comm, model, test_set, loss_fn)
        recorder.epoch(stats, test_loss=test_loss, test_accuracy=accuracy)
        if comm.Get_rank() == 0:
            print(f"epoch {epoch + 1}: train loss {stats.train_loss:.4f}  test loss {test_loss:.4f}  "
                  f"accuracy {100 * accuracy:.1f}%  time {stats.duration:.2f} s  "
                  f"local batches {stats.batch_sizes.tolist()} -> {stats.next_batch_sizes.tolist()}", flush=True)
if comm.Get_rank() == 0:
    print(f"results: {args.out}")
