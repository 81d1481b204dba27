"""`dbs-mpi train`: a configuration in, a trained model and a result file out.

`train(comm, cfg)` is library code (any communicator; the CLI passes COMM_WORLD). It
builds the run from the configuration (built-in or plug-in dataset, model and loss,
plugins.py), then trains with the synchronous loop below or, for asgd, nsoftsync and
dbs-sgd, the parameter server (parameter_server/).

The synchronous loop is a user of the public API, the same as examples/train_api.py:
a Balancer owns the batch vector, a HeteroSampler serves this rank's shard of every
step (through torch's DataLoader, or the in-memory fast path for built-in datasets), a
DistributedOptimizer owns the sample-weighted gradient exchange and the clocks, and a
Recorder writes the result file. What it adds is the operator's side: checkpoints every
few epochs and on SIGTERM/SIGUSR1 (checkpoint.py), resume, and the printed summary.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..mpi import devices, placement, startup, transport
from ..mpi.agreement import collective
from ..mpi.collectives import allgather_object, bcast_object, broadcast_parameters
from ..options import UserError
from ..parameter_server import AsyncTrainer
from ..planning import schedule
from ..planning.sharding import HeteroSampler, steps_per_epoch
from ..training import checkpoint, device_data, sync_batchnorm
from ..training.balancer import Balancer, steps_before_resume
from ..training.batches import Dataset, InMemoryLoader, first_samples, sample_shape_and_classes
from ..training.checkpoint import EXIT_STOPPED, StopRequest, Stopped
from ..training.evaluation import evaluate
from ..training.named_optimizers import make_optimizer
from ..training.optimizer import DistributedOptimizer
from ..training.results import Recorder, checkpoint_path, default_path, read_run
from ..training.sample_dropout import convert_dropout
from . import plugins
from .config import ASYNC_STRATEGIES, Config, check_world
from .data import load_dataset
from .job import scheduler_job
from .models import num_parameters


@dataclass
class RunSummary:
    path: str | None
    epochs: list = field(default_factory=list)   # one dict per epoch (rank 0's view of everything)
    model: torch.nn.Module | None = None
    oversubscribed: bool = False                  # some node ran more ranks than it has cores


@dataclass
class Run:
    """Everything a trainer needs, built by train() from the configuration."""
    comm: object
    cfg: Config
    train_set: object
    test_set: object
    model: torch.nn.Module
    loss_fn: object
    recorder: Recorder | None = None
    stop: StopRequest | None = None
    log: object = print
    summary: RunSummary | None = None
    checkpoint_path: str = ""
    state: dict | None = None                     # a checkpoint to continue from (resume)
    sleep_wait: bool = False
    device: torch.device = torch.device("cpu")    # this rank's device (devices.select)
    devices: list = field(default_factory=list)   # every rank's device, in rank order
    device_names: list = field(default_factory=list)   # ... and its name (GPU model, CPU)
    threads: list = field(default_factory=list)   # every rank's torch threads
    exchange: str = "host"                        # the gradient exchange agreed by all ranks (transport.py)
    calibration: dict | None = None               # a recorded start-up calibration to plan from (calibration_from)
    data_on_device: list = field(default_factory=list)   # every rank: its data in its GPU's memory (place_data)

    def evaluate(self) -> tuple[float, float, float]:
        """(test loss, test accuracy, seconds) of the model on the test set, all ranks together."""
        start = time.perf_counter()
        loss, accuracy = evaluate(self.comm, self.model, self.test_set, self.loss_fn,
                                  num_workers=self.cfg.loader_workers, timeout=self.cfg.comm_timeout)
        return loss, accuracy, time.perf_counter() - start


def load_data(cfg: Config):
    """(training set, test set): a built-in dataset in memory, or a plug-in's."""
    if plugins.is_spec(cfg.dataset):
        return plugins.load_dataset(cfg.dataset, "train"), plugins.load_dataset(cfg.dataset, "test")
    common = dict(seed=cfg.seed, synthetic_samples=cfg.synthetic_samples, synthetic_shape=cfg.synthetic_shape,
                  synthetic_classes=cfg.synthetic_classes)
    return (load_dataset(cfg.dataset, "train", cfg.data_dir, subset=cfg.subset, **common),
            load_dataset(cfg.dataset, "test", cfg.data_dir, subset=cfg.test_subset, **common))


