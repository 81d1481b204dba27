"""Asynchronous strategies on a parameter server over MPI: asgd, nsoftsync, dbs-sgd.

Rank 0 is the server: it holds the parameters and applies every update (SGD with
momentum, cfg.lr). Ranks 1..n-1 are the workers (lambda = n - 1 learners): a worker
gets weights and a piece of work, computes the gradient on its local batch, pushes
it and waits for the next weights. RESEARCH.md section 4 (Zhang et al., IJCAI 2016)
for asgd / n-softsync and the staleness-dependent learning rate, section 3 (Ji et
al.) for dbs-sgd, section 1 for the sample weighting.

Strategies (what the server does with arriving gradients)
  asgd       apply every gradient on arrival (c = 1).
  nsoftsync  apply after collecting c = floor(lambda / n) gradients from any workers
             (n = cfg.softsync_n; n = lambda is asgd). By default (Zhang et al.) a worker
             gets the current weights at once after its push, applied or not, so tau is
             about n and 1-softsync is *not* hardsync (tau about 1). With
             cfg.softsync_wait a worker gets new weights only once its gradient has been
             applied: with n = 1 every update averages all workers' gradients computed on
             the same weights (hardsync, tau = 0), the same updates as the synchronous
             ssgd path with global batch = the sum of the local batches.
  dbs-sgd    asgd whose local batches are sized from each worker's measured compute
             speed (start-up benchmark, then re-planned at every epoch from the compute
             times the workers report with their gradients; allocation.DBSController:
             affine step-time model, dead band), so that every worker's iteration takes
             about the same time and no fast worker floods the server: staleness stays
             about lambda - 1 instead of growing with the speed ratio.
  asgd and nsoftsync split cfg.global_batch equally over the workers.

Update rule. The c gradients of an update count in proportion to their samples
(section 1: every sample weighs the same, whoever computed it):
    g = sum_i s_i b_i g_i / (c * B / lambda),    s_i = 1/max(tau_i, 1) if cfg.staleness_lr else 1
where g_i is the mean gradient over worker i's b_i samples and B / lambda the mean local
batch. With equal local batches this is the plain average of the c gradients; a
dbs-sgd gradient of a large local batch moves the weights further than one of a small
batch, by the ratio of their samples. In rounds (hardsync) the divisor is the round's
samples, so that every update is the synchronous path's, the last partial step of an
epoch included (the mean gradient over the union batch). tau_i = server version at
apply - version of the weights g_i was computed on; the server version counts updates.
g is then given to torch.optim.SGD (momentum, weight decay) as .grad.

Work and the budget. The server hands out the samples: a work message says
(epoch, start, count), and the worker reads perm_epoch[start:start + count] of the
sharding module's seeded permutation (the same one the synchronous path uses). The
budget is the synchronous one, counted at the server: cfg.epochs passes over the
training set, every sample handed out exactly once per epoch, all of epoch e before
any of epoch e+1; cfg.time_budget > 0 also stops handing out work after that many
seconds. Two ways of handing out:
  * rounds (hardsync: softsync_wait with c = lambda): round s of an epoch is step s of
    the synchronous path; worker w reads the slice the synchronous rank w-1 reads
    (sharding.step_batch_sizes: in the last, partial step a worker may get 0 samples).
  * stream (everything else): the next min(b_w, left in the epoch) samples.
An epoch ends when all its samples (and those of the epochs before) have been applied;
the weights are copied then, and each copy is evaluated on the test set after the run
by all ranks together (so evaluation never stalls training and is not in epoch times).

Messages (on a duplicate of comm, so that the tags cannot meet any other traffic).
Every message is one flat float32 buffer sent with the uppercase calls (no pickling):
HEADER float64 slots first (2*HEADER float32 words), then the P parameters or
gradients (absent in a stop message).
  TAG_WORK  server -> worker: [command, version, epoch, start, count, held] + weights.
            command WORK: compute on these weights, version = their timestamp; STOP:
            header only, the worker leaves. held = seconds the server kept the worker's
            last gradient before this reply (the worker's wait time).
  TAG_GRAD  worker -> server: [version, count, loss, compute seconds] + gradient.
The protocol is strictly request-reply per worker: the server sends WORK, the worker
answers with exactly one GRAD, the server answers that with WORK or STOP. So a worker
has at most one message in flight each way, and the server posts one receive per
worker exactly when it sends that worker WORK (its own buffer, so transfers of
several workers overlap); workers post the receive for the reply before pushing.
Shutdown: once no work is left (budget or time), every push is answered with STOP
(after the server applied it); the server leaves when every worker has had its STOP.
A group that can no longer fill (nobody is computing) is applied as it is. Every
message sent is received, so nothing is left unmatched (checked at the end: no
receive or send pending, and no stray message on the communicator after a barrier).

Waiting: the server polls its receives with MPI_Test (Testsome) and sleeps between
polls (20 to 100 us), the workers wait with comm.wait (the same), so with more ranks
than cores a waiting rank leaves its core to a computing one. Every wait is bounded by
cfg.comm_timeout (no progress for that long raises CommTimeout, which aborts the job).

Results (rank 0's HDF5 file, besides the usual epoch/* records): one row per applied
gradient in update/staleness, update/worker (rank), update/time (seconds since the
start of training, when applied), update/local_batch, update/loss, update/epoch,
update/version (server version it was applied at) and update/timestamp (version it was
computed on); per epoch staleness_mean/max/p50/p90/p99, updates, samples and
gradients (per rank); root attributes with the whole run's staleness distribution.
The server's row in the per-rank epoch records is: batch 0, compute = aggregation and
optimizer step, comm = receiving and replying, wait = idle polling.

Not supported here: checkpoints and stop requests (SIGTERM) of the synchronous path;
models with floating-point buffers (BatchNorm statistics: use norm = "group").
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from . import allocation, comm as mpi, sharding
from .comm import CommTimeout
from .config import UserError

TAG_WORK = 1    # server -> worker: header + weights (WORK), or header only (STOP)
TAG_GRAD = 2    # worker -> server: header + gradient

HEADER = 8                                                  # float64 slots at the front of every message
W_COMMAND, W_VERSION, W_EPOCH, W_START, W_COUNT, W_HELD = range(6)   # TAG_WORK header
G_VERSION, G_COUNT, G_LOSS, G_COMPUTE = range(4)                      # TAG_GRAD header
CMD_STOP, CMD_WORK = 0.0, 1.0

# Per-rank, per-epoch statistics gathered at the end: columns of one (epochs, K) array.
C_COMPUTE, C_COMM, C_WAIT, C_DATA, C_SAMPLES, C_GRADIENTS = range(6)   # every rank
S_LOSS, S_DURATION, S_UPDATES, S_STALE_MEAN, S_STALE_MAX, S_P50, S_P90, S_P99 = range(6, 14)  # server only
S_VECTOR = 14                                                          # server only: lambda local batches
PERCENTILES = (50, 90, 99)


class Message:
    """One flat float32 message: `header` (float64 view of the front) and `body` (a torch
    view of the P values after it). `whole` and `head` are what Send/Recv take."""

    def __init__(self, numel: int):
        self.tensor = torch.zeros(2 * HEADER + numel, dtype=torch.float32)
        self.array = self.tensor.numpy()
        self.header = self.array[:2 * HEADER].view(np.float64)
        self.body = self.tensor[2 * HEADER:]
        self.whole = [self.array, MPI.FLOAT]
        self.head = [self.array[:2 * HEADER], MPI.FLOAT]


def bind_parameters(params, flat: torch.Tensor) -> None:
    """Make every parameter a view of its place in `flat` (keeping its values)."""
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.data.reshape(-1))
        p.data = flat[offset:offset + n].view_as(p)
        offset += n


def bind_gradients(params, flat: torch.Tensor) -> None:
    """Make every parameter's .grad a view of its place in `flat` (autograd accumulates there)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p)
        offset += n


