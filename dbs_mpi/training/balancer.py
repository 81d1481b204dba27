"""The balancer: how many samples of every step each rank computes.

One `Balancer` per run, on every rank. It owns the batch vector b (local batches, sum B)
for a policy:

  ssgd    equal local batches, fixed (the baseline every paper compares to)
  static  local batches from the start-up calibration, fixed for the run
          (performance-aware batch sizes, static load balancing)
  dbs     the same start, then re-planned from measured step times (dynamic batch
          size, planning/dynamic/): every `interval` steps (default 1) from a robust estimate of
          every rank's step time, the new vector applying within the epoch; or, with
          interval="epoch", after every epoch from that epoch's compute time (the DBS
          paper's rule, dynamic.DBSController)

and the epoch's bookkeeping, in this order on every rank:

  calibrate(step)    collective, once, before the first epoch: every rank times
                     `step(b)` (one forward and backward on b samples) at two local
                     batches; the times are all-gathered and t_i(b) = a_i + c_i b is fitted
                     (allocation.SpeedModel); static and dbs allocate from it
  begin_epoch(...)   the epoch's table of local batches, step by step (HeteroSampler
                     calls it when iteration starts; sharding.step_batch_sizes)
  record_step(...)   each step's phase times and global loss (DistributedOptimizer calls it);
                     dbs within the epoch: with every rank's step time, which the
                     optimizer's gradient allreduce carried (telemetry(); no extra
                     collective), the planner may switch the vector from a later step
  end_epoch()        collective: everybody's step times are all-gathered (one allgather),
                     split into compute, wait and comm (profiling), and dbs once per epoch
                     re-plans the vector for the next epoch; returns the epoch's EpochStats

Emulated heterogeneity (heterogeneity.Emulator, `speeds=`) lives here too: the
optimizer asks the balancer to stretch each step's compute before the collective,
with the step's local batches, from which the balancer tells a coupled rank's emulator
whether another rank of its node computes in the step (`--couple`; the ranks' hosts
are learned once, at construction). The calibration times every rank at once, so a
coupled rank is timed coupled there, and the planner starts from that speed.

Balancer keeps the epochs (their tables, steps and times, EpochStats, the position a
checkpoint saves); its base class BatchPolicy keeps the vector and what sets it: the
calibration, dbs's controllers and the emulated speeds.
The method, with its formulas: docs/method.md.
"""
from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ..mpi.agreement import agree_settings
from ..mpi.collectives import allgather_array
from ..mpi.placement import placement
from ..mpi.waits import wait
from ..mpi.devices import autocast_dtype, model_device
from ..options import UserError, parse_interval
from ..planning import allocation, calibration, coupling, dynamic, participation, sharding
from ..planning.heterogeneity import Emulator, others_compute
from .batches import first_samples
from .global_batch import AdaptiveBatch, Resizing
from .gradient_noise import GradientNoise
from .profiling import StepTimes, model_step, split_wait, time_step

POLICIES = ("ssgd", "static", "dbs")


LEAST_TIMED = 3       # a slower rank times fewer steps, down to this many (see calibration_steps)
STEADY = 3            # a batch's timing ends after this many timed steps where they are steady (profiling.
                      # time_step: the coupled pair's fast rank spent 0.6 s of its 1.0 s calibration on 5 at each)


def calibrate(comm, step, small: int, large: int, *, steps: int = 5, warmup: int = 2, stretch=None,
              affine: bool = True, timeout: float = 600.0) -> tuple[allocation.SpeedModel, np.ndarray, np.ndarray]:
    """Collective: every rank times step(small) and step(large); returns the fitted
    speed model of every rank, the (ranks x 2) median step times and every rank's median
    at the tiny batch (which tells the times read off: calibration.slow). First every rank
    times a few steps of 2 samples; a rank much slower than the fastest there times one
    batch of its own instead (planning/calibration.py: its times are read off the line
    through those two), and a slower rank times fewer steps (calibration_steps), and,
    where it is slower at the small batch, fewer samples in the large one
    (calibration.large_batches, read_off), so that no rank waits long for it."""
    # The timed steps draw (dropout) from random streams of their own: training's draws are
    # then the same whether a launch calibrated or reused a calibration (use_calibration).
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    rank = comm.Get_rank()
    with torch.random.fork_rng(devices=cuda):
        tiny, stopped = time_tiny(comm, step, small, stretch, timeout)
        slow = calibration.slow(tiny)[rank]
        timed, untimed = calibration_steps(calibration.ratios(tiny)[rank], steps, warmup)
        first = np.nan if slow else time_step(step, small, timed, untimed, stretch, STEADY)
        larges = calibration.large_batches(allgather_array(comm, [first], timeout)[:, 0], small, large)
        if slow:         # its own second batch, or nothing more, while the others time their large one
            second = 0 if stopped[rank] else int(calibration.second_batch(tiny, small)[rank])
            mine = [time_step(step, second, calibration.TINY_STEPS, 1, stretch) if second else np.nan, np.nan]
        else:
            mine = [first, time_step(step, int(larges[rank]), timed, untimed, stretch, STEADY)]
    times = calibration.read_off(allgather_array(comm, mine, timeout), small, large, larges)
    times = calibration.completed(tiny, times, small, large)
    n = comm.Get_size()
    fit = allocation.SpeedModel.fit(np.full(n, small), times[:, 0], np.full(n, large), times[:, 1], affine=affine)
    return fit, times, tiny


def time_tiny(comm, step, small: int, stretch, timeout: float) -> tuple[np.ndarray, np.ndarray]:
    """Collective: every rank's median seconds at the tiny batch (calibration.tiny_batch),
    of TINY_STEPS timed steps after an untimed one, and the ranks (bool) that their first
    two showed far too slow (calibration.stops_early, from the shorter of every rank's
    two): those time no more, their first timed step their time, and no second batch
    either (the medians may read them a little less slow)."""
    tiny = calibration.tiny_batch(small)
    first = [time_step(step, tiny, 1, 0, stretch) for _ in range(2)]      # (the untimed one clocked too)
    stopped = calibration.stops_early(allgather_array(comm, [min(first)], timeout)[:, 0], small)
    mine = [first[1]]
    if not stopped[comm.Get_rank()]:
        mine += [time_step(step, tiny, 1, 0, stretch) for _ in range(calibration.TINY_STEPS - 1)]
    return allgather_array(comm, [statistics.median(mine)], timeout)[:, 0], stopped


