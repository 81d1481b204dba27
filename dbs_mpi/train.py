"""The synchronous training loop. It reads like single-process training: the strategy
decides the local batch and combines gradients, the emulator stretches compute, the
profiler's clocks bracket each phase.

`train(comm, cfg)` is library code (any communicator); the `dbs-mpi train` entry
point passes COMM_WORLD.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import allocation, checkpoint, comm as mpi, sharding
from .checkpoint import EXIT_STOPPED, StopRequest, Stopped
from .config import ASYNC_STRATEGIES, Config, UserError, check_world
from .data import Dataset, augment, load_dataset
from .heterogeneity import Emulator
from .models import build_model, num_parameters
from .profiling import StepTimes, benchmark_speed, split_wait
from .results import STATUS_COMPLETE, STATUS_FAILED, STATUS_INTERRUPTED, NullWriter, RunWriter, default_path, versions
from .strategies import make_strategy


@dataclass
class RunSummary:
    path: str | None
    epochs: list = field(default_factory=list)   # one dict per epoch (rank 0's view of everything)
    model: torch.nn.Module | None = None
    oversubscribed: bool = False                  # some node ran more ranks than it has cores


def configure_threads(comm, cfg: Config) -> int:
    threads = cfg.threads or max(1, mpi.available_cores() // mpi.local_size(comm))
    torch.set_num_threads(threads)
    return threads


def setup(comm, cfg: Config, out: str | None):
    """Everything that can fail because of the user's input; run under comm.agree."""
    check_world(cfg, comm.Get_size())
    common = dict(seed=cfg.seed, synthetic_samples=cfg.synthetic_samples,
                  synthetic_shape=cfg.synthetic_shape, synthetic_classes=cfg.synthetic_classes)
    train_set = load_dataset(cfg.dataset, "train", cfg.data_dir, subset=cfg.subset, **common)
    test_set = load_dataset(cfg.dataset, "test", cfg.data_dir, subset=cfg.test_subset, **common)
    if sharding.steps_per_epoch(len(train_set), cfg.global_batch, cfg.drop_last) == 0:
        raise UserError(f"global_batch: {cfg.global_batch} is larger than the {len(train_set)} training samples "
                        f"(with drop_last nothing is left)")
    try:
        model = build_model(cfg.model, train_set.sample_shape, train_set.num_classes, norm=cfg.norm)
    except ValueError as exc:
        raise UserError(f"model: {exc}") from None
    return train_set, test_set, model


