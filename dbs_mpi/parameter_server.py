"""Asynchronous strategies on a parameter server over MPI: asgd, nsoftsync, dbs-sgd.

Rank 0 is the server: it holds the parameters and applies every update (cfg.optimizer:
SGD with momentum by default, Adam or AdamW; cfg.lr). Ranks 1..n-1 are the workers (lambda = n - 1 learners): a worker
gets weights and a piece of work, computes the gradient on its local batch, pushes
it and waits for the next weights. docs/method.md, "Asynchronous strategies", has the
rules with their sources: Zhang et al. (IJCAI 2016) for asgd / n-softsync and the
staleness-dependent learning rate, Ji et al. for dbs-sgd.

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
             times the workers report with their gradients; dynamic.DBSController:
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
the weights are copied then, and each copy is evaluated on the test set by all ranks
together at the end of the segment ("Checkpoints" below: at the next checkpoint
boundary, or after the run), with the training clock stopped, so evaluation is not in
epoch times and never interrupts a segment.

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

Not supported here: models with floating-point buffers (BatchNorm statistics: use
norm = "group").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from mpi4py import MPI

from . import allocation, checkpoint, comm as mpi, dynamic, sharding, startup
from .balancer import calibrate, calibration_batches
from .comm import CommTimeout
from .config import UserError
from .data import fetch_batch, first_samples
from .devices import model_device, to_device
from .heterogeneity import Emulator
from .optimizer import make_optimizer
from .profiling import model_step
from .sharding import Cursor  # noqa: F401  (the samples a worker gets; re-exported)

TAG_WORK = 1    # server -> worker: header + weights (WORK), or header only (STOP)
TAG_GRAD = 2    # worker -> server: header + gradient

HEADER = 8                                                  # float64 slots at the front of every message
W_COMMAND, W_VERSION, W_EPOCH, W_START, W_COUNT, W_HELD = range(6)   # TAG_WORK header
G_VERSION, G_COUNT, G_LOSS, G_COMPUTE, G_SIGNAL = range(5)            # TAG_GRAD header
CMD_STOP, CMD_WORK = 0.0, 1.0
# Why a segment of the protocol ended (Server.run's answer; see "Checkpoints" above).
END_DONE, END_CHECKPOINT, END_STOP = 1, 2, 3

# Per-rank, per-epoch statistics gathered at the end: columns of one (epochs, K) array.
C_COMPUTE, C_COMM, C_WAIT, C_DATA, C_SAMPLES, C_GRADIENTS = range(6)   # every rank
S_LOSS, S_DURATION, S_UPDATES, S_STALE_MEAN, S_STALE_MAX, S_P50, S_P90, S_P99 = range(6, 14)  # server only
S_VECTOR = 14                                                          # server only: lambda local batches
PERCENTILES = (50, 90, 99)


class Message:
    """One flat float32 message: `header` (float64 view of the front) and `body` (a torch
    view of the P values after it). `whole` and `head` are what Send/Recv take."""

    def __init__(self, numel: int, pinned: bool = False):
        self.tensor = torch.zeros(2 * HEADER + numel, dtype=torch.float32, pin_memory=pinned)
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


def server_momentum(cfg, workers: int, c: int) -> float:
    """The server's SGD momentum. Asynchrony itself acts like momentum (Mitliagkas et al.,
    "Asynchrony begets momentum", 2016): with q = lambda / c updates in flight it adds about
    1 - 1/q, so the server subtracts that from cfg.momentum (implicit_momentum; at least 0)
    to keep the total near what a synchronous run uses. asgd and dbs-sgd at lambda = 3:
    0.9 - 2/3 = 0.23; hardsync (c = lambda): 0.9."""
    if not cfg.implicit_momentum or cfg.optimizer != "sgd":
        return cfg.momentum
    in_flight = workers / max(c, 1)
    return max(0.0, cfg.momentum - (1.0 - 1.0 / in_flight))


def group_size(strategy: str, workers: int, softsync_n: int) -> int:
    """c: gradients per update. asgd and dbs-sgd: 1; nsoftsync: floor(lambda / n) (at least 1)."""
    if strategy == "nsoftsync":
        return max(1, workers // softsync_n)
    return 1


def in_rounds(strategy: str, softsync_wait: bool, softsync_n: int, workers: int) -> bool:
    """Rounds (hardsync): nsoftsync waiting for its updates with c = lambda, every worker's
    gradient in every update."""
    return strategy == "nsoftsync" and bool(softsync_wait) and group_size(strategy, workers, softsync_n) == workers


def staleness_stats(staleness) -> tuple[float, float, list[float]]:
    """(mean, max, [p50, p90, p99]) of an array of staleness values; zeros if empty."""
    s = np.asarray(staleness, dtype=np.float64)
    if s.size == 0:
        return 0.0, 0.0, [0.0] * len(PERCENTILES)
    return float(s.mean()), float(s.max()), [float(v) for v in np.percentile(s, PERCENTILES)]


@dataclass
class Assignment:
    epoch: int
    start: int
    count: int
    version: int       # server version of the weights sent with it


class Server:
    """Rank 0: applies updates, hands out work, records every applied gradient."""

    def __init__(self, pcomm, cfg, model, num_samples: int, vector, controller, log, stop=None):
        self.comm, self.cfg, self.model, self.log, self.stop = pcomm, cfg, model, log, stop
        self.workers = pcomm.Get_size() - 1
        self.timeout = cfg.comm_timeout
        params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in params)
        self.weights = torch.zeros(self.numel, dtype=torch.float32)
        self.acc = torch.zeros(self.numel, dtype=torch.float32)     # sum_i s_i b_i g_i, then the update's g
        bind_parameters(params, self.weights)
        bind_gradients(params, self.acc)
        self.c = group_size(cfg.strategy, self.workers, cfg.softsync_n)
        self.momentum = server_momentum(cfg, self.workers, self.c)
        self.optimizer = make_optimizer(cfg.optimizer, params, replace(cfg, momentum=self.momentum))
        _warm_up_optimizer()
        self.wait_mode = cfg.strategy == "nsoftsync" and cfg.softsync_wait
        rounds = in_rounds(cfg.strategy, cfg.softsync_wait, cfg.softsync_n, self.workers)
        # Divisor of an update's sample-weighted gradient sum (None: the group's samples);
        # aggregation "mean": every gradient counts once, the group's mean (docs/method.md).
        self.divisor = None if rounds else self.c * cfg.global_batch / self.workers
        self.per_gradient = cfg.aggregation == "mean"
        self.before = torch.empty_like(self.weights)   # the weights before an update (its step's norm)
        self.cursor = Cursor(num_samples, cfg.global_batch, cfg.epochs, cfg.drop_last, self.workers, rounds)
        self.vector = np.asarray(vector, dtype=np.int64)
        self.controller = controller                 # dbs-sgd: re-plans self.vector at every epoch
        self.grads = [Message(self.numel) for _ in range(self.workers)]
        self.replies = [Message(self.numel) for _ in range(self.workers)]
        self.recvs = [MPI.REQUEST_NULL] * self.workers
        self.sends = [MPI.REQUEST_NULL] * self.workers
        self.outstanding: list[Assignment | None] = [None] * self.workers
        self.sent_at = [0.0] * self.workers         # when each worker's outstanding work was sent
        self.arrived = [0.0] * self.workers          # when each worker's last gradient was taken in
        self.stopped = [False] * self.workers
        self.deferred: list[int] = []                # wait mode: workers whose gradient is in the open group
        self.group: list[tuple] = []                 # (worker, timestamp, count, loss, epoch) of the open group
        self.group_samples = 0
        self.version = 0                             # updates applied so far
        self.measure = [[] for _ in range(self.workers)]   # dbs-sgd: (count, compute seconds) since the last re-plan
        self.rows = {k: [] for k, _ in UPDATE_COLUMNS}
        epochs = cfg.epochs
        self.applied = np.zeros(epochs, dtype=np.int64)       # samples applied, per epoch of the samples
        self.vectors = np.zeros((epochs, self.workers), dtype=np.int64)
        self.stats = np.zeros((epochs, S_VECTOR + self.workers))
        self.closed = 0                              # epochs whose samples have all been applied
        self.written = 0                             # closed epochs evaluated and in the result file
        self.rows_written = 0                        # update rows in the result file
        self.snapshots: dict[int, np.ndarray] = {}  # weights at the end of closed, unwritten epochs
        self.ends: list[float] = []                 # seconds since the start at which each epoch closed
        self.updates_at_close = 0
        self.messages = 0
        self.clock = 0.0                             # training seconds before this segment
        self.signal = 0                              # stop signal (own or a worker's): drain and stop
        self.segment_epoch = 0                       # cursor epoch when this segment began
        self.max_messages = epochs * (self.cursor.per_epoch + self.workers *
                                      sharding.steps_per_epoch(num_samples, cfg.global_batch, cfg.drop_last)) + 1

    # --- clocks ------------------------------------------------------------------
    def _charge(self, column: int, seconds: float) -> None:
        self.stats[min(self.closed, len(self.stats) - 1), column] += seconds

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # --- the loop ----------------------------------------------------------------
    def run(self) -> int:
        """One segment of the protocol: hand out work until every worker has had STOP.
        Returns why it ended: END_DONE (budget used up), END_CHECKPOINT (an epoch boundary
        where a checkpoint is due) or END_STOP (a stop request). The clock runs only here."""
        self.t0 = time.perf_counter() - self.clock
        self.segment_epoch = self.cursor.epoch
        self.stopped = [False] * self.workers
        self.arrived = [0.0] * self.workers
        for w in range(self.workers):              # everybody's first work, in worker order
            self.reply(w)
        pause = mpi.POLL_SLEEP_MIN
        # Bounded: every pass either takes in at least one gradient (at most max_messages
        # in all) or sleeps; a worker that holds its work longer than comm_timeout raises
        # CommTimeout (_check_workers).
        mpi.SUPERVISOR.waiting = "the parameter server's loop"
        while not all(self.stopped):
            t = time.perf_counter()
            self._check_workers(t)
            if not self.signal and self.stop is not None and self.stop.requested:
                self._stop_requested(self.stop.requested, "the server")
            done = MPI.Request.Testsome(self.recvs)
            if not done:
                if all(r == MPI.REQUEST_NULL for r in self.recvs):   # would wait forever: a bug, say so
                    raise RuntimeError("parameter server: no receive posted but workers "
                                       f"{[w + 1 for w in range(self.workers) if not self.stopped[w]]} not stopped")
                time.sleep(pause)
                pause = min(2 * pause, mpi.POLL_SLEEP_MAX)
                self._charge(C_WAIT, time.perf_counter() - t)
                continue
            self._charge(C_COMM, time.perf_counter() - t)
            for w in sorted(done):
                self.recvs[w] = MPI.REQUEST_NULL
                self.receive(w)
            pause = mpi.POLL_SLEEP_MIN
        mpi.SUPERVISOR.waiting = None
        t = time.perf_counter()
        for w in range(self.workers):
            mpi.wait(self.sends[w], self.timeout, "parameter server: last reply")
        self._charge(C_COMM, time.perf_counter() - t)
        # Invariants of the protocol: nothing in flight, nothing half-applied.
        assert all(r == MPI.REQUEST_NULL for r in self.recvs), "a receive is still posted"
        assert not self.group and not self.deferred and not any(self.outstanding), "work left over"
        end = END_DONE if self._out_of_work() else END_STOP if self.signal else END_CHECKPOINT
        if end == END_DONE:
            self._close_epochs(final=True)
        self.clock = self._elapsed()
        return end

    def _check_workers(self, now: float) -> None:
        """A worker that holds work longer than comm_timeout is stuck or dead, even while the
        others keep the server busy: fail (CommTimeout) naming it."""
        late = [w + 1 for w in range(self.workers) if self.outstanding[w] is not None
                and now - self.sent_at[w] > self.timeout]
        if late:
            raise CommTimeout(f"parameter server: worker(s) {late} sent no gradient for more than {self.timeout:g} s "
                              f"after being given work: stuck or dead (raise comm_timeout if a step can take "
                              f"that long)")

    def _stop_requested(self, signum: int, where: str) -> None:
        """From now on every worker gets STOP at its next push (drain), then all checkpoint."""
        self.signal = int(signum)
        self.log(f"stop requested (signal {self.signal} on {where}): draining the workers")

    def _pausing(self) -> bool:
        """Hand out no more work in this segment: a stop request, or the cursor reached an
        epoch boundary at which a checkpoint is due. Decided per push, so in rounds mode
        (replies to a whole round at once, after one push) a round is never split."""
        if self.signal:
            return True
        c, every = self.cursor, self.cfg.checkpoint_every
        return bool(every) and c.needs_epoch and c.epoch > self.segment_epoch and c.epoch % every == 0

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
        if msg.header[G_SIGNAL] and not self.signal:
            self._stop_requested(int(msg.header[G_SIGNAL]), f"worker {w + 1}")
        tau = self.version - timestamp            # the version does not change until the group is applied
        scale = 1.0 / max(tau, 1) if self.cfg.staleness_lr else 1.0
        weight = (1.0 if self.per_gradient else count) * scale if count else 0.0
        if count:
            self.acc.add_(msg.body, alpha=weight)
        self.group_samples += count
        self.group.append((w, timestamp, count, float(msg.header[G_LOSS]), a.epoch, weight))
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
        divisor, step_norm = self.update_divisor(), 0.0
        if self.group_samples:
            self.acc.div_(divisor)
            self.before.copy_(self.weights)
            self.optimizer.step()
            step_norm = float(self.before.sub_(self.weights).norm())
        at = self._elapsed()
        for w, timestamp, count, loss, epoch, weight in self.group:
            self.rows["weight"].append(weight / divisor)
            self.rows["step_norm"].append(step_norm)
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

    def update_divisor(self) -> float:
        """What the group's weighted gradient sum is divided by: per gradient ("mean"), the
        gradients with samples; sample-weighted, c B / lambda (or, in rounds, the samples)."""
        if self.per_gradient:
            return float(max(1, sum(1 for g in self.group if g[2])))
        return float(self.divisor or max(self.group_samples, 1))

    def _out_of_work(self) -> bool:
        return self.cursor.done or (self.cfg.time_budget > 0 and self._elapsed() >= self.cfg.time_budget)

    def reply(self, w: int) -> None:
        """Send worker w its next work (current weights) or STOP."""
        t = time.perf_counter()
        mpi.wait(self.sends[w], self.timeout, "parameter server: previous reply")   # reply buffer free again
        msg = self.replies[w]
        msg.header[:] = 0.0
        msg.header[W_HELD] = t - self.arrived[w] if self.arrived[w] else 0.0
        if self._out_of_work() or self._pausing():
            msg.header[W_COMMAND] = CMD_STOP
            self.stopped[w] = True
            self.sends[w] = self.comm.Isend(msg.head, w + 1, TAG_WORK)
        else:
            if self.cursor.needs_epoch:
                self._begin_epoch()
            epoch, start, count = self.cursor.take(w)
            self.outstanding[w] = Assignment(epoch, start, count, self.version)
            self.sent_at[w] = t
            msg.header[W_COMMAND] = CMD_WORK
            msg.header[W_VERSION], msg.header[W_EPOCH] = self.version, epoch
            msg.header[W_START], msg.header[W_COUNT] = start, count
            msg.body.copy_(self.weights)
            # The receive for the answer is posted before the work leaves: one receive
            # per WORK message, none after a STOP.
            self.recvs[w] = self.comm.Irecv(self.grads[w].whole, w + 1, TAG_GRAD)
            self.sends[w] = self.comm.Isend(msg.whole, w + 1, TAG_WORK)
        self._charge(C_COMM, time.perf_counter() - t)

    # --- checkpoints ---------------------------------------------------------------
    STATE = ("version", "vector", "controller", "measure", "rows", "applied", "vectors", "stats", "closed",
             "written", "rows_written", "snapshots", "ends", "updates_at_close", "messages", "clock")

    def state_dict(self) -> dict:
        """Everything needed to continue, taken between segments (nothing in flight);
        arrays and plain types (checkpoint.to_safe stores the arrays as tensors)."""
        state = {k: getattr(self, k) for k in self.STATE}
        state["controller"] = self.controller.state_dict() if self.controller is not None else None
        return {"weights": self.weights.clone(), "optimizer": self.optimizer.state_dict(),
                "cursor": {k: v for k, v in vars(self.cursor).items()}, **state}

    PER_WORKER = ("vector", "controller", "measure")     # what another number of workers re-derives

    def load_state(self, state: dict, moved: bool = False) -> None:
        """Continue from state_dict(); cfg.epochs may have grown (a run extended on resume).
        moved: the state was saved with another number of workers. The version, the data
        cursor's position, the records and the clock carry over; this server's vector and
        dbs-sgd controller (made for the new workers) stay, and the per-worker columns of
        the per-epoch arrays are cut or padded with zeros. The optimizer's state carries over
        with this world's server momentum (another lambda / c)."""
        self.weights.copy_(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:       # load_state_dict brings the saved hyperparameters
            if "momentum" in group:
                group["momentum"] = self.momentum
        epochs = self.cfg.epochs
        for k in self.STATE:
            value = state[k]
            if moved and k in self.PER_WORKER:
                continue
            if k in ("applied", "vectors", "stats"):     # per-epoch arrays: pad to the new epoch count
                value = np.asarray(value)
                mine = getattr(self, k)
                padded = np.zeros((epochs, *mine.shape[1:]), dtype=value.dtype)
                columns = min(value.shape[1], mine.shape[1]) if value.ndim == 2 else None
                if columns is None:
                    padded[:len(value)] = value[:epochs]
                else:
                    padded[:len(value), :columns] = value[:epochs, :columns]
                value = padded
            elif k == "vector":
                value = np.asarray(value, dtype=np.int64).copy()
            elif k == "controller":
                value = None if value is None else dynamic.DBSController.from_state(value)
            elif k == "snapshots":
                value = {int(e): np.asarray(w).copy() for e, w in value.items()}
            elif k == "measure":
                value = [[(int(c), float(t)) for c, t in m] for m in value]
            elif k == "rows":        # a checkpoint of an older version lacks the newer columns
                value = {name: list(value.get(name, [float("nan")] * len(value["staleness"])))
                         for name, _ in UPDATE_COLUMNS}
            setattr(self, k, value)
        cursor = {k: v for k, v in state["cursor"].items() if k != "epochs"}
        for k in ("vector", "table"):
            if cursor.get(k) is not None:
                cursor[k] = np.asarray(cursor[k], dtype=np.int64).copy()
        if moved:       # the position in the data carries over; the split is the new workers'
            cursor = {k: v for k, v in cursor.items() if k not in ("workers", "vector", "table", "next_worker")}
        self.cursor.__dict__.update(cursor)
        if moved and self.cursor.started == self.cursor.epoch:
            self.cursor.begin_epoch(self.vector)    # the epoch's rest (rounds: its remaining steps) for them

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
            self.snapshots[e] = self.weights.numpy().copy()
            self.closed += 1
            self.log(f"epoch {e + 1}/{self.cfg.epochs} trained: train loss {s[S_LOSS]:.4f}, {int(s[S_UPDATES])} "
                     f"updates, staleness mean {mean:.2f} max {int(high)}, time {s[S_DURATION]:.2f} s, "
                     f"local batches {self.vectors[e].tolist()}")


class Worker:
    """Ranks 1..n-1: wait for work, compute the gradient, push it, repeat until STOP."""

    separate_buffers = False    # True: a GPU worker's copies between messages and model on the CPU too (tests)

    def __init__(self, pcomm, cfg, model, train_set, emulator, stop=None, loss_fn=None):
        self.comm, self.cfg, self.model, self.train_set, self.emulator = pcomm, cfg, model, train_set, emulator
        self.loss_fn = loss_fn
        self.stop = stop
        self.timeout = cfg.comm_timeout
        params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in params)
        self.device = model_device(model)
        cuda = self.device.type == "cuda"
        self.weights = Message(self.numel, pinned=cuda)    # TAG_WORK lands here
        self.grad = Message(self.numel, pinned=cuda)       # pushed as it is
        # On the CPU the parameters and their gradients are views of the messages' bodies
        # (no copies); on a GPU they are views of device buffers that the bodies are
        # copied to (weights, after every receive) and from (gradients, before every push).
        if cuda or self.separate_buffers:
            self.device_weights = torch.zeros(self.numel, device=self.device)
            self.device_grad = torch.zeros(self.numel, device=self.device)
        else:
            self.device_weights, self.device_grad = self.weights.body, self.grad.body
        bind_parameters(params, self.device_weights)
        bind_gradients(params, self.device_grad)
        self.stats = np.zeros((cfg.epochs, S_VECTOR + pcomm.Get_size() - 1))
        self.steps_per_epoch = sharding.steps_per_epoch(len(train_set), cfg.global_batch, cfg.drop_last)
        self.max_messages = cfg.epochs * (len(train_set) + (pcomm.Get_size() - 1) * self.steps_per_epoch) + 1
        self.perm, self.perm_epoch, self.epoch = None, -1, 0

    def state_dict(self) -> dict:
        return {"stats": self.stats, "perm_epoch": self.perm_epoch, "epoch": self.epoch}

    def load_state(self, state: dict) -> None:
        stats = np.zeros_like(self.stats)            # cfg.epochs (and the workers) may have changed
        saved = np.asarray(state["stats"])
        columns = min(saved.shape[1], stats.shape[1])
        stats[:len(saved), :columns] = saved[:len(stats), :columns]
        self.stats, self.perm_epoch, self.epoch = stats, state["perm_epoch"], state["epoch"]
        if self.perm_epoch >= 0:
            self.perm = torch.from_numpy(sharding.epoch_permutation(len(self.train_set), self.perm_epoch,
                                                                    self.cfg.seed))

    def run(self) -> None:
        """One segment: compute until the server says STOP (the end, or a checkpoint)."""
        perm, perm_epoch, epoch = self.perm, self.perm_epoch, self.epoch
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
                self.perm, self.perm_epoch, self.epoch = perm, perm_epoch, epoch
                return
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
            self.pull()
            if count:
                x, y = to_device(fetch_batch(self.train_set, idx), self.device)
            t1, cpu = time.perf_counter(), time.process_time()
            self.device_grad.zero_()
            loss_value = 0.0
            if count:
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
                loss_value = loss.item()       # on a GPU: waits for backward (a true compute time)
                self.emulator.stretch(time.perf_counter() - t1, time.process_time() - cpu)
            self.push_copy()
            t2 = time.perf_counter()
            h = self.grad.header
            h[:] = 0.0
            h[G_VERSION], h[G_COUNT], h[G_LOSS], h[G_COMPUTE] = version, count, loss_value, t2 - t1
            h[G_SIGNAL] = self.stop.requested if self.stop is not None else 0   # the server drains
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

    def pull(self) -> None:
        """The received weights into the model (a GPU worker's device copy; nothing on the CPU)."""
        if self.device_weights is not self.weights.body:
            self.device_weights.copy_(self.weights.body, non_blocking=True)

    def push_copy(self) -> None:
        """The computed gradient into the message that is pushed (a GPU worker's host copy)."""
        if self.device_grad is not self.grad.body:
            self.grad.body.copy_(self.device_grad)


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
    small, large = calibration_batches(cfg.global_batch, comm.Get_size(), cfg.min_local_batch, max_local)
    step = model_step(run.model, run.loss_fn, *first_samples(run.train_set, large))
    fit, times = calibrate(comm, step, small, large, steps=cfg.benchmark_steps, warmup=cfg.benchmark_warmup,
                           stretch=emulator.stretch, affine=cfg.dbs_model == "affine", timeout=cfg.comm_timeout)
    timings = {"local_batch": np.array([small, large], dtype=np.int64), "step_time": times}
    speed_model = allocation.SpeedModel(fit.per_sample[1:].copy(), fit.overhead[1:].copy())
    controller = dynamic.DBSController(
        model=speed_model, global_batch=cfg.global_batch, min_local=cfg.min_local_batch, max_local=max_local,
        smoothing=cfg.dbs_smoothing, follow=cfg.dbs_follow, min_gain=cfg.dbs_min_gain)
    return speed_model.allocate(cfg.global_batch, cfg.min_local_batch, max_local), controller, timings


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
        mpi.barrier(comm, cfg.comm_timeout)    # everybody set up: the clocks start now
        # Bounded: every segment but the last hands out at least one epoch boundary's or
        # one stop request's worth of work, and the server's budget ends the run.
        while True:
            end = server.run() if server is not None else worker.run()
            # Everybody is out of the protocol; a message still queued would be a protocol bug.
            mpi.barrier(pcomm, cfg.comm_timeout)
            stray = float(pcomm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))
            closed = server.closed if server is not None else 0
            flags = mpi.allgather_array(comm, [end or 0, closed, stray, self.stop.requested], cfg.comm_timeout)
            if flags[:, 2].any():
                raise RuntimeError(f"parameter server protocol: unmatched message(s) on rank(s) "
                                   f"{np.flatnonzero(flags[:, 2]).tolist()}")
            end = int(flags[0, 0])
            if end != END_DONE and flags[:, 3].any():     # a signal that came after a worker's last push
                end = END_STOP
            self._write_epochs(server, worker, int(flags[0, 1]))
            if end == END_DONE:
                self._finish(server)
            self._save(server, worker)
            if end == END_STOP:
                pcomm.Free()
                self.log(f"stop requested: checkpoint after {self.written} epoch(s) written to {self.path}; "
                         f"continue with: dbs-mpi train --resume {self.summary.path or '<result file>'}")
                raise checkpoint.Stopped()
            if end == END_DONE:
                break
        pcomm.Free()

    def _set_up(self):
        """The server (rank 0) or this rank's worker, new or from the checkpoint, and the
        protocol's communicator."""
        run, comm, cfg, state = self.run, self.comm, self.cfg, self.state
        rank, workers = comm.Get_rank(), comm.Get_size() - 1
        mpi.collective(comm, _check_model, run.model, timeout=cfg.comm_timeout)
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
        with mpi.SUPERVISOR.deadline(comm, cfg.comm_timeout, "creating the protocol's communicator"):
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
        if state is None:
            self.log(f"{cfg.strategy}: 1 server + {workers} worker(s), {self.c} gradient(s) per update, replies "
                     f"{self.mode}, local batches {vector.tolist()}"
                     + (", learning rate / staleness" if cfg.staleness_lr else "")
                     + (f", time budget {cfg.time_budget:g} s" if cfg.time_budget else ""))
        else:
            self.log(f"{cfg.strategy}: resumed after {state['epoch']} epoch(s) and {state['server']['version']} "
                     f"update(s), {state['server']['clock']:.1f} s of training"
                     + (f"; {workers} worker(s) instead of {state['world_size'] - 1}, local batches "
                        f"{vector.tolist()}" if moved else ""))
        self.written = state["epoch"] if state is not None else 0
        return server, worker, pcomm

    def _write_epochs(self, server, worker, closed: int) -> None:
        """Evaluate the weights at the end of every newly closed epoch (all ranks together,
        outside the training clock) and append the epochs' records; rank 0 also appends
        the update rows applied since the last segment."""
        if server is not None:
            rows = server.rows
            for name, dtype in UPDATE_COLUMNS:
                self.writer.append_rows(f"update/{name}", np.asarray(rows[name][server.rows_written:], dtype=dtype),
                                        dtype=dtype)
            server.rows_written = len(rows["staleness"])
        if closed == self.written:
            return
        comm, cfg = self.comm, self.cfg
        stats = server.stats if server is not None else worker.stats
        gathered = mpi.allgather_array(comm, stats, cfg.comm_timeout)      # (world, epochs, K)
        # The model's parameters are views of the protocol buffers: evaluate in place
        # (the server's current weights are put back afterwards).
        flat = server.weights if server is not None else worker.weights.body
        current = flat.clone()
        workers = comm.Get_size() - 1
        for e in range(self.written, closed):
            if server is not None:
                flat.copy_(torch.from_numpy(server.snapshots.pop(e)))
            mpi.wait(comm.Ibcast([flat.numpy(), MPI.FLOAT], root=0), cfg.comm_timeout, "broadcasting weights")
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
            server.written = closed

    def _finish(self, server) -> None:
        """The run is complete: every rank's model gets the final weights as plain
        parameters (no views of protocol buffers); rank 0 writes the run's staleness."""
        params = [p for p in self.run.model.parameters()]
        host = torch.zeros(sum(p.numel() for p in params))
        flat = host if self.run.device.type == "cpu" else torch.zeros(host.shape, device=self.run.device)
        bind_parameters(params, flat)
        mpi.wait(self.comm.Ibcast([host.numpy(), MPI.FLOAT], root=0), self.cfg.comm_timeout, "broadcasting weights")
        if flat is not host:
            flat.copy_(host)
        for p in params:
            p.grad = None
        if server is None:
            return
        rows = server.rows
        mean, high, pct = staleness_stats(rows["staleness"])
        self.writer.set_attrs(staleness_mean=mean, staleness_max=high, staleness_percentiles=np.asarray(pct),
                              staleness_percentile_levels=np.asarray(PERCENTILES), updates=server.version,
                              gradients=len(rows["staleness"]), gradients_per_update=self.c, reply_mode=self.mode,
                              server_momentum=server.momentum,
                              training_time=float(server.ends[-1]) if server.ends else 0.0)
        self.log(f"staleness over {len(rows['staleness'])} gradients in {server.version} updates: mean {mean:.2f}, "
                 f"p50 {pct[0]:g}, p90 {pct[1]:g}, p99 {pct[2]:g}, max {int(high)}")

    def _save(self, server, worker) -> None:
        """Collective: the checkpoint, between segments (nothing in flight, every applied
        gradient and every closed epoch already in the result file)."""
        common = {}
        if server is not None:
            position = [self.written, int(server.applied[self.written]) if self.written < len(server.applied) else 0]
            common = {"config": self.cfg.to_dict(), "world_size": self.comm.Get_size(), "epoch": self.written,
                      "step": 0, "position": position, "server": server.state_dict(),
                      "records": {"epochs": self.written, "steps": 0, "updates": server.rows_written}}
        per_rank = {"rng": checkpoint.rng_state(), "emulator": self.emulator.state_dict(),
                    "worker": worker.state_dict() if worker is not None else None}
        start = time.perf_counter()
        checkpoint.save(self.comm, self.path, common, per_rank, self.cfg.comm_timeout)
        if server is not None:
            self.writer.append_rows("checkpoint/seconds", [time.perf_counter() - start])
            self.writer.append_rows("checkpoint/position", [common["position"]], dtype=np.int64)