def calibration_steps(ratio: float, steps: int, warmup: int) -> tuple[int, int]:
    """The timed and untimed steps of a rank `ratio` times slower than the fastest at the
    tiny batch: about steps / ratio and warmup / ratio, so that it takes about as long as
    the fastest rank, but at least LEAST_TIMED timed and one untimed (never more than
    asked). At 1:0.25 the slow rank's 7 steps at each batch took 3.8 s of a 20 s run."""
    ratio = max(float(ratio), 1.0) if math.isfinite(ratio) else 1.0
    return (min(steps, max(LEAST_TIMED, round(steps / ratio))), min(warmup, max(1, round(warmup / ratio))))


def _phases(times: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every rank's step times (R, 6, S: profiling.StepTimes.as_array of each rank) as the
    stats give them: data, compute, comm, wait and pre-collective compute (R, S each), the
    collectives' time split into waiting for slower ranks and moving gradients, and the
    steps' global loss (R, S, alike on every rank)."""
    data_t, compute_t, collective_t, _, pre_t, loss = (times[:, i, :] for i in range(6))
    wait_t, comm_t = split_wait(pre_t, collective_t)
    return data_t, compute_t, comm_t, wait_t, pre_t, loss


@dataclass
class EpochStats:
    """What one epoch did, on every rank alike (gathered at end_epoch). R ranks, S steps."""
    epoch: int                  # 0-based
    batch_sizes: np.ndarray     # (R,) the vector of the epoch's full steps (the last one's, if dbs changed it)
    table: np.ndarray           # (S, R) local batches actually run (the last step may be partial)
    duration: float             # wall seconds from the epoch's first batch request to its last step (this rank)
    data_time: np.ndarray       # (R,) seconds waiting for batches
    compute_time: np.ndarray    # (R,) seconds of forward, backward, emulation and update
    comm_time: np.ndarray       # (R,) seconds moving gradients
    wait_time: np.ndarray       # (R,) seconds idle in collectives, waiting for slower ranks
    speed: np.ndarray           # (R,) samples per second of pre-collective compute
    step_loss: np.ndarray       # (S,) global mean loss of every step (NaN if the loop did not give it)
    step_compute: np.ndarray    # (S, R)
    step_comm: np.ndarray       # (S, R)
    step_wait: np.ndarray       # (S, R)
    step_data: np.ndarray       # (S, R)
    step_pre: np.ndarray        # (S, R) compute before the step's collective (what dbs measures)
    next_batch_sizes: np.ndarray  # (R,) the vector of the next epoch (dbs may have re-planned)
    diagnostics: dict = field(default_factory=dict)   # dbs per epoch: speed_ratio (R,) measured / predicted
    changes: list = field(default_factory=list)       # dbs within the epoch: its vector changes (Change)
    probes: tuple = ()                                # (S, R) samples and seconds of own-time probes (prober.py)
    noise: np.ndarray | None = None                   # (S, 3) the noise scale after each step, its |G|^2, tr(Sigma)
    goodput: np.ndarray | None = None                 # (S, 2) global_batch="auto": each step's gain, predicted goodput

    @classmethod
    def of(cls, epoch: int, vector: np.ndarray, table: np.ndarray, duration: float, phases: tuple,
           next_vector: np.ndarray, diagnostics: dict, changes: list, probes: tuple = (),
           noise: np.ndarray | None = None, goodput: np.ndarray | None = None) -> "EpochStats":
        """The stats of an epoch from its table and every rank's phases of its steps (_phases)."""
        data_t, compute_t, comm_t, wait_t, pre_t, loss = phases
        return cls(epoch=epoch, batch_sizes=vector, table=table, duration=duration, data_time=data_t.sum(axis=1),
                   compute_time=compute_t.sum(axis=1), comm_time=comm_t.sum(axis=1), wait_time=wait_t.sum(axis=1),
                   speed=table.sum(axis=0) / np.maximum(pre_t.sum(axis=1), 1e-12), step_loss=loss[0],
                   step_compute=compute_t.T, step_comm=comm_t.T, step_wait=wait_t.T, step_data=data_t.T,
                   step_pre=pre_t.T, next_batch_sizes=next_vector, diagnostics=diagnostics, changes=changes,
                   probes=probes, noise=noise, goodput=goodput)

    @property
    def steps(self) -> int:
        return len(self.table)

    @property
    def train_loss(self) -> float:
        """Mean training loss over the epoch's samples (from the steps' global losses)."""
        samples = self.table.sum(axis=1)
        return float((self.step_loss * samples).sum() / max(samples.sum(), 1))

    def record(self) -> dict:
        """The epoch's row of the result file (results.py), without the test metrics."""
        return dict(train_loss=self.train_loss, duration=self.duration, batch_sizes=self.batch_sizes,
                    rank_samples=self.table.sum(axis=0).astype(np.int64), compute_time=self.compute_time,
                    comm_time=self.comm_time, wait_time=self.wait_time, data_time=self.data_time, speed=self.speed,
                    steps=np.int64(self.steps), **self.diagnostics)

    def step_rows(self, epoch_index: int) -> dict:
        """The epoch's rows of step/* in the result file."""
        samples, seconds = self.probes or (np.zeros(self.table.shape, np.int64), np.full(self.table.shape, np.nan))
        noise = np.full((self.steps, 3), np.nan) if self.noise is None else self.noise
        adapted = np.full((self.steps, 2), np.nan) if self.goodput is None else self.goodput
        return dict(loss=self.step_loss, epoch=np.full(self.steps, epoch_index, dtype=np.int64),
                    batch_sizes=self.table.astype(np.int64), compute_time=self.step_compute,
                    comm_time=self.step_comm, wait_time=self.step_wait, data_time=self.step_data,
                    pre_time=self.step_pre, probe_samples=samples.astype(np.int64), probe_time=seconds,
                    noise_scale=noise[:, 0], grad_sq=noise[:, 1], grad_trace=noise[:, 2], gain=adapted[:, 0],
                    goodput=adapted[:, 1])

    def replan_rows(self) -> dict:
        """The epoch's vector changes as rows of replan/* in the result file (none: {})."""
        if not self.changes:
            return {}
        return {name: np.array([getattr(c, name) for c in self.changes]) for name in Change.FIELDS}


@dataclass
class Change:
    """A vector change within the epoch (dbs with a step interval): where it applied, and
    the estimate that caused it (this rank's planner's; NaN where a vector was forced)."""
    FIELDS = ("epoch", "step", "run_step", "decided", "batch_sizes", "per_sample", "overhead",
              "predicted_before", "predicted_after", "changed", "cause")
    CAUSES = ("plan", "probe", "revert", "trial", "forced", "lift")   # cause: an index into these
    epoch: int                  # 0-based
    step: int                   # the epoch's first step under the new vector (the epoch's length: the next epoch)
    run_step: int               # the same, counted over the run
    decided: int                # the run's step whose times led to it
    batch_sizes: np.ndarray     # (R,) the new vector
    per_sample: np.ndarray      # (R,) seconds per sample of the estimate
    overhead: np.ndarray        # (R,) seconds per step of the estimate
    predicted_before: float     # seconds per step the estimate predicted for the old vector
    predicted_after: float      # ... and for the new one
    changed: np.ndarray         # (R,) ranks whose speed changed (rather than drifted)
    cause: int = 4              # why (CAUSES): a plan, a probe in the step, a revert, a trial, forced, a lift

    @classmethod
    def of(cls, switch: dynamic.Switch, epoch: int, run_step: int, next_step: int) -> "Change":
        p, n = switch.proposal, len(switch.vector)
        nan = np.full(n, np.nan)
        return cls(epoch, int(switch.first_step), run_step - next_step + int(switch.first_step), run_step - 2,
                   switch.vector.copy(), nan if p is None else p.per_sample, nan if p is None else p.overhead,
                   np.nan if p is None else p.predicted_before, np.nan if p is None else p.predicted_after,
                   np.zeros(n, bool) if p is None else p.changed, cls.CAUSES.index("forced" if p is None else p.cause))

    def state(self) -> dict:
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_state(cls, state: dict) -> "Change":
        arrays = {"batch_sizes": np.int64, "per_sample": float, "overhead": float, "changed": bool}
        return cls(**{name: (np.asarray(state[name], dtype=arrays[name]).copy() if name in arrays
                             else (float(state[name]) if name.startswith("predicted") else int(state[name])))
                      for name in cls.FIELDS if name in state})


@dataclass
class _Epoch:
    """The open epoch's bookkeeping on this rank: its table, its steps' times, its position."""
    epoch: int
    table: np.ndarray
    times: StepTimes
    step: int                   # steps done
    start: float                # perf_counter when the epoch (or its resumed part) began
    elapsed_before: float       # seconds of this epoch before a stop (resumed epochs)
    last_end: float             # perf_counter at the end of the last step
    num_samples: int = 0        # the epoch's training samples (to re-split its steps)
    drop_last: bool = False
    handed: int = 0             # steps whose samples this rank's sampler handed out
    changes: list = field(default_factory=list)   # Change records of this epoch
    measured_from: int = 0      # first step this world ran (an epoch resumed on another rank count)
    probe_samples: np.ndarray | None = None   # (S, R) own-time probes that rode each step: samples ...
    probe_time: np.ndarray | None = None      # ... and seconds (NaN: none)
    noise: np.ndarray | None = None           # (S, 3) gradient_noise.py's records of each step (NaN: none)

    def __post_init__(self):
        if self.probe_samples is None:
            self.probe_samples = np.zeros(self.table.shape, np.int64)
            self.probe_time = np.full(self.table.shape, np.nan)
        if self.noise is None:
            self.noise = np.full((len(self.table), 3), np.nan)

    def measured_noise(self, step: int, values) -> None:
        """The noise scale after `step`, and that step's fit (GradientNoise.incoming; the step
        before this epoch's first is not recorded)."""
        if values is not None and step >= self.measured_from:
            self.noise[step] = values

    def probed(self, step: int, probes) -> None:
        """The own-time probes (samples, seconds per rank; None: none) that rode `step`."""
        if probes is not None:
            self.probe_samples[step], self.probe_time[step] = probes

    @classmethod
    def opened(cls, epoch: int, table: np.ndarray, num_samples: int, drop_last: bool, first_step: int,
               restored: dict | None) -> "_Epoch":
        """The epoch from its first step, or from `first_step` where a stop left it: `restored`
        (load_state_dict's) holds this world's times of the steps before, or, saved by another
        world, only the position (this world records the steps it runs itself)."""
        times, elapsed, changes, measured_from = StepTimes(len(table)), 0.0, [], 0
        if first_step != 0 and (restored is None or (restored["epoch"], restored["step"]) != (epoch, first_step)):
            raise RuntimeError(f"begin_epoch at step {first_step} of epoch {epoch + 1}: the balancer's state saved "
                               f"there must be loaded first (load_state_dict)")
        if first_step != 0 and restored.get("other_world"):
            measured_from = first_step      # another world ran the steps before: this one records its own
            elapsed = float(restored.get("elapsed", 0.0))
        elif first_step != 0:
            times.restore(restored["times"])
            elapsed = float(restored["elapsed"])
            if "table" in restored:                                          # with the epoch's vector changes
                table = np.asarray(restored["table"], dtype=np.int64).copy()
            changes = [Change.from_state(c) for c in restored.get("changes", [])]
        now = time.perf_counter()
        opened = cls(epoch, table, times, first_step, now, elapsed, now, num_samples, drop_last,
                     changes=changes, measured_from=measured_from)
        if first_step != 0 and "probe_samples" in restored and not restored.get("other_world"):
            opened.probe_samples[:] = restored["probe_samples"]
            opened.probe_time[:] = restored["probe_time"]
            opened.noise[:] = restored.get("noise", opened.noise)
        return opened

    @property
    def elapsed(self) -> float:
        """Seconds of the epoch up to its last step (a stopped epoch's earlier part included)."""
        return self.elapsed_before + self.last_end - self.start

    def switch(self, switch: dynamic.Switch, global_batch: int, run_steps: int) -> None:
        """dbs changed the vector: the epoch's steps from the switch's first step on are
        re-split by the new vector, and the change is recorded (Change)."""
        if switch.first_step < len(self.table):
            rows = sharding.step_batch_sizes(self.num_samples, global_batch, switch.vector, self.drop_last)
            self.table[switch.first_step:] = rows[switch.first_step:]
        self.changes.append(Change.of(switch, self.epoch, run_steps, self.step))

    def gather(self, comm, timeout: float) -> tuple[np.ndarray, tuple]:
        """Collective (one allgather): the table of the steps this world ran and every rank's
        phases of them (_phases)."""
        gathered = allgather_array(comm, self.times.as_array(), timeout)     # (R, 6, S)
        return self.table[self.measured_from:], _phases(gathered[:, :, self.measured_from:])

    def amend(self, epoch: int, step: int, pre: float, collective: float, update: float, loss: float) -> None:
        """A recorded step's times and loss, measured late (Balancer.amend_step)."""
        if self.epoch != epoch or step >= self.step:
            raise RuntimeError(f"amend_step(epoch {epoch + 1}, step {step + 1}): not a recorded step of the open "
                               f"epoch (a late clock must be settled before end_epoch)")
        self.times.amend(step, pre, collective, update, loss)

    def position(self) -> dict:
        """The epoch in a checkpoint taken in its middle (state_dict's "open"): where it is,
        its steps' times so far, and its table and changes (dbs may have changed them)."""
        return {"epoch": self.epoch, "step": self.step, "elapsed": self.elapsed,
                "times": self.times.snapshot(self.step), "table": self.table.copy(),
                "changes": [c.state() for c in self.changes], "probe_samples": self.probe_samples.copy(),
                "probe_time": self.probe_time.copy(), "noise": self.noise.copy()}


def steps_before_resume(states: list[dict], epoch_index: int) -> dict:
    """step/* rows of the epoch in progress at a mid-epoch checkpoint, from every rank's
    balancer state_dict(): what a run resumed on another number of ranks records for the
    steps that the old world ran (its new balancer does not continue their times)."""
    opened = [state["open"] for state in states]
    if opened[0] is None or opened[0]["step"] == 0:
        return {}
    steps = opened[0]["step"]
    times = np.stack([np.vstack([np.asarray(o["times"]["table"]), np.asarray(o["times"]["pre"])[None],
                                 np.asarray(o["times"]["loss"])[None]]) for o in opened])      # (R, 6, steps)
    data_t, compute_t, comm_t, wait_t, pre_t, loss = _phases(times)
    return dict(loss=loss[0], epoch=np.full(steps, epoch_index, dtype=np.int64),
                batch_sizes=np.asarray(opened[0]["table"], dtype=np.int64)[:steps], compute_time=compute_t.T,
                comm_time=comm_t.T, wait_time=wait_t.T, data_time=data_t.T, pre_time=pre_t.T)


def _check_settings(comm, timeout: float, **settings) -> None:
    """Collective: every rank's balancer has the same settings (a rank with another global
    batch would wait in another collective; AgreedError names the setting and the ranks),
    then they are checked."""
    agree_settings(comm, settings, timeout, "Balancer")
    if settings["policy"] not in POLICIES:
        raise UserError(f"policy: must be one of {', '.join(POLICIES)}; got {settings['policy']!r}")
    participation.check_participation(settings["participation"])
    if settings["dbs_model"] not in ("affine", "proportional"):
        raise UserError(f"dbs_model: must be affine or proportional; got {settings['dbs_model']!r}")


def _emulator(speeds, emulator: Emulator | None, rank: int, world_size: int) -> Emulator:
    """This rank's emulated device: `emulator`, or else one of relative `speeds` (one per
    rank, the fastest at full speed; none: every rank at full speed)."""
    if speeds is not None and len(speeds) and len(speeds) != world_size:
        raise UserError(f"speeds: has {len(speeds)} values but there are {world_size} ranks")
    if emulator is None:
        speed = speeds[rank] / max(speeds) if speeds is not None and len(speeds) else 1.0
        emulator = Emulator(rank, speed)
    return emulator


def _resume_emulation(emulator: Emulator, state: dict) -> None:
    """Another world's balancer state: the emulated disturbances' step and time windows go
    on counting over the run (the steps and seconds trained before, the open epoch's too)."""
    opened = state["open"]
    emulator.resume_at(int(state.get("run_steps", 0)),
                       float(state.get("trained_before", 0.0)) + (opened["elapsed"] if opened else 0.0))


def _within_epoch(comm, policy: str, interval, global_batch: int, min_local: int, max_local, window: int,
                  rule: dict) -> dynamic.Replanner | None:
    """dbs with a step interval, on more than one rank: the within-epoch rule."""
    if policy != "dbs" or interval is None or comm.Get_size() == 1:
        return None
    return dynamic.Replanner(comm.Get_rank(), comm.Get_size(), global_batch, min_local, max_local, interval=interval,
                             window=window, follow=rule["follow"], min_gain=rule["min_gain"],
                             participation=rule["participation"])


def _arguments(cfg) -> dict:
    """Balancer's arguments of a dbs-mpi configuration (config.Config), the emulator aside."""
    adaptive = dict(global_batch="auto", global_batch_start=cfg.global_batch, min_global_batch=cfg.min_global_batch,
                    max_global_batch=cfg.max_global_batch,
                    lr_scaling=cfg.lr_scaling) if cfg.global_batch_auto else dict(global_batch=cfg.global_batch)
    return dict(policy=cfg.strategy, min_local_batch=cfg.min_local_batch, max_local_batch=cfg.share_bound,
                dbs_model=cfg.dbs_model, smoothing=cfg.dbs_smoothing, follow=cfg.dbs_follow,
                min_gain=cfg.dbs_min_gain, interval=cfg.dbs_interval, window=cfg.dbs_window,
                participation=cfg.participation, timeout=cfg.comm_timeout, noise_scale=cfg.noise_scale, **adaptive)


class Calibration:
    """The start-up calibration of a BatchPolicy (its base class: the same attributes):
    time every rank at two local batches (or reuse a timing recorded before), fit every
    rank's step time, and (static, dbs) allocate the vector from the fit; and the emulated
    speeds that every timing sees (stretch)."""

    def calibration_batches(self, largest: int = 0) -> tuple[int, int]:
        return allocation.calibration_batches(self.global_batch, self.world_size, self.min_local,
                                              min([n for n in (self.max_local, largest) if n], default=None))

    def calibrate(self, step, steps: int = 5, warmup: int = 2, largest: int = 0) -> np.ndarray:
        """Collective. Time `step(b)` (one forward and backward on b samples, on a copy of
        the model: see profiling.model_step) at two local batches on every rank, fit every
        rank's step time, and (static, dbs) allocate the vector from it. Returns the vector.
        A step on a GPU must synchronise the device before it returns (model_step does),
        and the balancer must know the device (`on_device`; calibrate_model tells it). largest:
        the most samples a rank computes at once (0: any; a loop that accumulates larger shares)."""
        small, large = self.calibration_batches(largest)
        fit, times, tiny = calibrate(self.comm, step, small, large, steps=steps, warmup=warmup,
                                     stretch=self.stretch, affine=self.affine, timeout=self.timeout)
        return self._plan_from(fit, small, large, times, self._time_alone(step, fit, large, steps, warmup), tiny,
                               calibration.timed_large(tiny, times, small, large))

    def _time_alone(self, step, fit, large: int, steps: int, warmup: int) -> np.ndarray | None:
        """Collective where it is needed (coupling.timed_alone; every rank decides alike from
        the gathered fit): the fastest ranks time the large batch again, ALONE_STEPS steps
        after one untimed, the others computing nothing. Returns every rank's seconds
        (NaN: not timed), or None."""
        plan = participation.allocate_for(fit, self.global_batch, self.min_local, self.max_local, self.participation)
        alone = coupling.timed_alone(fit, self.hosts, self.participation, self._checked(), plan)
        if alone is None:
            return None
        row = alone.astype(np.int64)                  # the emulation's view: only these ranks compute
        mine = [np.nan]
        if alone[self.rank]:
            cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
            with torch.random.fork_rng(devices=cuda):
                mine = [time_step(step, large, min(steps, coupling.ALONE_STEPS), min(warmup, 1),
                                  lambda wall, cpu=None: self.stretch(wall, cpu, row))]
        return allgather_array(self.comm, mine, self.timeout)[:, 0]

    def use_calibration(self, startup: dict) -> np.ndarray:
        """Plan from a calibration recorded before (a result file's startup/*: `local_batch`,
        the two local batches, and `step_time`, every rank's median step times at them)
        instead of timing the ranks again: the same fit, so the same vector, as the launch
        that recorded it (two launches of static then train alike, bit for bit). Every rank
        must pass the same calibration, of a world of this size (checked). Returns the vector."""
        small, large = (int(n) for n in np.asarray(startup["local_batch"]).reshape(-1)[:2])
        times = np.asarray(startup["step_time"], dtype=np.float64)
        if times.shape != (self.world_size, 2):
            raise UserError(f"calibration: it timed {times.shape[0] if times.ndim else 0} rank(s); this job has "
                            f"{self.world_size} (a recorded calibration is reused on a world of its size)")
        alone = startup.get("alone_time")
        alone = None if alone is None or not len(alone) else np.asarray(alone, dtype=np.float64).reshape(-1)
        agree_settings(self.comm, dict(calibration=[small, large, *times.ravel().tolist()],
                                       alone=None if alone is None else   # (NaN is never equal to itself)
                                       [x if math.isfinite(x) else None for x in alone.tolist()]), self.timeout,
                       "Balancer.use_calibration")
        n = self.world_size
        fit = allocation.SpeedModel.fit(np.full(n, small), times[:, 0], np.full(n, large), times[:, 1],
                                        affine=self.affine)
        return self._plan_from(fit, small, large, times, alone, startup.get("tiny_time"), startup.get("timed_large"))

    def _plan_from(self, fit, small: int, large: int, times: np.ndarray, alone=None, tiny=None,
                   timed_large=None) -> np.ndarray:
        """The calibration's plan: the speed model, (static, dbs) the vector, the controllers;
        (dbs) with the fastest ranks alone where their times alone showed coupling (coupling.py).
        tiny: every rank's time at the tiny batch, recorded with the rest, and timed_large the
        larger batch each rank timed (calibration.timed_large; None: not known)."""
        start, first_trial = coupling.decide(fit, times[:, 1], alone, self.hosts, self.participation, self._checked(),
                                       self.global_batch, self.min_local, self.max_local)
        model = fit if start is None else start.model
        self.speed_model = model
        if self.policy != "ssgd":
            self.batch_sizes = start.vector.copy() if start is not None else participation.allocate_for(
                fit, self.global_batch, self.min_local, self.max_local, self.participation)
        if self.policy == "dbs":
            self.controller = self._controller(model)
        if self.replanner is not None:
            self.replanner.start_from(model, first_trial, start)
        self.startup = {"local_batch": np.array([small, large], dtype=np.int64), "step_time": times,
                        "batch_sizes": self.batch_sizes.copy()}
        if alone is not None:
            self.startup["alone_time"] = np.asarray(alone, dtype=np.float64)
        if tiny is not None and len(tiny) == self.world_size:
            self.startup["tiny_time"] = np.asarray(tiny, dtype=np.float64)
        if timed_large is not None and len(timed_large) == self.world_size:
            self.startup["timed_large"] = np.asarray(timed_large, dtype=np.int64)
        return self.batch_sizes

    def _checked(self) -> bool:
        """Whether a set check follows the start: dbs re-planning within the epoch."""
        return self.policy == "dbs" and self.replanner is not None

    def calibrate_model(self, model, loss_fn, dataset, steps: int = 5, warmup: int = 2, largest: int = 0) -> np.ndarray:
        """calibrate() with the usual step: loss_fn(model(x), y).backward() on a copy of
        `model`, x and y the first samples of `dataset` (a map-style dataset)."""
        self.on_device(model_device(model))
        inputs, targets = first_samples(dataset, self.calibration_batches(largest)[1])
        self.sample_inputs, self.sample_autocast = inputs, autocast_dtype(model_device(model))   # (the probes')
        return self.calibrate(model_step(model, loss_fn, inputs, targets), steps, warmup, largest)

    def on_device(self, device) -> None:
        """This rank computes on `device`: on a GPU, emulated speeds stretch the step's wall
        time (DistributedOptimizer and calibrate_model tell the balancer)."""
        self.emulator.wall_clock = torch.device(device).type == "cuda"

    def stretch(self, compute_seconds: float, cpu_seconds: float | None = None, row=None) -> float:
        """Sleep as the emulated device would be slower (heterogeneity.Emulator.stretch).
        row: the step's local batches, every rank's (None: every rank computes, as in the
        calibration); a coupled rank is slower where another rank of its host computes."""
        others = self.emulator.couple != 1.0 and bool(others_compute(self.hosts, row)[self.rank])
        return self.emulator.stretch(compute_seconds, cpu_seconds, others)


class BatchPolicy(Calibration, Resizing):
    """The batch vector of a policy on one rank and what sets it: the start-up calibration
    (static and dbs allocate from its fit), dbs's re-planning (dynamic.DBSController once
    per epoch, dynamic.Replanner within it) and the emulated speeds that every timing sees.
    Balancer (its arguments are documented there) adds the epochs. A base class, so that
    every step reads the vector, replanner and emulator as the balancer's own attributes."""

    def __init__(self, comm, global_batch: int, policy: str, min_local_batch: int, max_local_batch: int,
                 dbs_model: str, rule: dict, interval, window: int, speeds, emulator: Emulator | None,
                 timeout: float, noise_scale: bool = False, adaptive: AdaptiveBatch | None = None):
        _check_settings(comm, timeout, policy=policy, global_batch=global_batch, min_local_batch=min_local_batch,
                        max_local_batch=max_local_batch, dbs_model=dbs_model, interval=interval, window=window,
                        noise_scale=bool(noise_scale), adaptive=adaptive and adaptive.state_dict(), **rule)
        self.comm, self.rank, self.world_size = comm, comm.Get_rank(), comm.Get_size()
        allocation.check_feasible(global_batch, self.world_size, min_local_batch, max_local_batch or None)
        self.policy, self.global_batch = policy, int(global_batch)
        self.initial_batch = self.global_batch        # B as built (global_batch changes by set_global_batch, or adapts)
        self.min_local, self.max_local = int(min_local_batch), int(max_local_batch) or None
        self.affine, self.timeout = dbs_model == "affine", float(timeout)
        self.participation = rule["participation"]
        self.damping = {k: v for k, v in rule.items() if k != "participation"}     # smoothing, follow, min_gain
        self.interval = parse_interval(interval)                  # None: once per epoch
        self.replanner = _within_epoch(comm, policy, self.interval, self.global_batch, self.min_local, self.max_local,
                                       window, rule)
        self.emulator = _emulator(speeds, emulator, self.rank, self.world_size)
        self.noise = GradientNoise(self.rank, self.world_size) if noise_scale else None
        self.adaptive = adaptive              # the global batch adapts (global_batch.py), or None
        self.hosts = [host for host, _ in placement(comm, timeout)]    # every rank's host (cached on comm)
        if self.replanner is not None:
            self.replanner.on_hosts(self.hosts)
        self.batch_sizes = allocation.equal(self.global_batch, self.world_size, self.min_local, self.max_local)
        self.speed_model: allocation.SpeedModel | None = None
        self.controller: dynamic.DBSController | None = None
        self.startup: dict | None = None      # the calibration: local_batch (2,), step_time (R, 2), batch_sizes,
                                              # where known tiny_time, alone_time, timed_large (R,)
        self.sample_inputs = None             # the calibration's inputs (what a rank that sits out probes with)
        self._heard = False                   # within-epoch dbs: step times arrived in the open epoch
        self._warned = False                  # ... and the warning that none did was given
        self._settlers = []                   # clocks that record steps late (settle_with)
        self.loads = 0                        # states loaded (a plan read before a load is stale)

    @property
    def local_batch(self) -> int:
        """This rank's local batch of a full step."""
        return int(self.batch_sizes[self.rank])

    def _new_table(self, epoch: int, num_samples: int, drop_last: bool, first_step: int, seed=None) -> np.ndarray:
        """An epoch's (steps x ranks) table of local batches from the current vector, once
        the ranks agree on what the epoch is (collective: one allgather, none on one rank)."""
        agree_settings(self.comm, dict(epoch=epoch, dataset_length=num_samples, drop_last=drop_last,
                                       first_step=first_step, seed=seed, global_batch=self.global_batch),
                       self.timeout, "HeteroSampler")
        if self.policy == "static" and self.speed_model is None and first_step == 0 and epoch == 0:
            raise RuntimeError("policy 'static' allocates from the start-up calibration: call balancer.calibrate() "
                               "(or calibrate_model()) before the first epoch")
        table = sharding.step_batch_sizes(num_samples, self.global_batch, self.batch_sizes, drop_last)
        if len(table) == 0:
            raise UserError(f"global_batch: {self.global_batch} is larger than the {num_samples} training samples "
                            f"(with drop_last nothing is left)")
        return table

    def settle_with(self, settle, remove: bool = False) -> None:
        """Register (or remove) `settle()` of a clock that amends steps late (LateSteps): called before the
        records are read (end_epoch, state_dict), it amends every step recorded so far, returns how many."""
        (self._settlers.remove if remove else self._settlers.append)(settle)

    # --- re-planning --------------------------------------------------------------
    @property
    def telemetry_size(self) -> int:
        """Floats telemetry() returns (0: nothing to carry): the replanner's, then the noise's."""
        return self.noise_slot - self.rank + (0 if self.noise is None else self.noise.size)

    @property
    def noise_slot(self) -> int:
        """Where this rank's squared gradient norm goes in telemetry() (the exchange writes it)."""
        return (0 if self.replanner is None else self.replanner.size) + self.rank

    def _slots(self, compute_seconds: float, handed: int, probe) -> np.ndarray | None:
        planner = None if self.replanner is None else self.replanner.outgoing(compute_seconds, handed, probe)
        if self.noise is None:
            return planner                 # (the replanner's reused array, as before: no copy per step)
        return self.noise.outgoing() if planner is None else np.concatenate([planner, self.noise.outgoing()])

    def _noise_heard(self, telemetry, row):
        """The noise scale's records of the step before (GradientNoise.incoming), or None."""
        if telemetry is None or self.noise is None:
            return None
        return self.noise.incoming(telemetry[len(telemetry) - self.noise.size:], row)

    def propose(self, vector) -> None:
        """Ask for another vector (dbs with a step interval): rank 0's request is announced
        with the next step and applies from the first step no rank has handed out yet."""
        if self.replanner is None:
            if self.world_size == 1:
                return
            raise RuntimeError("propose() needs policy 'dbs' with a step interval (its steps carry the vector)")
        self.replanner.propose(vector)

    def _controller(self, model: allocation.SpeedModel) -> dynamic.DBSController:
        """The per-epoch controller with this balancer's bounds and damping, from `model`."""
        return dynamic.DBSController(model=model, global_batch=self.global_batch, min_local=self.min_local,
                                     max_local=self.max_local, **self.damping)

    def _replan(self, table: np.ndarray, pre_compute: np.ndarray) -> dict:
        """dbs once per epoch: the controller's new vector from the epoch's measured compute
        times. Also the fallback of the within-epoch rule when no step times reached the
        balancer (a loop whose exchange does not carry telemetry(), such as DDP's hook)."""
        if self.policy != "dbs" or (self.replanner is not None and self._heard):
            return {}
        if self.replanner is not None and not self._warned:
            self._warned = True
            warnings.warn("dbs: no step times reached the balancer during the epoch (this loop's gradient exchange "
                          "does not carry balancer.telemetry(), e.g. DDP's comm hook), so it re-plans once per epoch; "
                          "pass interval=\"epoch\" to ask for that", RuntimeWarning, stacklevel=3)
        if self.controller is None:      # not calibrated: start from the first epoch's measurement
            self.speed_model = allocation.SpeedModel.measured(table.sum(axis=0), pre_compute)
            self.controller = self._controller(self.speed_model)
        new, ratio = self.controller.update(self.batch_sizes, table, pre_compute)
        # Every rank computed the same vector from the same gathered numbers; rank 0's
        # copy is broadcast anyway so that float quirks can never split the ranks.
        new = np.ascontiguousarray(new, dtype=np.int64)
        if self.world_size > 1:
            wait(self.comm.Ibcast(new, root=0), self.timeout, "broadcasting the new batch vector")
        self.batch_sizes = new
        return {"speed_ratio": ratio}

    # --- checkpoints ------------------------------------------------------------------
    def _models_state(self) -> dict:
        """state_dict()'s models: the speed model, the controllers, the calibration."""
        return {"speed_model": self.speed_model.state_dict() if self.speed_model is not None else None,
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "replanner": self.replanner.state_dict() if self.replanner is not None else None,
                "noise": self.noise.state_dict() if self.noise is not None else None,
                "adaptive": self.adaptive and self.adaptive.state_dict(), "initial_batch": self.initial_batch,
                "startup": self.startup, "rank": self.rank}

    def _load_policy(self, state: dict) -> bool:
        """load_state_dict()'s vector, models and emulation; from another world's state
        (another number of ranks), an even vector and none of them. Returns whether the
        state is this world's."""
        self.loads += 1
        self._load_global_batch(state)
        if state["policy"] != self.policy:
            raise UserError(f"balancer: the state was saved with policy {state['policy']!r}, this balancer has "
                            f"{self.policy!r}")
        if state["world_size"] == self.world_size and state.get("rank", self.rank) != self.rank:
            raise UserError(f"balancer: this state was saved by rank {state['rank']}, and this is rank {self.rank}: "
                            f"every rank loads its own part of a checkpoint (its per-rank state)")
        if self.noise is not None and state.get("noise") is not None:     # (on any number of ranks)
            self.noise.load_state_dict(state["noise"])
        if state["world_size"] != self.world_size:
            self.batch_sizes = allocation.equal(self.global_batch, self.world_size, self.min_local, self.max_local)
            self.speed_model = self.controller = self.startup = None
            _resume_emulation(self.emulator, state)
            return False
        self.batch_sizes = np.asarray(state["batch_sizes"], dtype=np.int64).copy()
        self.speed_model = None if state["speed_model"] is None else \
            allocation.SpeedModel.from_state(state["speed_model"])
        self.controller = None if state["controller"] is None else \
            dynamic.DBSController.from_state(state["controller"])
        if self.replanner is not None and state.get("replanner") is not None:
            self.replanner = dynamic.Replanner.from_state(state["replanner"])
            self.replanner.on_hosts(self.hosts)
        self.startup = state["startup"]
        self.emulator.load_state_dict(state["emulator"])
        return True


class Balancer(BatchPolicy):
    """Owns the batch vector of a policy (ssgd | static | dbs) and the epochs' timing.

    comm: the ranks that train together. global_batch: B, samples per step over all ranks.
    min_local_batch / max_local_batch: bounds of every local batch of a full step (0: no
    upper bound). dbs_model: "affine" (t = a + c b) or "proportional" (t = c b, the DBS
    paper's rule) for the start-up fit and the per-epoch rule. interval: dbs re-plans
    every `interval` steps (default 1), or "epoch" (the DBS paper's rule); window: steps
    of history the within-epoch estimator keeps per rank. smoothing, follow, min_gain:
    the controllers' damping (planning/dynamic/). participation: "auto" (a rank that would
    slow every step sits out) or "all". speeds: emulated relative speeds, one per rank (or
    an `emulator`, for disturbances too). timeout: seconds any collective may wait.
    noise_scale: measure the gradient noise scale every step (gradient_noise.py).
    global_batch="auto", global_batch_start, min_/max_global_batch, lr_scaling: global_batch.py.
    The vector's half is BatchPolicy; this class keeps the epochs and the run's position."""

    def __init__(self, comm, global_batch: int | str, policy: str = "dbs", *, min_local_batch: int = 1,
                 max_local_batch: int = 0, dbs_model: str = "affine", smoothing: float = 0.5, follow: float = 0.25,
                 min_gain: float = 0.03, interval=dynamic.DEFAULT_INTERVAL, window: int = dynamic.WINDOW,
                 participation: str = "auto", speeds=None, emulator: Emulator | None = None, timeout: float = 600.0,
                 noise_scale: bool = False, global_batch_start: int = 0, max_global_batch: int = 0,
                 lr_scaling: str = "adascale", min_global_batch: int = 0):
        adaptive = AdaptiveBatch.of(global_batch, global_batch_start, max_global_batch, lr_scaling, min_global_batch)
        super().__init__(comm, adaptive.start if adaptive else global_batch, policy, min_local_batch, max_local_batch,
                         dbs_model, dict(smoothing=smoothing, follow=follow, min_gain=min_gain,
                                         participation=participation),
                         interval, window, speeds, emulator, timeout, noise_scale or adaptive is not None, adaptive)
        self.next_epoch = 0                   # epochs ended so far
        self.run_steps = 0                    # steps taken so far, all epochs
        self.trained_before = 0.0             # seconds of training in the epochs ended so far
        self._open: _Epoch | None = None
        self._restored: dict | None = None    # a mid-epoch position from load_state_dict

    @classmethod
    def from_config(cls, comm, cfg, emulator: Emulator | None = None) -> "Balancer":
        """The balancer of a dbs-mpi configuration (config.Config) and its emulated speeds."""
        return cls(comm, **_arguments(cfg), emulator=emulator or Emulator.from_config(cfg, comm.Get_rank()))

    # --- an epoch -----------------------------------------------------------------
    def begin_epoch(self, epoch: int, num_samples: int, drop_last: bool = False, first_step: int = 0,
                    seed: int | None = None) -> np.ndarray:
        """Open `epoch`: its (steps x ranks) table of local batches, from the current vector.
        first_step > 0 continues an epoch stopped there (load_state_dict first)."""
        if self._open is not None:
            raise RuntimeError(f"epoch {self._open.epoch + 1} is still open: call balancer.end_epoch() after every "
                               f"epoch, before the next one begins")
        table = self._new_table(epoch, num_samples, drop_last, first_step, seed)
        restored, self._restored = self._restored, None
        if first_step == 0 or (restored or {}).get("other_world"):     # (this world's emulator is saved in it)
            self.emulator.start_epoch(epoch, len(table))
        self._open = _Epoch.opened(epoch, table, num_samples, drop_last, first_step, restored)
        self._heard = False
        return self._open.table

    @property
    def open_epoch(self) -> int | None:
        return None if self._open is None else self._open.epoch      # the epoch begun and not ended yet, or None

    @property
    def epoch_table(self) -> np.ndarray | None:
        """The open epoch's (steps x ranks) local batches (None if no epoch is open)."""
        return None if self._open is None else self._open.table

    @property
    def step(self) -> int:
        """Steps done in the open epoch (0 if none is open)."""
        return 0 if self._open is None else self._open.step

    @property
    def step_pending(self) -> bool:
        """True while the open epoch has steps left to take."""
        return self._open is not None and self._open.step < len(self._open.table)

    def step_batch_sizes(self) -> np.ndarray:
        """Every rank's local batch of the step about to be taken."""
        e = self._open
        if e is None:
            raise RuntimeError("no epoch is open: iterate a dbs_mpi.HeteroSampler (DataLoader(dataset, "
                               "batch_sampler=sampler)); it opens each epoch at the balancer")
        if e.step >= len(e.table):
            raise RuntimeError(f"step {e.step + 1} of epoch {e.epoch + 1}, which has {len(e.table)} steps: one "
                               f"optimizer.step() per batch of the HeteroSampler, then balancer.end_epoch()")
        return e.table[e.step]

    def hand_out(self, step: int) -> None:
        """This rank's sampler gives away the samples of the open epoch's `step` (a DataLoader
        may prefetch them): a new vector never applies to a step handed out."""
        e = self._open
        if e is not None and step >= e.handed:
            e.handed = step + 1

    def telemetry(self, compute_seconds: float, probe=None) -> np.ndarray | None:
        """This rank's slots of the step's sum, for the gradient allreduce to carry (None: none):
        dbs within the epoch, its compute seconds, its sampler's position, rank 0's proposal, a
        probe it ran on its own time ((samples, seconds) or None; dynamic.Replanner); with
        noise_scale, the gradients' squared norms (gradient_noise.py)."""
        return self._slots(compute_seconds, 0 if self._open is None else self._open.handed, probe)

    def record_step(self, data: float, pre: float, collective: float, update: float,
                    loss: float = float("nan"), telemetry=None) -> None:
        """One step's phase times (seconds) on this rank and the step's global loss;
        telemetry: the sum over ranks of telemetry() that the step's exchange carried."""
        e = self._open
        e.times.record(e.step, data, pre, collective, update, loss)
        e.step += 1
        self.run_steps += 1
        e.measured_noise(e.step - 2, self._noise_heard(telemetry, e.table[e.step - 1]))
        if telemetry is not None and self.replanner is not None:
            self._heard = True
            switch = self.replanner.incoming(telemetry[:self.replanner.size], e.table[e.step - 1], self.batch_sizes,
                                             e.step)
            e.probed(e.step - 1, self.replanner.probes)
            if switch is not None:      # a new vector from the switch's step on (this epoch and later ones)
                e.switch(switch, self.global_batch, self.run_steps)
                self.batch_sizes = switch.vector.copy()
        e.last_end = time.perf_counter()
        self.emulator.step_done(self.trained_before + e.elapsed_before + e.last_end - e.start)

    def amend_step(self, epoch: int, step: int, pre: float, collective: float, update: float, loss=np.nan) -> None:
        """Step `step` of epoch `epoch`, recorded, gets the times and loss measured late."""
        self._open.amend(epoch, step, pre, collective, update, loss)

    def end_epoch(self) -> EpochStats:
        """Collective: close the open epoch on every rank, gather everybody's step times,
        and (dbs) re-plan the vector. Returns what the epoch did."""
        e = self._open
        if e is None:
            raise RuntimeError("end_epoch() without an open epoch (a HeteroSampler opens it when iterated)")
        if sum(settle() for settle in self._settlers):   # read late: the epoch ends when the device is done
            e.last_end = time.perf_counter()
        if e.step != len(e.table):
            raise RuntimeError(f"end_epoch() after {e.step} of the {len(e.table)} steps of epoch {e.epoch + 1}: every "
                               f"rank takes every step (one optimizer.step() per batch of the HeteroSampler)")
        duration = e.elapsed
        table, phases = e.gather(self.comm, self.timeout)
        full = table[table.sum(axis=1) == self.global_batch]
        vector = full[-1].copy() if len(full) else self.batch_sizes.copy()
        diagnostics = self._replan(table, phases[4].sum(axis=1))
        self._open, self.next_epoch = None, e.epoch + 1
        self.trained_before += duration
        diagnostics.update(self._adapt(table, phases, e.num_samples))    # global_batch="auto": the next B
        return EpochStats.of(e.epoch, vector, table, duration, phases, self.batch_sizes.copy(), diagnostics,
                             list(e.changes), (e.probe_samples[e.measured_from:], e.probe_time[e.measured_from:]),
                             e.noise[e.measured_from:], self._step_goodput(e.noise[e.measured_from:, 0], diagnostics))

    # --- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's balancer: the vector, the models, and the open epoch's position and
        step times (a checkpoint in the middle of an epoch). Plain types and arrays."""
        sum(settle() for settle in self._settlers)
        return {"policy": self.policy, "global_batch": self.global_batch, "world_size": self.world_size,
                "batch_sizes": self.batch_sizes.copy(), "next_epoch": self.next_epoch, "run_steps": self.run_steps,
                "trained_before": self.trained_before, **self._models_state(),
                "open": None if self._open is None else self._open.position(), "emulator": self.emulator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict(). A state saved by another number of ranks (a run resumed
        on another allocation) gives the position only (epoch, step, the run's counters, the
        noise scale): the vector starts even, the models afresh (static and dbs: calibrate
        again); emulated disturbances count over the run. The epoch in progress is recorded
        from the step this world began at (the earlier ones were another world's)."""
        this_world = self._load_policy(state)
        self.next_epoch = int(state["next_epoch"])
        self.run_steps = int(state.get("run_steps", 0))
        self.trained_before = float(state.get("trained_before", 0.0))
        opened, self._open = state["open"], None
        self._restored = opened if this_world or opened is None else \
            {"epoch": opened["epoch"], "step": opened["step"], "elapsed": opened["elapsed"], "other_world": True}