def setup(comm, cfg: Config) -> Run:
    """Everything that can fail because of the user's input; run under agree (mpi/agreement.py)."""
    check_world(cfg, comm.Get_size())
    if cfg.threads and placement.thread_limit() and cfg.threads > placement.thread_limit():
        raise UserError(f"threads: {cfg.threads} is more than OMP_THREAD_LIMIT={placement.thread_limit()} in the "
                        f"environment allows (torch would hang)")
    train_set, test_set = load_data(cfg)
    if steps_per_epoch(len(train_set), cfg.global_batch, cfg.drop_last) == 0:
        raise UserError(f"global_batch: {cfg.global_batch} is larger than the {len(train_set)} training samples "
                        f"(with drop_last nothing is left)")
    shape, classes = sample_shape_and_classes(train_set, cfg.num_classes)
    if classes < 2:
        raise UserError(f"num_classes: {cfg.dataset} has no num_classes or classes attribute; set num_classes")
    if cfg.channels_last and len(shape) != 3:
        raise UserError(f"channels_last: orders images (channels, height, width); {cfg.dataset}'s samples have "
                        f"shape {tuple(shape)}")
    model = plugins.build_model(cfg.model, shape, classes, cfg.norm)
    if cfg.sync_bn and not sync_batchnorm.unsynchronised(model):
        raise UserError(f"sync_bn: the model {cfg.model} has no BatchNorm layer to synchronise"
                        + (" (resnet20: set norm = \"batch\")" if cfg.model == "resnet20" else ""))
    if cfg.sample_dropout and not any(type(m) is torch.nn.Dropout for m in model.modules()):
        raise UserError(f"sample_dropout: the model {cfg.model} has no torch.nn.Dropout layer to key by sample")
    loss_fn = plugins.build_loss(cfg.loss)
    plugins.check_loss(loss_fn, model, *first_samples(train_set, 1), cfg.loss)
    calibration = recorded_calibration(cfg.calibration_from) if cfg.calibration_from else None
    if calibration is not None and len(calibration["step_time"]) != comm.Get_size():
        raise UserError(f"calibration_from: {cfg.calibration_from} timed {len(calibration['step_time'])} rank(s); "
                        f"this job has {comm.Get_size()} (a recorded calibration is reused on a world of its size)")
    return Run(comm, cfg, train_set, test_set, model, loss_fn, calibration=calibration)


def recorded_calibration(path: str) -> dict:
    """The start-up calibration a result file recorded (startup/local_batch, step_time and,
    where recorded, alone_time, tiny_time and timed_large)."""
    if not Path(path).is_file():
        raise UserError(f"calibration_from: no result file {path}")
    try:
        data = read_run(path)["data"]
    except Exception as exc:                 # h5py raises several kinds for a foreign or damaged file
        raise UserError(f"calibration_from: {path} is not a readable result file ({type(exc).__name__})") from None
    if len(data.get("startup/step_time", ())) == 0:
        raise UserError(f"calibration_from: {path} recorded no start-up calibration (ssgd, or a resumed run's "
                        f"file: use the file of the launch that calibrated)")
    return {"local_batch": data["startup/local_batch"], "step_time": data["startup/step_time"],
            **{name: data[f"startup/{name}"] for name in ("alone_time", "tiny_time", "timed_large")
               if len(data.get(f"startup/{name}", ()))}}