def group_size(strategy: str, workers: int, softsync_n: int) -> int:
    """c: gradients per update. asgd and dbs-sgd: 1; nsoftsync: floor(lambda / n) (at least 1)."""
    if strategy == "nsoftsync":
        return max(1, workers // softsync_n)
    return 1


def staleness_stats(staleness) -> tuple[float, float, list[float]]:
    """(mean, max, [p50, p90, p99]) of an array of staleness values; zeros if empty."""
    s = np.asarray(staleness, dtype=np.float64)
    if s.size == 0:
        return 0.0, 0.0, [0.0] * len(PERCENTILES)
    return float(s.mean()), float(s.max()), [float(v) for v in np.percentile(s, PERCENTILES)]


class Cursor:
    """Hands out the training samples: the budget, counted at the server.

    `take(w)` returns (epoch, start, count): worker w reads perm_epoch[start:start+count].
    Epoch e's samples are all handed out before any of epoch e+1. `begin_epoch(vector)`
    is called by the server whenever `needs_epoch` is true, with the local batches
    (over workers) to use in that epoch. Rounds mode follows the synchronous path's
    steps exactly (take must then be called for workers 0..lambda-1 in order)."""

    def __init__(self, num_samples: int, global_batch: int, epochs: int, drop_last: bool, workers: int,
                 rounds: bool):
        self.num_samples, self.global_batch, self.epochs = num_samples, global_batch, epochs
        self.drop_last, self.workers, self.rounds = drop_last, workers, rounds
        steps = sharding.steps_per_epoch(num_samples, global_batch, drop_last)
        self.per_epoch = min(num_samples, steps * global_batch)   # samples handed out per epoch
        self.epoch, self.pos, self.row, self.next_worker = 0, 0, 0, 0
        self.started = -1                                         # last epoch begin_epoch was called for
        self.vector = None
        self.table = None

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    @property
    def needs_epoch(self) -> bool:
        return not self.done and self.started < self.epoch

    def begin_epoch(self, vector) -> None:
        self.vector = np.asarray(vector, dtype=np.int64)
        self.started = self.epoch
        if self.rounds:
            self.table = sharding.step_batch_sizes(self.num_samples, self.global_batch, self.vector, self.drop_last)

    def take(self, worker: int) -> tuple[int, int, int]:
        assert not self.done and self.started == self.epoch
        epoch = self.epoch
        if self.rounds:
            if worker != self.next_worker:
                raise RuntimeError(f"rounds: work for worker {worker} out of turn (expected {self.next_worker})")
            row = self.table[self.row]
            start, count = self.row * self.global_batch + int(row[:worker].sum()), int(row[worker])
            self.next_worker = (worker + 1) % self.workers
            if self.next_worker == 0:
                self.row += 1
                if self.row == len(self.table):
                    self.epoch, self.row = self.epoch + 1, 0
            return epoch, start, count
        start = self.pos
        count = min(int(self.vector[worker]), self.per_epoch - self.pos)
        self.pos += count
        if self.pos == self.per_epoch:
            self.epoch, self.pos = self.epoch + 1, 0
        return epoch, start, count


@dataclass
class Assignment:
    epoch: int
    start: int
    count: int
    version: int       # server version of the weights sent with it


class Server:
    """Rank 0: applies updates, hands out work, records every applied gradient."""

    def __init__(self, pcomm, cfg, model, num_samples: int, vector, controller, log):
        self.comm, self.cfg, self.model, self.log = pcomm, cfg, model, log
        self.workers = pcomm.Get_size() - 1
        self.timeout = cfg.comm_timeout
        params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in params)
        self.weights = torch.zeros(self.numel, dtype=torch.float32)
        self.acc = torch.zeros(self.numel, dtype=torch.float32)     # sum_i s_i b_i g_i, then the update's g
        bind_parameters(params, self.weights)
        bind_gradients(params, self.acc)
        self.optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        _warm_up_optimizer()
        self.c = group_size(cfg.strategy, self.workers, cfg.softsync_n)
        self.wait_mode = cfg.strategy == "nsoftsync" and cfg.softsync_wait
        rounds = self.wait_mode and self.c == self.workers
        # Divisor of an update's sample-weighted gradient sum (None: the group's samples).
        self.divisor = None if rounds else self.c * cfg.global_batch / self.workers
        self.cursor = Cursor(num_samples, cfg.global_batch, cfg.epochs, cfg.drop_last, self.workers, rounds)
        self.vector = np.asarray(vector, dtype=np.int64)
        self.controller = controller                 # dbs-sgd: re-plans self.vector at every epoch
        self.grads = [Message(self.numel) for _ in range(self.workers)]
        self.replies = [Message(self.numel) for _ in range(self.workers)]
        self.recvs = [MPI.REQUEST_NULL] * self.workers
        self.sends = [MPI.REQUEST_NULL] * self.workers
        self.outstanding: list[Assignment | None] = [None] * self.workers
        self.arrived = [0.0] * self.workers          # when each worker's last gradient was taken in
        self.stopped = [False] * self.workers
        self.deferred: list[int] = []                # wait mode: workers whose gradient is in the open group
        self.group: list[tuple] = []                 # (worker, timestamp, count, loss, epoch) of the open group
        self.group_samples = 0
        self.version = 0                             # updates applied so far
        self.measure = [[] for _ in range(self.workers)]   # dbs-sgd: (count, compute seconds) since the last re-plan
        self.rows = {k: [] for k in ("staleness", "worker", "time", "local_batch", "loss", "epoch", "version",
                                     "timestamp")}
        epochs = cfg.epochs
        self.applied = np.zeros(epochs, dtype=np.int64)       # samples applied, per epoch of the samples
        self.vectors = np.zeros((epochs, self.workers), dtype=np.int64)
        self.stats = np.zeros((epochs, S_VECTOR + self.workers))
        self.closed = 0                              # epochs whose samples have all been applied
        self.snapshots: list[np.ndarray] = []       # weights at the end of every closed epoch
        self.ends: list[float] = []                 # seconds since the start at which each epoch closed
        self.updates_at_close = 0
        self.messages = 0
        self.max_messages = epochs * (self.cursor.per_epoch + self.workers *
                                      sharding.steps_per_epoch(num_samples, cfg.global_batch, cfg.drop_last)) + 1

    # --- clocks ------------------------------------------------------------------
    def _charge(self, column: int, seconds: float) -> None:
        self.stats[min(self.closed, len(self.stats) - 1), column] += seconds

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # --- the loop ----------------------------------------------------------------
    def run(self) -> np.ndarray:
        self.t0 = time.perf_counter()
        for w in range(self.workers):              # everybody's first work, in worker order
            self.reply(w)
        pause, idle_since = mpi.POLL_SLEEP_MIN, time.perf_counter()
        # Bounded: every pass either takes in at least one gradient (at most max_messages
        # in all) or sleeps; comm_timeout seconds without any gradient raise CommTimeout.
        while not all(self.stopped):
            t = time.perf_counter()
            done = MPI.Request.Testsome(self.recvs)
            if not done:
                if all(r == MPI.REQUEST_NULL for r in self.recvs):   # would wait forever: a bug, say so
                    raise RuntimeError("parameter server: no receive posted but workers "
                                       f"{[w + 1 for w in range(self.workers) if not self.stopped[w]]} not stopped")
                if t - idle_since > self.timeout:
                    raise CommTimeout(f"parameter server: no gradient for {self.timeout:g} s (workers "
                                      f"{[w + 1 for w in range(self.workers) if self.outstanding[w]]} "
                                      f"are computing); raise comm_timeout if a step can take that long")
                time.sleep(pause)
                pause = min(2 * pause, mpi.POLL_SLEEP_MAX)
                self._charge(C_WAIT, time.perf_counter() - t)
                continue
            self._charge(C_COMM, time.perf_counter() - t)
            for w in sorted(done):
                self.recvs[w] = MPI.REQUEST_NULL
                self.receive(w)
            pause, idle_since = mpi.POLL_SLEEP_MIN, time.perf_counter()
        t = time.perf_counter()
        for w in range(self.workers):
            mpi.wait(self.sends[w], self.timeout, "parameter server: last reply")
        self._charge(C_COMM, time.perf_counter() - t)
        # Invariants of the protocol: nothing in flight, nothing half-applied.
        assert all(r == MPI.REQUEST_NULL for r in self.recvs), "a receive is still posted"
        assert not self.group and not self.deferred and not any(self.outstanding), "work left over"
        self._close_epochs(final=True)
        return self.stats

    def receive(self, w: int) -> None:
        """Take in worker w's gradient; apply when the group is full; reply."""
        t = time.perf_counter()
        self.messages += 1
        if self.messages > self.max_messages:
            raise RuntimeError(f"parameter server: more than {self.max_messages} gradients for this budget")
        msg, a = self.grads[w], self.outstanding[w]
        timestamp, count = int(msg.header[G_VERSION]), int(msg.header[G_COUNT])
        if a is None or timestamp != a.version or count != a.count:
            raise RuntimeError(f"parameter server: worker {w + 1} sent (version {timestamp}, {count} samples) "
                               f"but was given {a}")
        self.outstanding[w] = None
        self.arrived[w] = t
        tau = self.version - timestamp            # the version does not change until the group is applied
        scale = 1.0 / max(tau, 1) if self.cfg.staleness_lr else 1.0
        if count:
            self.acc.add_(msg.body, alpha=count * scale)
        self.group_samples += count
        self.group.append((w, timestamp, count, float(msg.header[G_LOSS]), a.epoch))
        if count:
            self.measure[w].append((count, float(msg.header[G_COMPUTE])))
        self._charge(C_COMPUTE, time.perf_counter() - t)
        full = len(self.group) >= self.c
        if full:
            self.apply()
        if not self.wait_mode:
            self.reply(w)                         # at once: the current weights, applied or not
        else:
            self.deferred.append(w)
            if full:
                self._reply_deferred()
        if self.group and not any(self.outstanding):
            # Nobody is computing, so the group cannot fill any more (no work is left):
            # apply what there is, and answer the workers that wait for it.
            self.apply()
            self._reply_deferred()

    def _reply_deferred(self) -> None:
        deferred, self.deferred = sorted(self.deferred), []
        for w in deferred:
            self.reply(w)

    def apply(self) -> None:
        t = time.perf_counter()
        if self.group_samples:
            self.acc.div_(self.divisor or self.group_samples)
            self.optimizer.step()
        at = self._elapsed()
        for w, timestamp, count, loss, epoch in self.group:
            self.rows["staleness"].append(self.version - timestamp)
            self.rows["worker"].append(w + 1)
            self.rows["time"].append(at)
            self.rows["local_batch"].append(count)
            self.rows["loss"].append(loss)
            self.rows["epoch"].append(epoch)
            self.rows["version"].append(self.version)
            self.rows["timestamp"].append(timestamp)
            self.applied[epoch] += count
        self.version += 1
        self.acc.zero_()
        self.group, self.group_samples = [], 0
        self._charge(C_COMPUTE, time.perf_counter() - t)
        self._close_epochs()

    def _out_of_work(self) -> bool:
        return self.cursor.done or (self.cfg.time_budget > 0 and self._elapsed() >= self.cfg.time_budget)

    def reply(self, w: int) -> None:
        """Send worker w its next work (current weights) or STOP."""
        t = time.perf_counter()
        mpi.wait(self.sends[w], self.timeout, "parameter server: previous reply")   # reply buffer free again
        msg = self.replies[w]
        msg.header[:] = 0.0
        msg.header[W_HELD] = t - self.arrived[w] if self.arrived[w] else 0.0
        if self._out_of_work():
            msg.header[W_COMMAND] = CMD_STOP
            self.stopped[w] = True
            self.sends[w] = self.comm.Isend(msg.head, w + 1, TAG_WORK)
        else:
            if self.cursor.needs_epoch:
                self._begin_epoch()
            epoch, start, count = self.cursor.take(w)
            self.outstanding[w] = Assignment(epoch, start, count, self.version)
            msg.header[W_COMMAND] = CMD_WORK
            msg.header[W_VERSION], msg.header[W_EPOCH] = self.version, epoch
            msg.header[W_START], msg.header[W_COUNT] = start, count
            msg.body.copy_(self.weights)
            # The receive for the answer is posted before the work leaves: one receive
            # per WORK message, none after a STOP.
            self.recvs[w] = self.comm.Irecv(self.grads[w].whole, w + 1, TAG_GRAD)
            self.sends[w] = self.comm.Isend(msg.whole, w + 1, TAG_WORK)
        self._charge(C_COMM, time.perf_counter() - t)

    def _begin_epoch(self) -> None:
        """The cursor enters a new epoch: dbs-sgd re-plans the local batches first."""
        epoch = self.cursor.epoch
        if self.controller is not None and epoch > 0:
            counts = [[c for c, _ in m] for m in self.measure]
            rows = max(len(c) for c in counts)
            if rows:
                table = np.zeros((rows, self.workers))
                for w, c in enumerate(counts):
                    table[:len(c), w] = c
                measured = [sum(t for _, t in m) for m in self.measure]
                new, _ = self.controller.update(self.vector, table, measured)
                if not np.array_equal(new, self.vector):
                    self.log(f"dbs-sgd: local batches {self.vector.tolist()} -> {new.tolist()} for epoch {epoch + 1}")
                self.vector = np.asarray(new, dtype=np.int64)
            self.measure = [[] for _ in range(self.workers)]
        self.cursor.begin_epoch(self.vector)
        self.vectors[epoch] = self.vector

    def _close_epochs(self, final: bool = False) -> None:
        """Epoch e ends when all its samples, and all of the epochs before, are applied.
        With a time budget the last epoch may end short (final=True, at the end)."""
        while self.closed < self.cfg.epochs:
            e = self.closed
            full = self.applied[e] >= self.cursor.per_epoch
            if not (full or (final and self.applied[e] > 0)):
                break
            end = self._elapsed()
            rows = np.asarray(self.rows["epoch"]) == e
            staleness = np.asarray(self.rows["staleness"])[rows]
            counts = np.asarray(self.rows["local_batch"], dtype=np.float64)[rows]
            losses = np.asarray(self.rows["loss"])[rows]
            mean, high, pct = staleness_stats(staleness)
            s = self.stats[e]
            s[S_LOSS] = float((losses * counts).sum() / max(counts.sum(), 1))
            s[S_DURATION] = end - (self.ends[-1] if self.ends else 0.0)
            s[S_UPDATES] = self.version - self.updates_at_close
            s[S_STALE_MEAN], s[S_STALE_MAX] = mean, high
            s[S_P50], s[S_P90], s[S_P99] = pct
            s[S_VECTOR:] = self.vectors[e]
            s[C_SAMPLES] = self.applied[e]
            s[C_GRADIENTS] = rows.sum()
            self.ends.append(end)
            self.updates_at_close = self.version
            self.snapshots.append(self.weights.numpy().copy())
            self.closed += 1
            self.log(f"epoch {e + 1}/{self.cfg.epochs} trained: train loss {s[S_LOSS]:.4f}, {int(s[S_UPDATES])} "
                     f"updates, staleness mean {mean:.2f} max {int(high)}, time {s[S_DURATION]:.2f} s, "
                     f"local batches {self.vectors[e].tolist()}")