def evaluate(comm, cfg, model, test_set: Dataset, chunk: int = 2048) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole test set, each rank taking a slice."""
    part = sharding.eval_shard(len(test_set), comm.Get_rank(), comm.Get_size())
    sums = np.zeros(3)
    model.eval()
    with torch.no_grad():
        for start in range(part.start, part.stop, chunk):
            x = test_set.x[start:min(start + chunk, part.stop)]
            y = test_set.y[start:min(start + chunk, part.stop)]
            out = model(x)
            sums += (F.cross_entropy(out, y, reduction="sum").item(), (out.argmax(1) == y).sum().item(), len(y))
    model.train()
    mpi.allreduce_sum(comm, sums, cfg.comm_timeout)
    return sums[0] / max(sums[2], 1), sums[1] / max(sums[2], 1)


def startup_benchmark(comm, cfg, model, train_set, emulator) -> tuple[allocation.SpeedModel, np.ndarray, np.ndarray]:
    """Every rank times itself at two local batch sizes; all-gather; fit the speed model."""
    n = comm.Get_size()
    small = max(cfg.min_local_batch, cfg.global_batch // (2 * n))
    large = max(small + 1, min(cfg.global_batch, 2 * cfg.global_batch // n))
    if cfg.max_local_batch:
        large = min(large, cfg.max_local_batch)
        small = min(small, max(1, large - 1))
    idx = torch.arange(large) % len(train_set)
    x, y = train_set.x[idx], train_set.y[idx]
    t_small, t_large = benchmark_speed(model, x, y, small, large, cfg.benchmark_steps, cfg.benchmark_warmup,
                                       emulator)
    times = mpi.allgather_array(comm, [t_small, t_large], cfg.comm_timeout)
    fit = allocation.SpeedModel.fit(np.full(n, small), times[:, 0], np.full(n, large), times[:, 1],
                                    affine=cfg.dbs_model == "affine")
    return fit, np.array([small, large]), times


def train(comm, cfg: Config, out: str | None = None, log=None, checkpoint_state: dict | None = None) -> RunSummary:
    """Train cfg's model on all ranks of comm; rank 0 writes the HDF5 result file.

    checkpoint_state (from checkpoint.load, on every rank) continues a stopped run:
    the result file `out` is continued, not rewritten. Raises SystemExit(EXIT_STOPPED)
    on every rank after a stop request (SIGTERM/SIGUSR1) was checkpointed."""
    rank, world = comm.Get_rank(), comm.Get_size()
    log = log or (lambda msg: print(msg, flush=True) if rank == 0 else None)
    out = out or cfg.out or str(default_path(cfg.strategy))

    torch.manual_seed(cfg.seed)
    train_set, test_set, model = mpi.agree(comm, setup, comm, cfg, out)
    threads = configure_threads(comm, cfg)
    mpi.broadcast_parameters(comm, model)
    emulator = Emulator.from_config(cfg, rank)
    hosts = mpi.hostnames(comm)
    oversubscribed = mpi.oversubscribed(hosts)
    sleep_wait = mpi.sleep_while_waiting(cfg.wait_policy, hosts)

    attrs = dict(config=cfg.to_json(), strategy=cfg.strategy, aggregation=cfg.aggregation, dataset=cfg.dataset,
                 model=cfg.model, world_size=world, num_parameters=num_parameters(model), hostnames=hosts,
                 versions=json.dumps(versions(mpi.mpi_library())), torch_threads=threads,
                 oversubscribed=oversubscribed, sleep_while_waiting=sleep_wait)
    # Stop requests are honoured from here on: before the result file exists on rank 0,
    # every rank has its handlers (the file is created inside a collective).
    with StopRequest(comm, cfg.comm_timeout) as stop:
        if checkpoint_state is None:
            writer = mpi.agree(comm, lambda: RunWriter(out, attrs, world) if rank == 0 else NullWriter())
        else:
            done = checkpoint_state["records"]
            writer = mpi.agree(comm, lambda: RunWriter.reopen(out, attrs, world, done["epochs"], done["steps"],
                                                              done.get("updates")) if rank == 0 else NullWriter())
        summary = RunSummary(path=out if rank == 0 else None, model=model, oversubscribed=oversubscribed)
        if cfg.strategy in ASYNC_STRATEGIES:
            from .parameter_server import AsyncTrainer as Trainer
        else:
            Trainer = SyncTrainer
        run = Trainer(comm, cfg, out, stop, checkpoint_state).run
        status = STATUS_FAILED
        try:
            run(comm, cfg, model, train_set, test_set, emulator, writer, summary, log, sleep_wait)
            status = STATUS_COMPLETE
        except Stopped:
            status = STATUS_INTERRUPTED
            raise SystemExit(EXIT_STOPPED)
        finally:
            writer.close(status)
    return summary


class SyncTrainer:
    """The synchronous strategies' loop, with checkpoints at epoch ends and on request."""

    def __init__(self, comm, cfg, out, stop: StopRequest, state=None):
        self.comm, self.cfg, self.stop, self.state = comm, cfg, stop, state
        self.path = cfg.checkpoint or str(checkpoint.default_path(out))

    def run(self, comm, cfg, model, train_set, test_set, emulator, writer, summary, log, sleep_wait):
        rank = comm.Get_rank()
        state = self.state
        self.writer = writer
        if state is None:
            speed_model, bench_batches, bench_times = startup_benchmark(comm, cfg, model, train_set, emulator)
            writer.write("startup/local_batch", bench_batches)
            writer.write("startup/step_time", bench_times)
        else:
            model.load_state_dict(state["model"])
            speed_model = state["speed_model"]
        strategy = make_strategy(comm, model.parameters(), cfg, speed_model, sleep_wait)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                    weight_decay=cfg.weight_decay)
        first_epoch, first_step, partial = 0, 0, None
        if state is None:
            writer.write("startup/batch_sizes", strategy.batch_sizes)
        else:
            optimizer.load_state_dict(state["optimizer"])
            strategy.load_state(state["strategy"])
            checkpoint.restore_rng(state["per_rank"][rank]["rng"], emulator)
            first_epoch, first_step = state["epoch"], state["step"]
            partial = state.get("partial")
            summary.epochs.extend(state["summary_epochs"])
        self.records = dict(state["records"]) if state else {"epochs": 0, "steps": 0}
        n = len(train_set)
        progress = _progress_bar(rank, cfg)
        stop = self.stop
        for epoch in range(first_epoch, cfg.epochs):
            vector = strategy.batch_sizes.copy()
            table = sharding.step_batch_sizes(n, cfg.global_batch, vector, cfg.drop_last)
            shard = sharding.epoch_shard(n, epoch, cfg.seed, cfg.global_batch, vector, rank, cfg.drop_last)
            steps = len(shard)
            times = StepTimes(steps)
            losses = np.zeros(steps)
            begin, elapsed_before = 0, 0.0
            if epoch == first_epoch and first_step > 0:      # continue a stopped epoch
                begin, elapsed_before = first_step, partial["elapsed"]
                losses[:begin] = partial["losses"]
                times.restore(state["per_rank"][rank]["times"])
                emulator.__dict__.update(state["per_rank"][rank]["emulator"])
            else:
                emulator.start_epoch(epoch, steps)
            bar = progress(steps, epoch)
            if bar is not None:
                bar.update(begin)
            epoch_start = time.perf_counter()
            stopped_at, stop_after_epoch = None, False
            for s in range(begin, steps):
                idx = shard[s]
                stop.start()
                t0 = time.perf_counter()
                x, y = train_set.x[idx], train_set.y[idx]
                if cfg.augment:
                    x = augment(x, idx, epoch, cfg.seed)
                t1 = time.perf_counter()
                strategy.zero_grad(len(idx), table[s])
                local_loss = 0.0
                if len(idx):
                    loss = F.cross_entropy(model(x), y)
                    strategy.backward(loss)
                    local_loss = loss.item()
                emulator.stretch(time.perf_counter() - t1)
                t2 = time.perf_counter()
                losses[s] = strategy.reduce(local_loss, len(idx), table[s])
                t3 = time.perf_counter()
                optimizer.step()
                t4 = time.perf_counter()
                times.record(s, t1 - t0, t2 - t1, t3 - t2, t4 - t3)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{losses[s]:.3f}", refresh=False)
                if stop.agreed():          # some rank got SIGTERM/SIGUSR1: all stop after this step
                    if s + 1 < steps:
                        stopped_at = s + 1
                        break
                    stop_after_epoch = True
            duration = elapsed_before + time.perf_counter() - epoch_start
            if bar is not None:
                bar.close()
            if stopped_at is not None:
                partial = {"losses": losses[:stopped_at].copy(), "elapsed": duration}
                self.save(comm, model, optimizer, strategy, emulator, summary, epoch, stopped_at, partial,
                          times.snapshot(stopped_at))
                log(f"stop requested (signal {stop.requested or 'on another rank'}): checkpoint at epoch {epoch + 1}, "
                    f"step {stopped_at}/{steps} written to {self.path}; continue with: dbs-mpi train --resume "
                    f"{summary.path or '<result file>'}")
                raise Stopped()
            record, step_rows = self.end_epoch(comm, cfg, model, test_set, strategy, table, times, losses,
                                               vector, duration)
            writer.append_epoch(record, step_rows)
            self.records = {"epochs": epoch + 1, "steps": self.records["steps"] + steps}
            summary.epochs.append(record)
            log(f"epoch {epoch + 1}/{cfg.epochs}  train loss {record['train_loss']:.4f}  test loss "
                f"{record['test_loss']:.4f}  accuracy {100 * record['test_accuracy']:.2f}%  time {duration:.2f} s  "
                f"batch sizes {vector.tolist()}")
            stop_now = stop_after_epoch
            if stop_now or (cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0) \
                    or epoch + 1 == cfg.epochs:
                self.save(comm, model, optimizer, strategy, emulator, summary, epoch + 1, 0, None, None)
            if stop_now and epoch + 1 < cfg.epochs:
                log(f"stop requested: checkpoint after epoch {epoch + 1} written to {self.path}; continue with: "
                    f"dbs-mpi train --resume {summary.path or '<result file>'}")
                raise Stopped()

    def end_epoch(self, comm, cfg, model, test_set, strategy, table, times, losses, vector, duration):
        # Everybody's step times, once per epoch: (ranks, 5, steps).
        gathered = mpi.allgather_array(comm, times.as_array(), cfg.comm_timeout)
        data_t, compute_t, collective_t, _, pre_t = (gathered[:, i, :] for i in range(5))
        wait_t, comm_t = split_wait(pre_t, collective_t)
        diagnostics = strategy.end_epoch(table, pre_t.sum(axis=1))
        eval_start = time.perf_counter()
        test_loss, test_acc = evaluate(comm, cfg, model, test_set)
        eval_time = time.perf_counter() - eval_start
        samples = table.sum(axis=1)
        steps = len(losses)
        record = dict(
            train_loss=float((losses * samples).sum() / samples.sum()), test_loss=test_loss,
            test_accuracy=test_acc, duration=duration, eval_time=eval_time, batch_sizes=vector,
            compute_time=compute_t.sum(axis=1), comm_time=comm_t.sum(axis=1), wait_time=wait_t.sum(axis=1),
            data_time=data_t.sum(axis=1), speed=table.sum(axis=0) / np.maximum(pre_t.sum(axis=1), 1e-12),
            steps=np.int64(steps), **diagnostics)
        epoch_index = np.full(steps, self.records["epochs"], dtype=np.int64)
        return record, dict(loss=losses, epoch=epoch_index, compute_time=compute_t.T, comm_time=comm_t.T,
                            wait_time=wait_t.T)

    def save(self, comm, model, optimizer, strategy, emulator, summary, epoch, step, partial, times):
        common = {"config": self.cfg.to_dict(), "world_size": comm.Get_size(), "epoch": epoch, "step": step,
                  "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "strategy": strategy.state_dict(), "speed_model": strategy.speed_model,
                  "partial": partial, "records": self.records, "summary_epochs": summary.epochs}
        per_rank = {"rng": checkpoint.rng_state(emulator), "times": times,
                    "emulator": {k: getattr(emulator, k) for k in ("factor", "epoch_sleep", "step_sleep")}}
        start = time.perf_counter()
        checkpoint.save(comm, self.path, common, per_rank)
        self.writer.append_rows("checkpoint/seconds", [time.perf_counter() - start])
        self.writer.append_rows("checkpoint/position", [[epoch, step]], dtype=np.int64)