def place(run: Run) -> list:
    """Collective: every rank's device, exchange and threads (in `run`), the model on the
    device with rank 0's weights. Returns every rank's (host, cores). Fails on every rank
    together, before any file exists, for a device or exchange the job cannot have."""
    comm, cfg, rank = run.comm, run.cfg, run.comm.Get_rank()
    run.device = devices.select(comm, cfg.device, server_on_cpu(cfg, comm.Get_size()), cfg.comm_timeout,
                                threads=False)
    if cfg.strategy not in ASYNC_STRATEGIES:
        run.exchange = transport.agree(comm, cfg.exchange, run.device, cfg.comm_timeout)
    described = devices.all_devices(comm, run.device, cfg.comm_timeout)
    run.devices, run.device_names = [d["device"] for d in described], [d["name"] for d in described]
    places = placement.placement(comm, cfg.comm_timeout)
    threads = placement.set_torch_threads(
        cfg.threads or devices.cpu_threads(places, run.devices, rank, placement.thread_limit()))
    run.threads = allgather_object(comm, threads, cfg.comm_timeout, "gathering every rank's threads")
    if cfg.amp == "fp16" and "cpu" in run.devices:
        cpu = [r for r, d in enumerate(run.devices) if d == "cpu"]
        collective(comm, _refuse, f"amp: fp16 needs every rank on a GPU, and rank(s) {cpu} compute on the CPU; "
                                  f"use --amp bf16", timeout=cfg.comm_timeout)
    run.model.to(run.device, memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format)
    broadcast_parameters(run.model, comm, timeout=cfg.comm_timeout)
    if cfg.sync_bn:                # BatchNorm over the global batch (setup checked there is some)
        run.model = sync_batchnorm.convert_sync_batchnorm(run.model, comm, cfg.comm_timeout)
    return places


def place_data(run: Run) -> None:
    """Collective: the training and test sets on each rank's device where
    cfg.data_on_device says so (training/device_data.py; every rank on the same GPU holds
    a copy; with loader = dataloader nothing moves); a refusal, or a copy that fails, fails
    every rank together. run.data_on_device: every rank's outcome."""
    comm, cfg = run.comm, run.cfg
    gpu = devices.gpu_identity(run.device) if run.device.type == "cuda" else None    # (host, UUID)
    gpus = allgather_object(comm, gpu, cfg.comm_timeout, "gathering every rank's GPU")
    sharing = gpus.count(gpu) if gpu else 1
    classes = sample_shape_and_classes(run.train_set, cfg.num_classes)[1]
    views = [device_data.in_memory(d, classes, cfg.dataset) for d in (run.train_set, run.test_set)]
    mode = "off" if cfg.loader == "dataloader" else cfg.data_on_device

    def place():
        if not device_data.decide(mode, run.device, views, sharing, device_data.free_memory(run.device)):
            return None
        return [device_data.to_device(v, run.device) for v in views]
    placed = collective(comm, place, timeout=cfg.comm_timeout)
    if placed is not None:
        run.train_set, run.test_set = placed
    run.data_on_device = allgather_object(comm, placed is not None, cfg.comm_timeout,
                                          "gathering where every rank's data is")


def _refuse(message: str):
    raise UserError(message)


