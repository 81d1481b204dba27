"""The parameter server (rank 0): the protocol's loop. It hands out work (work.py),
takes in gradients, lets the update rule (update.py) apply them and answers every push;
the records (records.py) and the checkpointed state (snapshot.py) live beside it.

Every segment runs the protocol until each worker has had STOP; what there is to hand
out, and when to stop, is work.py's.
"""
from __future__ import annotations

import time

import torch

from ..mpi import waits
from ..planning import sharding
from .protocol import END_CHECKPOINT, END_DONE, END_STOP, Assignment, ServerChannels, bind_parameters
from .records import C_COMM, C_COMPUTE, C_WAIT, ServerRecords
from .snapshot import load_server_state, server_state
from .update import UpdateRule
from .work import WorkPlan


class Server:
    """Rank 0: applies updates, hands out work, records every applied gradient."""

    def __init__(self, pcomm, cfg, model, num_samples: int, vector, controller, log, stop=None):
        self.comm, self.cfg, self.log, self.stop = pcomm, cfg, log, stop
        self.workers = pcomm.Get_size() - 1
        self.timeout = cfg.comm_timeout
        params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in params)
        self.weights = torch.zeros(self.numel, dtype=torch.float32)
        bind_parameters(params, self.weights)
        self.rule = UpdateRule(cfg, params, self.weights, self.workers)
        self.wait_mode = cfg.strategy == "nsoftsync" and cfg.softsync_wait
        self.plan = WorkPlan(cfg, num_samples, self.workers, vector, controller, log)
        self.records = ServerRecords(cfg.epochs, self.workers)
        self.channels = ServerChannels(pcomm, self.workers, self.numel, self.timeout)
        self.arrived = [0.0] * self.workers          # when each worker's last gradient was taken in
        self.stopped = [False] * self.workers
        self.deferred: list[int] = []                # wait mode: workers whose gradient is in the open group
        self.messages = 0
        self.clock = 0.0                             # training seconds before this segment
        self.signal = 0                              # stop signal (own or a worker's): drain and stop
        self.max_messages = cfg.epochs * (self.plan.cursor.per_epoch + self.workers *
                                          sharding.steps_per_epoch(num_samples, cfg.global_batch, cfg.drop_last)) + 1

    @property
    def version(self) -> int:
        """Updates applied so far (the timestamp of the weights handed out now)."""
        return self.rule.version

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # --- the loop ----------------------------------------------------------------
    def run(self) -> int:
        """One segment of the protocol: hand out work until every worker has had STOP.
        Returns why it ended: END_DONE (budget used up), END_CHECKPOINT (an epoch boundary
        where a checkpoint is due) or END_STOP (a stop request). The clock runs only here."""
        self.t0 = time.perf_counter() - self.clock
        self.plan.new_segment()
        self.stopped = [False] * self.workers
        self.arrived = [0.0] * self.workers
        for w in range(self.workers):              # everybody's first work, in worker order
            self.reply(w)
        self._serve()
        t = time.perf_counter()
        self.channels.finish()
        self.records.charge(C_COMM, time.perf_counter() - t)
        # Invariants of the protocol: nothing in flight, nothing half-applied.
        assert self.channels.none_posted(), "a receive is still posted"
        assert not self.rule.group and not self.deferred and not any(self.channels.outstanding), "work left over"
        end = END_DONE if self._out_of_work() else END_STOP if self.signal else END_CHECKPOINT
        if end == END_DONE:
            self._close_epochs(final=True)
        self.clock = self._elapsed()
        return end

    def _serve(self) -> None:
        """Take in gradients until every worker has had STOP. Bounded: every pass either
        takes in at least one gradient (at most max_messages in all) or sleeps; a worker
        that holds its work longer than comm_timeout raises CommTimeout (check_late)."""
        pause, idle_since = waits.POLL_SLEEP_MIN, time.perf_counter()
        waits.WAITING = ("the parameter server's loop", time.perf_counter())
        while not all(self.stopped):
            t = time.perf_counter()
            self.channels.check_late(t)
            if not self.signal and self.stop is not None and self.stop.requested:
                self._stop_requested(self.stop.requested, "the server")
            done = self.channels.arrived()
            if not done:
                if self.channels.none_posted():          # would wait forever: a bug, say so
                    raise RuntimeError("parameter server: no receive posted but workers "
                                       f"{[w + 1 for w in range(self.workers) if not self.stopped[w]]} not stopped")
                time.sleep(pause)
                pause = waits.next_pause(pause, t - idle_since)
                self.records.charge(C_WAIT, time.perf_counter() - t)
                continue
            self.records.charge(C_COMM, time.perf_counter() - t)
            for w in done:
                self.receive(w)
            pause, idle_since = waits.POLL_SLEEP_MIN, time.perf_counter()
        waits.WAITING = None

    def _stop_requested(self, signum: int, where: str) -> None:
        """From now on every worker gets STOP at its next push (drain), then all checkpoint."""
        self.signal = int(signum)
        self.log(f"stop requested (signal {self.signal} on {where}): draining the workers")

    def receive(self, w: int) -> None:
        """Take in worker w's gradient; apply when the group is full; reply."""
        t = time.perf_counter()
        self.messages += 1
        if self.messages > self.max_messages:
            raise RuntimeError(f"parameter server: more than {self.max_messages} gradients for this budget")
        a, timestamp, count, loss, seconds, signal = self.channels.gradient(w)
        self.arrived[w] = t
        if signal and not self.signal:
            self._stop_requested(signal, f"worker {w + 1}")
        self.rule.add(w, timestamp, count, loss, a.epoch, self.channels.grads[w].body)
        self.plan.measured(w, count, seconds)
        self.records.charge(C_COMPUTE, time.perf_counter() - t)
        full = self.rule.full
        if full:
            self.apply()
        if not self.wait_mode:
            self.reply(w)                         # at once: the current weights, applied or not
        else:
            self.deferred.append(w)
            if full:
                self._reply_deferred()
        if self.rule.group and not any(self.channels.outstanding):
            # Nobody is computing, so the group cannot fill any more (no work is left):
            # apply what there is, and answer the workers that wait for it.
            self.apply()
            self._reply_deferred()

    def _reply_deferred(self) -> None:
        """Answer the workers that waited for the update, the budget read once for all of
        them: a time budget that ran out between two replies would split a hardsync round
        (work for the first, STOP for the rest, whose lone gradient became a full update)."""
        deferred, self.deferred, out = sorted(self.deferred), [], self._out_of_work()
        for w in deferred:
            self.reply(w, out or self.plan.cursor.done)

    def apply(self) -> None:
        """The open group as one update, recorded; closes the epochs it completes."""
        t = time.perf_counter()
        version = self.rule.version
        group, divisor, step_norm = self.rule.apply()
        self.records.add_group(group, divisor, step_norm, version, self._elapsed())
        self.records.charge(C_COMPUTE, time.perf_counter() - t)
        self._close_epochs()

    def _close_epochs(self, final: bool = False) -> None:
        self.records.close_epochs(self.plan.cursor.per_epoch, self.rule.version, self._elapsed, self.weights, self.log,
                                  final)

    def _out_of_work(self) -> bool:
        return self.plan.out_of_work(self._elapsed())

    def reply(self, w: int, out: bool | None = None) -> None:
        """Send worker w its next work (current weights) or STOP; out: whether the budget
        is used up (None: read it now)."""
        t = time.perf_counter()
        held = t - self.arrived[w] if self.arrived[w] else 0.0
        if (self._out_of_work() if out is None else out) or self.plan.pausing(self.signal):
            self.stopped[w] = True
            self.channels.send_stop(w, held)
        else:
            epoch, start, count, opened = self.plan.take(w)
            if opened:
                self.records.vectors[epoch] = self.plan.vector
            self.channels.send_work(w, held, Assignment(epoch, start, count, self.rule.version), self.weights, t)
        self.records.charge(C_COMM, time.perf_counter() - t)

    # --- checkpoints (snapshot.py) -------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue, taken between segments (nothing in flight)."""
        return server_state(self)

    def load_state(self, state: dict, moved: bool = False) -> None:
        """Continue from state_dict(); moved: saved with another number of workers."""
        load_server_state(self, state, moved)