class Worker:
    """Ranks 1..n-1: wait for work, compute the gradient, push it, repeat until STOP."""

    def __init__(self, pcomm, cfg, model, train_set, emulator):
        self.comm, self.cfg, self.model, self.train_set, self.emulator = pcomm, cfg, model, train_set, emulator
        self.timeout = cfg.comm_timeout
        params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in params)
        self.weights = Message(self.numel)    # TAG_WORK lands here: the parameters are views of its body
        self.grad = Message(self.numel)       # autograd accumulates into its body: pushed as it is
        bind_parameters(params, self.weights.body)
        bind_gradients(params, self.grad.body)
        self.stats = np.zeros((cfg.epochs, S_VECTOR + pcomm.Get_size() - 1))
        self.steps_per_epoch = sharding.steps_per_epoch(len(train_set), cfg.global_batch, cfg.drop_last)
        self.max_messages = cfg.epochs * (len(train_set) + (pcomm.Get_size() - 1) * self.steps_per_epoch) + 1

    def run(self) -> np.ndarray:
        x_all, y_all = self.train_set.x, self.train_set.y
        perm, perm_epoch, epoch = None, -1, 0
        recv = self.comm.Irecv(self.weights.whole, 0, TAG_WORK)
        header = self.weights.header
        t_push, first = time.perf_counter(), True
        # Bounded: one pass per WORK message, and the server sends at most max_messages.
        for _ in range(self.max_messages):
            mpi.wait(recv, self.timeout, "waiting for the parameter server")
            exchange = time.perf_counter() - t_push
            held = exchange if first else min(float(header[W_HELD]), exchange)   # the start: all waiting
            first = False
            self.stats[epoch, C_WAIT] += held
            self.stats[epoch, C_COMM] += exchange - held
            if header[W_COMMAND] == CMD_STOP:
                return self.stats
            version, epoch = header[W_VERSION], int(header[W_EPOCH])
            start, count = int(header[W_START]), int(header[W_COUNT])
            t0 = time.perf_counter()
            if epoch != perm_epoch:
                perm = torch.from_numpy(sharding.epoch_permutation(len(self.train_set), epoch, self.cfg.seed))
                perm_epoch = epoch
                # Disturbances follow the epoch of the samples; the per-step share of an
                # epoch's extra sleep assumes the synchronous step count (an approximation:
                # a fast asgd worker computes more gradients per epoch).
                self.emulator.start_epoch(epoch, self.steps_per_epoch)
            idx = perm[start:start + count]
            x, y = x_all[idx], y_all[idx]
            t1 = time.perf_counter()
            self.grad.body.zero_()
            loss_value = 0.0
            if count:
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                loss_value = loss.item()
                self.emulator.stretch(time.perf_counter() - t1)
            t2 = time.perf_counter()
            h = self.grad.header
            h[:] = 0.0
            h[G_VERSION], h[G_COUNT], h[G_LOSS], h[G_COMPUTE] = version, count, loss_value, t2 - t1
            s = self.stats[epoch]
            s[C_DATA] += t1 - t0
            s[C_COMPUTE] += t2 - t1
            s[C_SAMPLES] += count
            s[C_GRADIENTS] += 1
            # The weights are not needed any more: post the receive for the reply into
            # them, then push (the server answers every push with WORK or STOP).
            t_push = time.perf_counter()
            recv = self.comm.Irecv(self.weights.whole, 0, TAG_WORK)
            mpi.wait(self.comm.Isend(self.grad.whole, 0, TAG_GRAD), self.timeout, "pushing a gradient")
        raise RuntimeError(f"worker {self.comm.Get_rank()}: more than {self.max_messages} work messages")


