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

The layers, bottom up (each imports only from the layers below it; tests/test_layout.py
checks that):
  about.py          the version, the cores the process had when dbs_mpi was imported
  options.py        UserError, and the choices the lower layers check themselves
  planning/         pure planning, no MPI: what a rank should do, from numbers
    allocation.py     batch-size vectors from measured speed
    participation.py  which ranks take part: a rank that would slow every step sits out
    dynamic/          dynamic batch size: estimate.py, within_epoch.py (the planner), per_epoch.py
    noise_scale.py    the gradient noise scale, from the uneven local batches' gradient norms
    goodput.py        the global batch with the most progress per second; the lr's scaling with it
    sharding.py       uneven shards with equal step counts; HeteroSampler; allocation invariance
    heterogeneity.py  emulated speeds and disturbances
    schedule.py       learning-rate schedules over the run's steps
  mpi/              the ranks and the machine: nothing here knows about training
    startup.py        a bounded start-up: the watchdog process that ends a stalled launch
    waits.py          bounded, non-spinning waits (CommTimeout), the wait policies
    collectives.py    bounded collectives: barrier, sums, gathers, broadcasts
    supervisor.py     failing together: the watchdog, rank 0 records the failure, abort
    agreement.py      set-up steps that fail on every rank together (AgreedError)
    placement.py      where ranks run: hosts, cores, oversubscription, threads per rank
    host_memory.py    glibc's malloc keeps a step's freed memory for the next step
    cached.py         what a communicator's ranks agreed once, kept on the communicator
    comm.py           init() and start(): the communicator, the fail-together hook
    devices.py        each rank's device (CPU or GPU), thread shares, a clock true on GPUs
    process_group.py  torch.distributed over the ranks of an MPI communicator
    transport.py      how buckets are summed: host-staged MPI, CUDA-aware MPI, NCCL, gloo
  training/         the library a training script uses
    batches.py        the in-memory dataset, its fast loader, the augmentation
    device_data.py    the in-memory dataset in a GPU's memory: what fits, refusals
    profiling.py      compute / communication / wait times; the calibration's clock
    step_clock.py     a step's phase clocks (data, compute, collective, update), late on GPUs
    balancer.py       the vector of a policy (ssgd, static, dbs), calibration, epoch timing
    exchange.py       the bucketed sample-weighted allreduce of every step
    participants.py   ranks that sit out: out of the gradient's sum, then caught up from rank 0
    gradient_noise.py the gradient noise scale measured as training runs (its norms ride the step)
    global_batch.py   global_batch="auto": the next epoch's B by goodput, the lr scaled with it
    optimizer.py      DistributedOptimizer: sample-weighted gradients, weighted or mean; the step's plan
    accumulation.py   micro-batches, each weighted by its share of the local batch
    clipping.py       clipping the global gradient; a warning where the local one was changed
    named_optimizers.py  the command line's optimizers (torch's, without the dynamo wrappers)
    sample_dropout.py dropout keyed by sample: the same masks at any vector
    sync_batchnorm.py BatchNorm over the global batch, with the sample-weighted backward
    ddp.py            the same weighting for DistributedDataParallel (a comm hook)
    evaluation.py     test loss and accuracy over all ranks
    checkpoint.py     checkpoints (weights_only), stop requests (SIGTERM/SIGUSR1)
    event_clock.py, loss_scaling.py  CUDA events read late; GradScaler after the exchange
    results.py        the HDF5 result file (RunWriter, Recorder)
  parameter_server/ asgd, n-softsync, dbs-sgd on an MPI parameter server: groups.py (the
                    gradients per update), protocol.py, update.py (the update rule),
                    records.py, snapshot.py, work.py (the samples handed out: the Cursor),
                    server.py, worker.py, trainer.py
  tools/            what is built on the library: the command and the research around it
    config.py         the job's options;  cli.py  the `dbs-mpi` command;  train.py  `dbs-mpi train`
    data.py, models.py  built-in datasets and models;  plugins.py  the user's model, data, loss
    bench/, bench_tracking.py  benchmarks;  experiments.py  the experiment grid
    analysis.py       result files -> pandas tables
    simulator/, machine.py  the cluster simulator and its measured machine constants
"""
from .about import __version__  # noqa: F401 (first: it reads the cores before torch loads)

# The public API, imported on first use (so that `import dbs_mpi.tools.config` stays light and
# nothing initialises MPI before it is needed).
_API = {
    "init": "mpi.comm", "broadcast_parameters": "mpi.collectives", "AgreedError": "mpi.agreement",
    "Balancer": "training.balancer", "EpochStats": "training.balancer", "Change": "training.balancer",
    "HeteroSampler": "planning.sharding", "InMemoryLoader": "training.batches",
    "data_on_device": "training.device_data",
    "DistributedOptimizer": "training.optimizer", "clip_grad_norm_": "training.clipping",
    "SyncBatchNorm": "training.sync_batchnorm", "convert_sync_batchnorm": "training.sync_batchnorm",
    "SampleDropout": "training.sample_dropout", "convert_dropout": "training.sample_dropout",
    "Recorder": "training.results", "read_run": "training.results",
    "evaluate": "training.evaluation",
    "StopRequest": "training.checkpoint", "Stopped": "training.checkpoint", "EXIT_STOPPED": "training.checkpoint",
    "Emulator": "planning.heterogeneity",
    "UserError": "options",
    "select_device": "mpi.devices",
    "sample_weighted": "training.ddp", "sample_weighted_hook": "training.ddp", "SampleWeightedState": "training.ddp",
    "init_process_group": "mpi.process_group", "destroy_process_group": "mpi.process_group",
}
__all__ = sorted([*_API, "save_checkpoint", "load_checkpoint"])


def __getattr__(name):
    if name in ("save_checkpoint", "load_checkpoint"):
        from .training import checkpoint
        return checkpoint.save if name == "save_checkpoint" else checkpoint.load
    if name == "ddp":                    # the name the README used up to 0.4.0; one name now, the flat one
        raise AttributeError("module 'dbs_mpi' has no attribute 'ddp': its functions are dbs_mpi.sample_weighted, "
                             "dbs_mpi.init_process_group and dbs_mpi.destroy_process_group")
    if name in _API:
        import importlib
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module 'dbs_mpi' has no attribute {name!r}")