class Precision:
    """The loop's mixed precision (cfg.amp): the forward under torch.autocast, and for
    fp16 the loss scaled by a torch.amp.GradScaler, which DistributedOptimizer unscales
    and checks after the exchange, so that every rank skips an overflowed step together."""

    DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

    def __init__(self, amp: str, device: torch.device):
        self.device_type, self.dtype = device.type, self.DTYPES.get(amp)
        self.scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None

    def autocast(self):
        """torch.autocast where a dtype is set; else nothing (a disabled autocast costs the
        step some 10 us of host time for no effect)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer, loss=None) -> None:
        """The optimizer's step (through the scaler for fp16); loss None: the one the
        micro-batches accumulated."""
        if self.scaler is None:
            optimizer.step(loss=loss)
            return
        self.scaler.step(optimizer, loss=loss)
        self.scaler.update()


def server_on_cpu(cfg: Config, world_size: int):
    """The per-rank device list: cfg's, except that a parameter server (rank 0 of the
    asynchronous strategies) keeps its weights and optimizer on the CPU."""
    if cfg.strategy not in ASYNC_STRATEGIES:
        return cfg.devices or None
    specs = devices.per_rank_specs(cfg.device, cfg.devices, world_size)
    return ["cpu"] + specs[1:]


def result_attrs(cfg: Config, run: Run, threads: int, oversubscribed: bool, places) -> dict:
    model = run.model
    return dict(rank_cores=[",".join(map(str, cores)) for _, cores in places], strategy=cfg.strategy, aggregation=cfg.aggregation, dataset=cfg.dataset, model=cfg.model,
                model_class=f"{type(model).__module__}.{type(model).__qualname__}", loss=cfg.loss or "cross-entropy",
                optimizer=cfg.optimizer, num_parameters=num_parameters(model), torch_threads=threads,
                oversubscribed=oversubscribed, sleep_while_waiting=run.sleep_wait, rank_devices=run.devices,
                device_names=run.device_names, rank_threads=run.threads, rank_data_on_device=run.data_on_device,
                **{k: v for k, v in scheduler_job(os.environ).items() if v})


def train(comm, cfg: Config, out: str | None = None, log=None, checkpoint_state: dict | None = None) -> RunSummary:
    """Train cfg's model on all ranks of comm; rank 0 writes the HDF5 result file.

    checkpoint_state (from checkpoint.load, on every rank) continues a stopped run:
    the result file `out` is continued, not rewritten. Raises SystemExit(EXIT_STOPPED)
    on every rank after a stop request (SIGUSR1: interrupted, SIGTERM: cancelled) was
    checkpointed, and
    AgreedError on every rank for a mistake in the configuration or the plug-ins."""
    rank = comm.Get_rank()
    log = log or (lambda msg: print(msg, flush=True) if rank == 0 else None)
    out = out or cfg.out or str(default_path(cfg.strategy))

    torch.manual_seed(cfg.seed)
    startup.phase("data", backstop=True)
    run = collective(comm, setup, comm, cfg, timeout=cfg.comm_timeout)
    startup.phase("devices", backstop=True)
    places = place(run)
    place_data(run)
    threads = run.threads[rank]
    oversubscribed = placement.oversubscribed(places)
    run.sleep_wait = placement.sleep_while_waiting(cfg.wait_policy, places)
    run.log, run.state = log, checkpoint_state
    run.checkpoint_path = cfg.checkpoint or str(checkpoint_path(out))
    run.summary = RunSummary(path=out if rank == 0 else None, model=run.model, oversubscribed=oversubscribed)
    # Stop requests are honoured from here on: before the result file exists on rank 0,
    # every rank has its handlers (the file is created inside a collective).
    startup.phase("results", backstop=True)
    try:
        with StopRequest(comm, cfg.comm_timeout) as stop:
            run.stop = stop
            _record(run, comm, cfg, checkpoint_state, result_attrs(cfg, run, threads, oversubscribed, places), out)
    except Stopped:                 # (the Recorder has marked the file interrupted or cancelled)
        raise SystemExit(EXIT_STOPPED) from None
    return run.summary


def _record(run, comm, cfg: Config, checkpoint_state, attrs: dict, out: str) -> None:
    """The training inside the result file's Recorder (which marks how it ended)."""
    records = checkpoint_state["records"] if checkpoint_state else None
    position = (checkpoint_state["epoch"], checkpoint_state["step"]) if checkpoint_state else None
    with Recorder(comm, out, config=cfg, attrs=attrs, resume=records, position=position,
                  timeout=cfg.comm_timeout) as recorder:
        run.recorder = recorder
        if checkpoint_state is not None:
            run.summary.epochs.extend(bcast_object(comm, recorder.writer.read_epochs() if comm.Get_rank() == 0
                                                   else None, timeout=cfg.comm_timeout))
            if resized(checkpoint_state, comm) and cfg.strategy not in ASYNC_STRATEGIES:
                recorder.append_steps(steps_before_resume([part["balancer"] for part in checkpoint_state[
                    "per_rank"]], recorder.records["epochs"]))
        Trainer = AsyncTrainer if cfg.strategy in ASYNC_STRATEGIES else SyncTrainer
        Trainer(run).train()


def resized(state: dict, comm) -> bool:
    """The checkpoint was written by another number of ranks (a resume on another allocation)."""
    return state["world_size"] != comm.Get_size()