def _warm_up_optimizer() -> None:
    """torch's first optimizer step imports a lot (seconds): do it before the clocks start,
    on a throwaway parameter."""
    dummy = torch.zeros(1, requires_grad=True)
    dummy.grad = torch.zeros(1)
    torch.optim.SGD([dummy], lr=0.1, momentum=0.9).step()


def _check_model(model) -> None:
    if any(b.is_floating_point() for b in model.buffers()):
        raise UserError("model: the asynchronous strategies keep no buffers (BatchNorm statistics) on the "
                        "server; use norm = \"group\"")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise UserError("model: the parameter server supports float32 parameters only")


def initial_vector(comm, cfg, model, train_set, emulator, writer):
    """Local batches of the workers (sum = global_batch), and dbs-sgd's controller."""
    from .train import startup_benchmark
    workers = comm.Get_size() - 1
    max_local = cfg.max_local_batch or None
    if cfg.strategy != "dbs-sgd":
        return allocation.equal(cfg.global_batch, workers, cfg.min_local_batch, max_local), None
    # Every rank (the server too: the benchmark is a collective) times itself at two
    # local batches; the workers' part of the fit sizes their local batches.
    fit, bench_batches, bench_times = startup_benchmark(comm, cfg, model, train_set, emulator)
    writer.write("startup/local_batch", bench_batches)
    writer.write("startup/step_time", bench_times)
    speed_model = allocation.SpeedModel(fit.per_sample[1:].copy(), fit.overhead[1:].copy())
    controller = allocation.DBSController(
        model=speed_model, global_batch=cfg.global_batch, min_local=cfg.min_local_batch, max_local=max_local,
        smoothing=cfg.dbs_smoothing, follow=cfg.dbs_follow, min_gain=cfg.dbs_min_gain)
    return speed_model.allocate(cfg.global_batch, cfg.min_local_batch, max_local), controller


