"""A user's training loop that survives its scheduler: checkpoints, SIGTERM/SIGUSR1, resume.

    mpirun -n 2 python examples/train_resumable.py --checkpoint results/run.ckpt   # SIGTERM: exit 3
    mpirun -n 2 python examples/train_resumable.py --checkpoint results/run.ckpt   # continues there

The loop of examples/train_api.py plus what a batch job needs: a checkpoint after every
epoch, and on SIGTERM or SIGUSR1 (what Slurm sends before a time limit) all ranks agree
to stop after the same step, write a checkpoint and exit with status 3. Started again
with the same checkpoint path, it continues from that step; with the ssgd policy the
final model is the one an uninterrupted run ends with, bit for bit, and so with static,
which keeps the vector it calibrated at the first start (a run started separately
calibrates a vector of its own: the two then agree up to float rounding without dropout,
and are another model with torch's Dropout, whose masks follow the vector; see
docs/reliability.md, "Reproducibility: what holds").

Started again on another number of ranks (the requeued job got another allocation), it
continues the same run: the model, the optimizer and the position are the same for any
world; each rank's balancer takes the position from rank 0's part (a state saved by
another world gives nothing per rank) and the new ranks are calibrated. The parameters
at the end equal the uninterrupted run's up to float rounding (the vector, hence the
order of summation, differs; with dropout, where it is keyed by sample: convert_dropout).

    mpirun -n 3 python examples/train_resumable.py --checkpoint results/run.ckpt   # 2 ranks wrote it
"""
import argparse
import os

import torch
from torch.utils.data import DataLoader

import dbs_mpi
from dbs_mpi.training.named_optimizers import SGD
from my_project import SmallNet, Squares

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--checkpoint", required=True, help="checkpoint file: read if it exists, then rewritten")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--samples", type=int, default=8192, help="training samples")
parser.add_argument("--global-batch", type=int, default=128)
parser.add_argument("--policy", default="ssgd", choices=["ssgd", "static", "dbs"])
parser.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank")
args = parser.parse_args()

comm = dbs_mpi.init()
rank = comm.Get_rank()
torch.manual_seed(0)
train_set = Squares("train", size=args.samples)
model, loss_fn = SmallNet(), torch.nn.CrossEntropyLoss()
dbs_mpi.broadcast_parameters(model, comm)
balancer = dbs_mpi.Balancer(comm, args.global_batch, policy=args.policy)
sampler = dbs_mpi.HeteroSampler(train_set, balancer, seed=0)
loader = DataLoader(train_set, batch_sampler=sampler, num_workers=args.workers)
# torch's SGD without the wrappers that load torch._dynamo (a second of CPU per rank at
# every start: a job that is requeued starts often; docs/api.md, "Start-up")
optimizer = dbs_mpi.DistributedOptimizer(SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                         balancer)

if os.path.exists(args.checkpoint):              # every component restores its own state
    state = dbs_mpi.load_checkpoint(args.checkpoint)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    parts = state["per_rank"]                    # one per rank of the world that wrote it
    same_world = len(parts) == comm.Get_size()
    balancer.load_state_dict(parts[rank if same_world else 0]["balancer"])
    if same_world:
        torch.set_rng_state(parts[rank]["rng"])
    elif args.policy != "ssgd":                  # another allocation: time the new ranks
        balancer.calibrate_model(model, loss_fn, train_set)
elif args.policy != "ssgd":
    balancer.calibrate_model(model, loss_fn, train_set)


def save_checkpoint():
    """Collective: rank 0 writes one file (atomically) with every rank's own part."""
    dbs_mpi.save_checkpoint(comm, args.checkpoint,
                            {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "sampler": sampler.state_dict()},
                            {"balancer": balancer.state_dict(), "rng": torch.get_rng_state()})


with dbs_mpi.StopRequest(comm) as stop:          # SIGTERM / SIGUSR1 set a flag; no rank dies alone
    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step(loss=loss)
            if stop.agreed():                    # every rank gets the same answer at the same step
                save_checkpoint()
                if rank == 0:
                    print(f"stopped at {sampler.state_dict()}: checkpoint {args.checkpoint}", flush=True)
                raise SystemExit(dbs_mpi.EXIT_STOPPED)
        stats = balancer.end_epoch()
        save_checkpoint()
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {stats.train_loss:.4f}  time {stats.duration:.2f} s", flush=True)