def make_loader(run: Run, sampler: HeteroSampler):
    """The fast path for built-in datasets (and a plug-in's put on the device), torch's
    DataLoader for the others (or when cfg.loader asks for it)."""
    cfg = run.cfg
    on_device = run.data_on_device[run.comm.Get_rank()]
    if cfg.loader == "auto" and isinstance(run.train_set, Dataset) and (on_device or not plugins.is_spec(cfg.dataset)):
        return InMemoryLoader(run.train_set, sampler, augment=cfg.augment, seed=cfg.seed)
    from torch.utils.data import DataLoader
    # A generator of its own: a DataLoader without one draws its workers' base seed from the
    # global generator each time it starts them, which shifted the model's random stream
    # (dropout) after a resume; seeded by (seed, rank), the global stream is the model's alone.
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + run.comm.Get_rank())
    return DataLoader(run.train_set, batch_sampler=sampler, num_workers=cfg.loader_workers, generator=generator,
                      persistent_workers=cfg.loader_workers > 0, pin_memory=run.device.type == "cuda")


class SyncTrainer:
    """ssgd, static and dbs: the synchronous loop, with checkpoints and stop requests."""

    def __init__(self, run: Run):
        self.run, self.cfg, self.comm = run, run.cfg, run.comm

    def train(self) -> None:
        run, cfg = self.run, self.cfg
        balancer = Balancer.from_config(self.comm, cfg)
        if cfg.sample_dropout:
            convert_dropout(run.model, balancer, cfg.seed)
        sampler = HeteroSampler(run.train_set, balancer, seed=cfg.seed, drop_last=cfg.drop_last)
        loader = make_loader(run, sampler)
        self.precision = Precision(cfg.amp, run.device)      # (the calibration times the step training takes)
        balancer.sample_autocast = self.precision.dtype      # (the probes': resumed or from a file, none calibrates)
        if run.state is None:
            startup.phase("calibration", backstop=True)
            if run.calibration is not None:
                balancer.use_calibration(run.calibration)
            else:
                with self.precision.autocast():
                    balancer.calibrate_model(run.model, run.loss_fn, run.train_set, cfg.benchmark_steps,
                                             cfg.benchmark_warmup, cfg.micro_size)
            run.recorder.startup(balancer)
        optimizer = DistributedOptimizer(make_optimizer(cfg.optimizer, run.model.parameters(), cfg), run.model,
                                         balancer, aggregation=cfg.aggregation, wait_policy=cfg.wait_policy,
                                         bucket_mb=cfg.bucket_mb, first_bucket_mb=cfg.first_bucket_mb,
                                         timeout=cfg.comm_timeout, exchange=cfg.exchange,     # agreed in place()
                                         leave_exchange=cfg.amp != "fp16")    # GradScaler: every rank's gradient
        run.recorder.writer.set_attrs(exchange=optimizer.exchange.agreed)
        # (compiled: a wrapper around the model; the state dicts stay the model's)
        self.forward = torch.compile(run.model, backend=cfg.compile_backend) if cfg.compile else run.model
        self.steps_per_epoch = steps_per_epoch(len(run.train_set), cfg.global_batch, cfg.drop_last)   # (at B0)
        self.scheduler = schedule.make_scheduler(
            optimizer, cfg.lr_schedule, epochs=cfg.epochs, warmup_epochs=cfg.warmup_epochs, milestones=cfg.lr_milestones,
            gamma=cfg.lr_gamma, steps_per_epoch=self.steps_per_epoch)
        self.last_lr = optimizer.param_groups[0]["lr"]
        self.parts = dict(model=run.model, optimizer=optimizer, balancer=balancer, sampler=sampler)
        if run.state is not None:
            startup.phase("restore", backstop=True)
            self.restore(run.state)
            if resized(run.state, self.comm):     # another allocation: time the new ranks, allocate for them
                startup.phase("calibration", backstop=True)
                with self.precision.autocast():
                    balancer.calibrate_model(run.model, run.loss_fn, run.train_set, cfg.benchmark_steps,
                                             cfg.benchmark_warmup, cfg.micro_size)
                run.recorder.startup(balancer)
        startup.done()                        # the first step's waits are the training's (comm_timeout)
        for epoch in range(sampler.epoch, cfg.epochs):
            sampler.set_epoch(epoch)
            stopped = self.train_epoch(loader, optimizer, epoch)
            if stopped and balancer.step_pending:                 # stopped in the middle of the epoch
                self.save(f"epoch {epoch + 1}, step {balancer.step}", stopped)
                raise Stopped(stopped)
            stats = balancer.end_epoch()
            if len(set(run.device_names)) > 1:       # CPUs and GPUs round differently: re-align the replicas
                drift = optimizer.resync()
                run.log(f"replicas re-synchronised from rank 0 (largest difference {drift:.2e})")
            self.end_epoch(stats)
            if stopped or (cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0) \
                    or epoch + 1 == cfg.epochs:
                self.save(f"after epoch {epoch + 1}", stopped)
            if stopped and epoch + 1 < cfg.epochs:
                raise Stopped(stopped)

    def train_epoch(self, loader, optimizer, epoch: int) -> int:
        """One epoch's steps; returns the stop signal if all ranks agreed to stop after a step."""
        model, loss_fn, stop, device = self.forward, self.run.loss_fn, self.run.stop, self.run.device
        precision = self.precision
        for x, y in _progress(loader, self.cfg, epoch, self.comm.Get_rank()):
            x, y = devices.to_device((x, y), device)
            if self.cfg.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            stop.start()                  # the stop agreement overlaps the step
            optimizer.zero_grad()
            if optimizer.sits_out and precision.scaler is None:
                loss = 0.0                    # no samples: only the step's exchange, weight 0 (and 0 of the loss)
            elif self.cfg.micro_size:
                loss = self.accumulate(optimizer, x, y)
            else:
                with precision.autocast():
                    loss = loss_fn(model(x), y)
                precision.backward(loss)
            lr = optimizer.param_groups[0]["lr"] * optimizer.balancer.lr_factor     # (the step's, as applied)
            precision.step(optimizer, loss)
            self.last_lr = lr
            if self.scheduler is not None:    # (its position costs the step two numpy sums: none without one)
                schedule.step_to(self.scheduler, optimizer.balancer.schedule_position(self.steps_per_epoch))
            signal = stop.agreed()
            if signal:
                return signal
        return 0

    def accumulate(self, optimizer, x, y) -> None:
        """A step's forwards and backwards in micro-batches of cfg.micro_size samples
        (accumulation.py); returns None: step() records the loss they accumulated."""
        precision, loss_fn = self.precision, self.run.loss_fn
        for xm, ym in optimizer.micro_batches((x, y), self.cfg.micro_size):
            with precision.autocast():
                loss = loss_fn(self.forward(xm), ym)
            optimizer.backward(loss, scaler=precision.scaler)
        return None

    def end_epoch(self, stats) -> None:
        run, cfg = self.run, self.cfg
        test_loss, test_accuracy, eval_time = run.evaluate()
        record = run.recorder.epoch(stats, test_loss=test_loss, test_accuracy=test_accuracy, eval_time=eval_time,
                                    lr=self.last_lr)
        run.summary.epochs.append(record)
        run.log(f"epoch {stats.epoch + 1}/{cfg.epochs}  train loss {record['train_loss']:.4f}  test loss "
                f"{test_loss:.4f}  accuracy {100 * test_accuracy:.2f}%  time {stats.duration:.2f} s  "
                f"batch sizes {stats.batch_sizes.tolist()}{_sat_out(stats.table, int(stats.batch_sizes.sum()))}")

    def save(self, where: str, stopped: int = 0) -> None:
        """Collective: a checkpoint of the model, the optimizer and the position; every rank's
        balancer (vector, step times) and RNG in its own part."""
        p, run = self.parts, self.run
        position = p["sampler"].state_dict()
        common = {"config": self.cfg.to_dict(), "world_size": self.comm.Get_size(), "epoch": position["epoch"],
                  "step": position["step"], "model": p["model"].state_dict(), "optimizer": p["optimizer"].state_dict(),
                  "records": run.recorder.state_dict()}
        if self.precision.scaler is not None:
            common["scaler"] = self.precision.scaler.state_dict()
        if self.scheduler is not None:
            common["scheduler"] = self.scheduler.state_dict()
        per_rank = {"rng": checkpoint.rng_state(), "balancer": p["balancer"].state_dict()}
        start = time.perf_counter()
        checkpoint.save(self.comm, run.checkpoint_path, common, per_rank, self.cfg.comm_timeout)
        run.recorder.writer.append_rows("checkpoint/seconds", [time.perf_counter() - start])
        run.recorder.writer.append_rows("checkpoint/position", [[position["epoch"], position["step"]]], dtype="int64")
        if stopped:
            run.log(f"stop requested (signal {stopped}): checkpoint at {where} written to {run.checkpoint_path}; "
                    f"continue with: dbs-mpi train --resume {run.summary.path or '<result file>'}")

    def restore(self, state: dict) -> None:
        """The checkpoint's model, optimizer and position. On as many ranks as wrote it, each
        rank its own balancer and random state; on another number, the balancer takes the
        position alone (train() calibrates the new ranks) and a rank that did not exist
        draws from a generator seeded by (seed, rank)."""
        p, rank = self.parts, self.comm.Get_rank()
        p["model"].load_state_dict(state["model"])
        p["optimizer"].load_state_dict(state["optimizer"])
        parts = state["per_rank"]
        p["balancer"].load_state_dict(parts[rank if rank < len(parts) else 0]["balancer"])
        p["sampler"].load_state_dict({"epoch": state["epoch"], "step": state["step"], "seed": self.cfg.seed})
        if self.precision.scaler is not None and "scaler" in state:
            self.precision.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if rank < len(parts):
            checkpoint.restore_rng(parts[rank]["rng"])
        else:
            torch.manual_seed(self.cfg.seed * 100_003 + rank)