def _progress_bar(rank, cfg):
    if rank != 0 or not cfg.progress or not sys.stderr.isatty():
        return lambda steps, epoch: None
    from tqdm import tqdm
    return lambda steps, epoch: tqdm(total=steps, desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False,
                                     unit="step", file=sys.stderr)


def format_summary(summary: RunSummary, cfg: Config, world: int) -> str:
    """The one-screen summary printed at the end of `dbs-mpi train`."""
    if not summary.epochs:
        return "no epoch ran"
    last = summary.epochs[-1]
    lines = [f"run: {cfg.strategy} / {cfg.aggregation}, {cfg.model} on {cfg.dataset}, {world} rank(s), "
             f"global batch {cfg.global_batch}"
             + (f", speeds {','.join(f'{s:g}' for s in cfg.speeds)}" if cfg.speeds else "")
             + (" [oversubscribed: more ranks than cores, times are shared-core times]"
                if summary.oversubscribed else ""),
             "epoch times (s): " + " ".join(f"{e['duration']:.2f}" for e in summary.epochs)
             + f"   total {sum(e['duration'] for e in summary.epochs):.2f}",
             f"final: train loss {last['train_loss']:.4f}, test loss {last['test_loss']:.4f}, "
             f"test accuracy {100 * last['test_accuracy']:.2f}%",
             f"{'rank':>4} {'batch':>6} {'samples/s':>10} {'compute':>8} {'comm':>6} {'wait':>6}"]
    for r in range(world):
        total = sum(e["compute_time"][r] + e["comm_time"][r] + e["wait_time"][r] + e["data_time"][r]
                    for e in summary.epochs)
        share = lambda key: 100 * sum(e[key][r] for e in summary.epochs) / max(total, 1e-12)
        lines.append(f"{r:>4} {int(last['batch_sizes'][r]):>6} {last['speed'][r]:>10.0f} "
                     f"{share('compute_time'):>7.1f}% {share('comm_time'):>5.1f}% {share('wait_time'):>5.1f}%")
    if summary.path:
        lines.append(f"results: {summary.path}")
    return "\n".join(lines)
