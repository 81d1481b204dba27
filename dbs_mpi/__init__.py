"""dbs-mpi: heterogeneity-aware data-parallel training of PyTorch models over MPI.

The library API (docs/api.md), for any PyTorch training script:

    comm = dbs_mpi.init()                                   # COMM_WORLD, fail together, threads
    balancer = dbs_mpi.Balancer(comm, global_batch=512, policy="dbs")
    sampler = dbs_mpi.HeteroSampler(train_set, balancer, seed=0)
    loader = DataLoader(train_set, batch_sampler=sampler, num_workers=2)
    dbs_mpi.broadcast_parameters(model, comm)
    balancer.calibrate_model(model, loss_fn, train_set)     # static, dbs: sizes b_i from speed
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model, balancer)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step(loss=loss)
        stats = balancer.end_epoch()                        # the epoch's times (dbs re-planned within it)

Where each idea of the papers lives:
  allocation.py     batch-size vectors from measured speed
  dynamic.py        dynamic batch size: step-time estimate, within-epoch planner, per-epoch rule
  balancer.py       the vector of a policy (ssgd, static, dbs), calibration, epoch timing
  sharding.py       uneven shards with equal step counts; HeteroSampler; allocation invariance
  optimizer.py      DistributedOptimizer: sample-weighted gradients, weighted or mean
  sync_batchnorm.py BatchNorm over the global batch, with the sample-weighted backward
  exchange.py       the bucketed sample-weighted allreduce of every step
  comm.py           bounded, non-spinning waits and collectives, failing together, init()
  startup.py        a bounded start-up: the watchdog process that ends a stalled launch
  devices.py        each rank's device (CPU or GPU), thread shares, a clock true on GPUs
  transport.py      how buckets are summed: host-staged MPI, CUDA-aware MPI, NCCL, gloo
  ddp.py            the same weighting for DistributedDataParallel (a comm hook)
  process_group.py  torch.distributed over the ranks of an MPI communicator
  profiling.py      compute / communication / wait times; the calibration's clock
  heterogeneity.py  emulated speeds and disturbances
  results.py        the HDF5 result file (RunWriter, Recorder)
  checkpoint.py     checkpoints (weights_only), stop requests (SIGTERM/SIGUSR1)
  evaluation.py     test loss and accuracy over all ranks
  parameter_server/    asgd, n-softsync, dbs-sgd on an MPI parameter server: protocol.py,
                       update.py (the update rule), records.py, snapshot.py, server.py,
                       worker.py, trainer.py
  data.py, models.py   datasets and models (no MPI);  plugins.py  the user's model, data, loss
  train.py          `dbs-mpi train`;  cli.py  the `dbs-mpi` command;  bench.py, bench_tracking.py  benchmarks
  experiments.py    the experiment grid;  analysis.py  result files -> pandas tables
"""
__version__ = "0.2.0"

import os as _os

# The cores this process was given, read before torch is imported: with OMP_PROC_BIND
# set, OpenMP pins the main thread to its first core when torch loads (comm.affinity).
try:
    _AFFINITY_AT_IMPORT = frozenset(_os.sched_getaffinity(0))
except AttributeError:  # pragma: no cover - not Linux
    _AFFINITY_AT_IMPORT = frozenset()

# The public API, imported on first use (so that `import dbs_mpi.tools.config` stays light and
# nothing initialises MPI before it is needed).
_API = {
    "init": "comm", "broadcast_parameters": "comm", "AgreedError": "comm",
    "Balancer": "balancer", "EpochStats": "balancer", "Change": "balancer",
    "HeteroSampler": "sharding",
    "DistributedOptimizer": "optimizer",
    "SyncBatchNorm": "sync_batchnorm", "convert_sync_batchnorm": "sync_batchnorm",
    "Recorder": "results",
    "evaluate": "evaluation",
    "StopRequest": "checkpoint", "Stopped": "checkpoint", "EXIT_STOPPED": "checkpoint",
    "Emulator": "heterogeneity",
    "UserError": "config",
    "select_device": "devices",
    "sample_weighted": "ddp", "sample_weighted_hook": "ddp", "SampleWeightedState": "ddp",
    "init_process_group": "process_group",
}
__all__ = sorted([*_API, "save_checkpoint", "load_checkpoint"])


def __getattr__(name):
    if name in ("save_checkpoint", "load_checkpoint"):
        from .training import checkpoint
        return checkpoint.save if name == "save_checkpoint" else checkpoint.load
    if name == "ddp":
        import importlib
        return importlib.import_module(".ddp", __name__)
    if name in _API:
        import importlib
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module 'dbs_mpi' has no attribute {name!r}")