def train_async(comm, cfg, model, train_set, test_set, emulator, writer, summary, log, sleep_wait) -> None:
    """Run cfg.strategy (asgd | nsoftsync | dbs-sgd) on comm: rank 0 serves, the others
    work. Fills summary.epochs on every rank; rank 0 writes the records. Waiting ranks
    always sleep between polls (sleep_wait is not needed: the protocol never spins)."""
    from .train import evaluate
    rank, world = comm.Get_rank(), comm.Get_size()
    workers = world - 1
    mpi.agree(comm, _check_model, model)
    vector, controller = initial_vector(comm, cfg, model, train_set, emulator, writer)
    writer.write("startup/batch_sizes", np.concatenate([[0], vector]).astype(np.int64))
    c = group_size(cfg.strategy, workers, cfg.softsync_n)
    mode = "immediate" if not (cfg.strategy == "nsoftsync" and cfg.softsync_wait) else (
        "rounds (hardsync)" if c == workers else "wait")
    log(f"{cfg.strategy}: 1 server + {workers} worker(s), {c} gradient(s) per update, replies {mode}, "
        f"local batches {vector.tolist()}" + (", learning rate / staleness" if cfg.staleness_lr else "")
        + (f", time budget {cfg.time_budget:g} s" if cfg.time_budget else ""))

    pcomm = comm.Dup()              # the protocol's own context: its tags meet no other message
    server = Server(pcomm, cfg, model, len(train_set), vector, controller, log) if rank == 0 else None
    worker = Worker(pcomm, cfg, model, train_set, emulator) if rank > 0 else None
    mpi.barrier(comm, cfg.comm_timeout)    # everybody set up: the clocks start now
    stats = server.run() if server is not None else worker.run()
    # Everybody is out of the protocol; a message still queued would be a protocol bug.
    mpi.barrier(pcomm, cfg.comm_timeout)
    stray = float(pcomm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))
    pcomm.Free()
    closed = server.closed if server is not None else 0
    flags = mpi.allgather_array(comm, [closed, stray], cfg.comm_timeout)
    if flags[:, 1].any():
        raise RuntimeError(f"parameter server protocol: unmatched message(s) on rank(s) "
                           f"{np.flatnonzero(flags[:, 1]).tolist()}")
    epochs = int(flags[0, 0])
    gathered = mpi.allgather_array(comm, stats, cfg.comm_timeout)      # (world, epochs, K)

    # Evaluate the server's weights at the end of every epoch, all ranks together.
    params = [p for p in model.parameters()]
    flat = server.weights if server is not None else torch.cat([p.data.reshape(-1) for p in params])
    if server is None:
        bind_parameters(params, flat)
    final = flat.clone() if server is not None else None
    results = []
    for e in range(epochs):
        if server is not None:
            flat.copy_(torch.from_numpy(server.snapshots[e]))
        mpi.wait(comm.Ibcast([flat.numpy(), MPI.FLOAT], root=0), cfg.comm_timeout, "broadcasting weights")
        t = time.perf_counter()
        results.append((*evaluate(comm, cfg, model, test_set), time.perf_counter() - t))
    if server is not None:
        assert torch.equal(flat, final), "the last epoch's weights are the final weights"
    for p in params:                 # leave plain parameters behind (no views of protocol buffers)
        p.grad = None

    records = []
    for e in range(epochs):
        s = gathered[0, e]
        compute, samples = gathered[:, e, C_COMPUTE], gathered[:, e, C_SAMPLES]
        speed = np.where(compute > 0, samples / np.maximum(compute, 1e-12), 0.0)
        speed[0] = 0.0
        test_loss, test_acc, eval_time = results[e]
        record = dict(
            train_loss=float(s[S_LOSS]), test_loss=test_loss, test_accuracy=test_acc,
            duration=float(s[S_DURATION]), eval_time=eval_time,
            batch_sizes=np.concatenate([[0], s[S_VECTOR:S_VECTOR + workers]]).astype(np.int64),
            compute_time=gathered[:, e, C_COMPUTE], comm_time=gathered[:, e, C_COMM],
            wait_time=gathered[:, e, C_WAIT], data_time=gathered[:, e, C_DATA], speed=speed,
            samples=np.int64(s[C_SAMPLES]), updates=np.int64(s[S_UPDATES]),
            gradients=np.concatenate([[s[C_GRADIENTS]], gathered[1:, e, C_GRADIENTS]]).astype(np.int64),
            staleness_mean=float(s[S_STALE_MEAN]), staleness_max=float(s[S_STALE_MAX]),
            **{f"staleness_p{q}": float(s[S_P50 + i]) for i, q in enumerate(PERCENTILES)})
        records.append(record)
        writer.append_epoch(record, {})
        log(f"epoch {e + 1}/{cfg.epochs}  train loss {record['train_loss']:.4f}  test loss {test_loss:.4f}  "
            f"accuracy {100 * test_acc:.2f}%  time {record['duration']:.2f} s  staleness mean "
            f"{record['staleness_mean']:.2f} max {int(record['staleness_max'])}  "
            f"batch sizes {record['batch_sizes'].tolist()}")
    summary.epochs.extend(records)

    if server is not None:
        rows = server.rows
        for name, dtype in (("staleness", np.int64), ("worker", np.int64), ("time", np.float64),
                            ("local_batch", np.int64), ("loss", np.float64), ("epoch", np.int64),
                            ("version", np.int64), ("timestamp", np.int64)):
            writer.write(f"update/{name}", np.asarray(rows[name], dtype=dtype))
        mean, high, pct = staleness_stats(rows["staleness"])
        writer.set_attrs(staleness_mean=mean, staleness_max=high,
                         staleness_percentiles=np.asarray(pct), staleness_percentile_levels=np.asarray(PERCENTILES),
                         updates=server.version, gradients=len(rows["staleness"]), gradients_per_update=c,
                         reply_mode=mode, training_time=float(server.ends[-1]) if epochs else 0.0)
        log(f"staleness over {len(rows['staleness'])} gradients in {server.version} updates: mean {mean:.2f}, "
            f"p50 {pct[0]:g}, p90 {pct[1]:g}, p99 {pct[2]:g}, max {int(high)}")