def _sat_out(table, global_batch: int) -> str:
    """The epoch log line's note of the ranks that sat out some of its full steps."""
    full = table[table.sum(axis=1) == global_batch]
    out = (full == 0).sum(axis=0)
    return "".join(f"  rank {rank} sat out {count} of {len(full)} steps" for rank, count in enumerate(out) if count)


def _progress(loader, cfg: Config, epoch: int, rank: int):
    """The loader, with a progress bar on rank 0 when stderr is a terminal."""
    if rank != 0 or not cfg.progress or not sys.stderr.isatty():
        return loader
    from tqdm import tqdm
    return tqdm(loader, total=len(loader), desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False, unit="step",
                file=sys.stderr)


def _rank_value(epoch: dict, key: str, rank: int) -> float:
    """Rank `rank`'s value in an epoch record; 0 where the rank did not exist (a run
    resumed on another number of ranks: the record is narrower, or NaN)."""
    values = epoch[key]
    value = float(values[rank]) if rank < len(values) else 0.0
    return value if math.isfinite(value) else 0.0


def format_summary(summary: RunSummary, cfg: Config, world: int) -> str:
    """The one-screen summary printed at the end of `dbs-mpi train`."""
    if not summary.epochs:
        return "no epoch ran"
    last = summary.epochs[-1]
    lines = [f"run: {cfg.strategy} / {cfg.aggregation}, {cfg.model} on {cfg.dataset}, {world} rank(s), "
             f"global batch {cfg.global_batch}" + (" (adaptive start)" if cfg.global_batch_auto else "")
             + (f", speeds {','.join(f'{s:g}' for s in cfg.speeds)}" if cfg.speeds else "")
             + (" [oversubscribed: more ranks than cores, times are shared-core times]"
                if summary.oversubscribed else ""),
             "epoch times (s): " + " ".join(f"{e['duration']:.2f}" for e in summary.epochs)
             + f"   total {sum(e['duration'] for e in summary.epochs):.2f}",
             f"final: train loss {last['train_loss']:.4f}, test loss {last['test_loss']:.4f}, "
             f"test accuracy {100 * last['test_accuracy']:.2f}%",
             f"{'rank':>4} {'batch':>6} {'samples/s':>10} {'compute':>8} {'comm':>6} {'wait':>6}"]
    for r in range(world):
        total = sum(_rank_value(e, key, r) for e in summary.epochs for key in ("compute_time", "comm_time",
                                                                             "wait_time", "data_time"))
        share = lambda key: 100 * sum(_rank_value(e, key, r) for e in summary.epochs) / max(total, 1e-12)
        lines.append(f"{r:>4} {int(_rank_value(last, 'batch_sizes', r)):>6} {_rank_value(last, 'speed', r):>10.0f} "
                     f"{share('compute_time'):>7.1f}% {share('comm_time'):>5.1f}% {share('wait_time'):>5.1f}%")
    if summary.path:
        lines.append(f"results: {summary.path}")
    return "\n".join(lines)
