"""The asynchronous strategies' driver: AsyncTrainer sets up the server (rank 0) or this
rank's worker and runs the protocol in segments, writing epochs and checkpoints between
them.

Checkpoints and stop requests. A consistent snapshot of an asynchronous run needs a
moment with nothing in flight, so training runs in segments. A segment ends by draining:
the server hands out no more work and answers every push with STOP (after applying
it; a group that can no longer fill is applied as it is), so when the last worker has
its STOP every handed-out sample is applied and no message is in flight. A segment ends
  * at an epoch boundary where a checkpoint is due (cfg.checkpoint_every): epoch e is
    all handed out, nothing of e+1 is; the drain costs at most the slowest worker's
    last step, while the faster workers idle (measured in the epoch's duration);
  * on a stop request (SIGTERM/SIGUSR1, checkpoint.StopRequest): the server notices its
    own flag at its next poll, a worker's with its next push (G_SIGNAL); the drain then
    takes at most one step of every worker;
  * when the budget is used up (the end).
Between segments, outside the training clock, all ranks evaluate the newly closed
epochs, rank 0 appends their records and the update rows, and all write the
checkpoint (the server's weights, optimizer, version, cursor, controller, records;
every rank's RNG, emulator and statistics). On a stop request every rank then raises
checkpoint.Stopped (exit status EXIT_STOPPED); `dbs-mpi train --resume` continues with
the next segment, the clock and the version where they were. Every sample is still
applied exactly once per epoch across a stop; a drain resets staleness (every worker
restarts on the newest weights), and rounds (hardsync) are never split, so a resumed
hardsync run with one worker ends with the same weights, bit for bit, as an
uninterrupted one (with more workers the order in which gradients arrive changes the
sum's rounding). A resume on another number of workers keeps the server's state (nothing
is in flight after a drain) and derives again what depends on lambda: the local batches
(dbs-sgd: a new calibration and controller), c and the server momentum; rounds continue
only into rounds (docs/method.md, section 8).
"""
from __future__ import annotations

import time

import numpy as np
import torch
from mpi4py import MPI

from ..mpi import startup
from ..mpi.agreement import collective
from ..mpi.collectives import allgather_array, barrier
from ..mpi.supervisor import SUPERVISOR
from ..mpi.waits import wait
from ..options import UserError
from ..planning import allocation, calibration, dynamic
from ..planning.heterogeneity import Emulator
from ..training import checkpoint
from ..training.balancer import calibrate
from ..training.batches import first_samples
from ..training.profiling import model_step
from .groups import group_size
from .protocol import END_DONE, END_STOP, bind_parameters
from .records import epoch_record
from .server import Server
from .worker import Worker


def check_model(model) -> None:
    if any(b.is_floating_point() for b in model.buffers()):
        raise UserError("model: the asynchronous strategies keep no buffers (BatchNorm statistics) on the "
                        "server; use norm = \"group\"")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise UserError("model: the parameter server supports float32 parameters only")


def initial_vector(run, emulator):
    """Local batches of the workers (sum = global_batch), dbs-sgd's controller, and the
    calibration's start-up records (dbs-sgd; {} otherwise)."""
    comm, cfg = run.comm, run.cfg
    workers = comm.Get_size() - 1
    max_local = cfg.max_local_batch or None
    if cfg.strategy != "dbs-sgd":
        return allocation.equal(cfg.global_batch, workers, cfg.min_local_batch, max_local), None, {}
    # Every rank (the server too: the calibration is a collective) times itself at two
    # local batches; the workers' part of the fit sizes their local batches.
    small, large = allocation.calibration_batches(cfg.global_batch, comm.Get_size(), cfg.min_local_batch, max_local)
    step = model_step(run.model, run.loss_fn, *first_samples(run.train_set, large))
    fit, times, tiny = calibrate(comm, step, small, large, steps=cfg.benchmark_steps, warmup=cfg.benchmark_warmup,
                                 stretch=emulator.stretch, affine=cfg.dbs_model == "affine", timeout=cfg.comm_timeout)
    timings = {"local_batch": np.array([small, large], dtype=np.int64), "step_time": times, "tiny_time": tiny,
               "timed_large": calibration.timed_large(tiny, times, small, large)}
    speed_model = allocation.SpeedModel(fit.per_sample[1:].copy(), fit.overhead[1:].copy())
    controller = dynamic.DBSController(
        model=speed_model, global_batch=cfg.global_batch, min_local=cfg.min_local_batch, max_local=max_local,
        smoothing=cfg.dbs_smoothing, follow=cfg.dbs_follow, min_gain=cfg.dbs_min_gain)
    return speed_model.allocate(cfg.global_batch, cfg.min_local_batch, max_local), controller, timings