UPDATE_COLUMNS = (("staleness", np.int64), ("worker", np.int64), ("time", np.float64), ("local_batch", np.int64),
                  ("loss", np.float64), ("epoch", np.int64), ("version", np.int64), ("timestamp", np.int64),
                  ("weight", np.float64), ("step_norm", np.float64))


def epoch_record(gathered, e: int, workers: int, test_loss: float, test_acc: float, eval_time: float) -> dict:
    """Epoch e's record from every rank's statistics (gathered: (world, epochs, K))."""
    s = gathered[0, e]
    compute, samples = gathered[:, e, C_COMPUTE], gathered[:, e, C_SAMPLES]
    speed = np.where(compute > 0, samples / np.maximum(compute, 1e-12), 0.0)
    speed[0] = 0.0
    return dict(
        train_loss=float(s[S_LOSS]), test_loss=test_loss, test_accuracy=test_acc,
        duration=float(s[S_DURATION]), eval_time=eval_time,
        batch_sizes=np.concatenate([[0], s[S_VECTOR:S_VECTOR + workers]]).astype(np.int64),
        compute_time=gathered[:, e, C_COMPUTE], comm_time=gathered[:, e, C_COMM],
        wait_time=gathered[:, e, C_WAIT], data_time=gathered[:, e, C_DATA], speed=speed,
        samples=np.int64(s[C_SAMPLES]), updates=np.int64(s[S_UPDATES]),
        gradients=np.concatenate([[s[C_GRADIENTS]], gathered[1:, e, C_GRADIENTS]]).astype(np.int64),
        staleness_mean=float(s[S_STALE_MEAN]), staleness_max=float(s[S_STALE_MAX]),
        **{f"staleness_p{q}": float(s[S_P50 + i]) for i, q in enumerate(PERCENTILES)})