def _start_line(cfg, state, workers: int, c: int, mode: str, vector, moved: bool) -> str:
    """What rank 0 says as the run starts or resumes."""
    if state is None:
        return (f"{cfg.strategy}: 1 server + {workers} worker(s), {c} gradient(s) per update, replies {mode}, "
                f"local batches {vector.tolist()}" + (", learning rate / staleness" if cfg.staleness_lr else "")
                + (f", time budget {cfg.time_budget:g} s" if cfg.time_budget else ""))
    return (f"{cfg.strategy}: resumed after {state['epoch']} epoch(s) and {state['server']['version']} update(s), "
            f"{state['server']['clock']:.1f} s of training"
            + (f"; {workers} worker(s) instead of {state['world_size'] - 1}, local batches {vector.tolist()}"
               if moved else ""))


class AsyncTrainer:
    """Runs cfg.strategy (asgd | nsoftsync | dbs-sgd) on comm: rank 0 serves, the others
    work, in segments between checkpoints (module docstring, "Checkpoints"). Same shape
    as train.SyncTrainer: train.train() builds it from the run and calls train(); rank 0
    writes the records. Waiting ranks always sleep between polls (the protocol never
    spins)."""

    def __init__(self, run):
        self.run, self.comm, self.cfg, self.stop, self.state = run, run.comm, run.cfg, run.stop, run.state
        self.path, self.log, self.summary = run.checkpoint_path, run.log, run.summary
        self.writer = run.recorder.writer
        self.emulator = Emulator.from_config(self.cfg, self.comm.Get_rank())
        self.emulator.wall_clock = run.device.type == "cuda"     # a GPU worker: stretch wall time

    def train(self) -> None:
        comm, cfg = self.comm, self.cfg
        server, worker, pcomm = self._set_up()
        startup.done()                         # the first step's waits are the training's (comm_timeout)
        barrier(comm, cfg.comm_timeout)        # everybody set up: the clocks start now
        # Bounded: every segment but the last hands out at least one epoch boundary's or
        # one stop request's worth of work, and the server's budget ends the run.
        while True:
            end = server.run() if server is not None else worker.run()
            # Everybody is out of the protocol; a message still queued would be a protocol bug.
            barrier(pcomm, cfg.comm_timeout)
            stray = float(pcomm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))
            closed = server.records.closed if server is not None else 0
            signum = max(self.stop.requested, server.signal if server is not None else 0)
            flags = allgather_array(comm, [end or 0, closed, stray, signum], cfg.comm_timeout)
            if flags[:, 2].any():
                raise RuntimeError(f"parameter server protocol: unmatched message(s) on rank(s) "
                                   f"{np.flatnonzero(flags[:, 2]).tolist()}")
            end = int(flags[0, 0])
            if end != END_DONE and flags[:, 3].any():     # a signal that came after a worker's last push
                end = END_STOP
            signum = int(flags[:, 3].max())
            self._write_epochs(server, worker, int(flags[0, 1]))
            if end == END_DONE:
                self._finish(server)
            self._save(server, worker)
            if end == END_STOP:
                pcomm.Free()
                self.log(f"stop requested: checkpoint after {self.written} epoch(s) written to {self.path}; "
                         f"continue with: dbs-mpi train --resume {self.summary.path or '<result file>'}")
                raise checkpoint.Stopped(signum)
            if end == END_DONE:
                break
        pcomm.Free()

    def _set_up(self):
        """The server (rank 0) or this rank's worker, new or from the checkpoint, and the
        protocol's communicator."""
        run, comm, cfg, state = self.run, self.comm, self.cfg, self.state
        rank, workers = comm.Get_rank(), comm.Get_size() - 1
        collective(comm, check_model, run.model, timeout=cfg.comm_timeout)
        moved = state is not None and state["world_size"] != comm.Get_size()     # another number of workers
        if state is None or moved:           # the new workers: their own vector (dbs-sgd: calibrated)
            startup.phase("calibration", backstop=True)
            vector, controller, timings = initial_vector(run, self.emulator)
            self.writer.write_startup({**timings, "batch_sizes": np.concatenate([[0], vector]).astype(np.int64)})
        else:                               # the server's state has them
            vector, controller = allocation.equal(cfg.global_batch, workers, 1, None), None
        if state is not None and rank < len(state["per_rank"]):
            mine = state["per_rank"][rank]
            checkpoint.restore_rng(mine["rng"])
            if not moved:
                self.emulator.load_state_dict(mine["emulator"])
        elif state is not None:             # a rank that did not exist: its own generator
            torch.manual_seed(cfg.seed * 100_003 + rank)
        self.c = group_size(cfg.strategy, workers, cfg.softsync_n)
        self.mode = "immediate" if not (cfg.strategy == "nsoftsync" and cfg.softsync_wait) else (
            "rounds (hardsync)" if self.c == workers else "wait")
        with SUPERVISOR.deadline(comm, cfg.comm_timeout, "creating the protocol's communicator"):
            pcomm = comm.Dup()          # the protocol's own context: its tags meet no other message
        server = worker = None
        if rank == 0:
            server = Server(pcomm, cfg, run.model, len(run.train_set), vector, controller, self.log, self.stop)
            if state is not None:
                server.load_state(state["server"], moved)
        else:
            worker = Worker(pcomm, cfg, run.model, run.train_set, self.emulator, self.stop, run.loss_fn)
            if state is not None and rank < len(state["per_rank"]):
                worker.load_state(state["per_rank"][rank]["worker"])
                if moved:
                    worker.resume_emulator()
        self.log(_start_line(cfg, state, workers, self.c, self.mode, vector, moved))
        self.written = state["epoch"] if state is not None else 0
        return server, worker, pcomm

    def _write_epochs(self, server, worker, closed: int) -> None:
        """Evaluate the weights at the end of every newly closed epoch (all ranks together,
        outside the training clock) and append the epochs' records; rank 0 also appends
        the update rows applied since the last segment."""
        if server is not None:
            server.records.write_rows(self.writer)
        if closed == self.written:
            return
        comm, cfg = self.comm, self.cfg
        stats = server.records.stats if server is not None else worker.stats
        gathered = allgather_array(comm, stats, cfg.comm_timeout)      # (world, epochs, K)
        # The model's parameters are views of the protocol buffers: evaluate in place
        # (the server's current weights are put back afterwards).
        flat = server.weights if server is not None else worker.weights.body
        current = flat.clone()
        workers = comm.Get_size() - 1
        for e in range(self.written, closed):
            if server is not None:
                flat.copy_(torch.from_numpy(server.records.snapshots.pop(e)))
            wait(comm.Ibcast([flat.numpy(), MPI.FLOAT], root=0), cfg.comm_timeout, "broadcasting weights")
            if worker is not None:
                worker.pull()
            test_loss, test_acc, eval_time = self.run.evaluate()
            record = epoch_record(gathered, e, workers, test_loss, test_acc, eval_time)
            self.writer.append_epoch(record, {})
            self.summary.epochs.append(record)
            self.log(f"epoch {e + 1}/{cfg.epochs}  train loss {record['train_loss']:.4f}  test loss {test_loss:.4f}  "
                     f"accuracy {100 * test_acc:.2f}%  time {record['duration']:.2f} s  staleness mean "
                     f"{record['staleness_mean']:.2f} max {int(record['staleness_max'])}  "
                     f"batch sizes {record['batch_sizes'].tolist()}")
        flat.copy_(current)
        if worker is not None:
            worker.pull()
        self.written = closed
        if server is not None:
            server.records.written = closed

    def _finish(self, server) -> None:
        """The run is complete: every rank's model gets the final weights as plain
        parameters (no views of protocol buffers); rank 0 writes the run's staleness."""
        params = [p for p in self.run.model.parameters()]
        host = torch.zeros(sum(p.numel() for p in params))
        flat = host if self.run.device.type == "cpu" else torch.zeros(host.shape, device=self.run.device)
        bind_parameters(params, flat)
        wait(self.comm.Ibcast([host.numpy(), MPI.FLOAT], root=0), self.cfg.comm_timeout, "broadcasting weights")
        if flat is not host:
            flat.copy_(host)
        for p in params:
            p.grad = None
        if server is None:
            return
        self.log(server.records.write_staleness(self.writer, updates=server.version, gradients_per_update=self.c,
                                                reply_mode=self.mode, server_momentum=server.rule.momentum))

    def _save(self, server, worker) -> None:
        """Collective: the checkpoint, between segments (nothing in flight, every applied
        gradient and every closed epoch already in the result file)."""
        common = {}
        if server is not None:
            applied = server.records.applied
            position = [self.written, int(applied[self.written]) if self.written < len(applied) else 0]
            common = {"config": self.cfg.to_dict(), "world_size": self.comm.Get_size(), "epoch": self.written,
                      "step": 0, "position": position, "server": server.state_dict(),
                      "records": {"epochs": self.written, "steps": 0, "updates": server.records.rows_written}}
        per_rank = {"rng": checkpoint.rng_state(), "emulator": self.emulator.state_dict(),
                    "worker": worker.state_dict() if worker is not None else None}
        start = time.perf_counter()
        checkpoint.save(self.comm, self.path, common, per_rank, self.cfg.comm_timeout)
        if server is not None:
            self.writer.append_rows("checkpoint/seconds", [time.perf_counter() - start])
            self.writer.append_rows("checkpoint/position", [common["position"]], dtype=np.int64)
