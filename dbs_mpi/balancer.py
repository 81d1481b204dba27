"""The balancer: how many samples of every step each rank computes.

One `Balancer` per run, on every rank. It owns the batch vector b (local batches, sum B)
for a policy:

  ssgd    equal local batches, fixed (the baseline every paper compares to)
  static  local batches from the start-up calibration, fixed for the run
          (performance-aware batch sizes, static load balancing)
  dbs     the same start, then re-planned after every epoch from that epoch's
          measured compute time (dynamic batch size; allocation.DBSController)

and the epoch's bookkeeping, in this order on every rank:

  calibrate(step)    collective, once, before the first epoch: every rank times
                     `step(b)` (one forward and backward on b samples) at two local
                     batches; the times are all-gathered and t_i(b) = a_i + c_i b is fitted
                     (allocation.SpeedModel); static and dbs allocate from it
  begin_epoch(...)   the epoch's table of local batches, step by step (HeteroSampler
                     calls it when iteration starts; sharding.step_batch_sizes)
  record_step(...)   each step's phase times and global loss (DistributedOptimizer calls it)
  end_epoch()        collective: everybody's step times are all-gathered (one allgather),
                     split into compute, wait and comm (profiling), and dbs re-plans the
                     vector for the next epoch; returns the epoch's EpochStats

Emulated heterogeneity (heterogeneity.Emulator, `speeds=`) lives here too: the
optimizer asks the balancer to stretch each step's compute before the collective.
The method, with its formulas: docs/method.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import allocation, comm as mpi, sharding
from .config import UserError
from .devices import model_device
from .heterogeneity import Emulator
from .profiling import StepTimes, model_step, split_wait, time_step

POLICIES = ("ssgd", "static", "dbs")


def calibration_batches(global_batch: int, world_size: int, min_local: int = 1,
                        max_local: int | None = None) -> tuple[int, int]:
    """The two local batches the start-up calibration times: about half and twice the
    equal share B/n (within the bounds), so that the fit spans the vector's range."""
    small = max(min_local, global_batch // (2 * world_size))
    large = max(small + 1, min(global_batch, 2 * global_batch // world_size))
    if max_local:
        large = min(large, max_local)
        small = min(small, max(1, large - 1))
    return small, large


def calibrate(comm, step, small: int, large: int, *, steps: int = 5, warmup: int = 2, stretch=None,
              affine: bool = True, timeout: float = 600.0) -> tuple[allocation.SpeedModel, np.ndarray]:
    """Collective: every rank times step(small) and step(large); returns the fitted
    speed model of every rank and the (ranks x 2) median step times."""
    t_small = time_step(step, small, steps, warmup, stretch)
    t_large = time_step(step, large, steps, warmup, stretch)
    times = mpi.allgather_array(comm, [t_small, t_large], timeout)
    n = comm.Get_size()
    fit = allocation.SpeedModel.fit(np.full(n, small), times[:, 0], np.full(n, large), times[:, 1], affine=affine)
    return fit, times


@dataclass
class EpochStats:
    """What one epoch did, on every rank alike (gathered at end_epoch). R ranks, S steps."""
    epoch: int                  # 0-based
    batch_sizes: np.ndarray     # (R,) the vector the epoch ran with (its full steps)
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
    next_batch_sizes: np.ndarray  # (R,) the vector of the next epoch (dbs may have re-planned)
    diagnostics: dict = field(default_factory=dict)   # dbs: speed_ratio (R,) measured / predicted

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
                    compute_time=self.compute_time, comm_time=self.comm_time, wait_time=self.wait_time,
                    data_time=self.data_time, speed=self.speed, steps=np.int64(self.steps), **self.diagnostics)

    def step_rows(self, epoch_index: int) -> dict:
        """The epoch's rows of step/* in the result file."""
        return dict(loss=self.step_loss, epoch=np.full(self.steps, epoch_index, dtype=np.int64),
                    compute_time=self.step_compute, comm_time=self.step_comm, wait_time=self.step_wait)


@dataclass
class _Epoch:
    """The open epoch's bookkeeping on this rank."""
    epoch: int
    table: np.ndarray
    times: StepTimes
    step: int                   # steps done
    start: float                # perf_counter when the epoch (or its resumed part) began
    elapsed_before: float       # seconds of this epoch before a stop (resumed epochs)
    last_end: float             # perf_counter at the end of the last step


class Balancer:
    """Owns the batch vector of a policy (ssgd | static | dbs) and the epochs' timing.

    comm: the ranks that train together. global_batch: B, samples per step over all ranks.
    min_local_batch / max_local_batch: bounds of every local batch of a full step (0: no
    upper bound). dbs_model: "affine" (t = a + c b) or "proportional" (t = c b, the DBS
    paper's rule); smoothing, follow, min_gain: the DBS controller's damping (see
    allocation.DBSController). speeds: emulated relative speeds, one per rank (or an
    `emulator`, for disturbances too). timeout: seconds any collective may wait."""

    def __init__(self, comm, global_batch: int, policy: str = "dbs", *, min_local_batch: int = 1,
                 max_local_batch: int = 0, dbs_model: str = "affine", smoothing: float = 0.5, follow: float = 0.25,
                 min_gain: float = 0.03, speeds=None, emulator: Emulator | None = None, timeout: float = 600.0):
        if policy not in POLICIES:
            raise UserError(f"policy: must be one of {', '.join(POLICIES)}; got {policy!r}")
        if dbs_model not in ("affine", "proportional"):
            raise UserError(f"dbs_model: must be affine or proportional; got {dbs_model!r}")
        self.comm, self.rank, self.world_size = comm, comm.Get_rank(), comm.Get_size()
        allocation.check_feasible(global_batch, self.world_size, min_local_batch, max_local_batch or None)
        self.policy, self.global_batch = policy, int(global_batch)
        self.min_local, self.max_local = int(min_local_batch), int(max_local_batch) or None
        self.affine, self.timeout = dbs_model == "affine", float(timeout)
        self.damping = dict(smoothing=smoothing, follow=follow, min_gain=min_gain)
        if speeds is not None and len(speeds) and len(speeds) != self.world_size:
            raise UserError(f"speeds: has {len(speeds)} values but there are {self.world_size} ranks")
        if emulator is None:
            speed = speeds[self.rank] / max(speeds) if speeds is not None and len(speeds) else 1.0
            emulator = Emulator(self.rank, speed)
        self.emulator = emulator
        self.batch_sizes = allocation.equal(self.global_batch, self.world_size, self.min_local, self.max_local)
        self.speed_model: allocation.SpeedModel | None = None
        self.controller: allocation.DBSController | None = None
        self.startup: dict | None = None      # the calibration: local_batch (2,), step_time (R, 2), batch_sizes
        self.next_epoch = 0                   # epochs ended so far
        self._open: _Epoch | None = None
        self._restored: dict | None = None    # a mid-epoch position from load_state_dict

    @classmethod
    def from_config(cls, comm, cfg, emulator: Emulator | None = None) -> "Balancer":
        """The balancer of a dbs-mpi configuration (config.Config) and its emulated speeds."""
        return cls(comm, cfg.global_batch, cfg.strategy, min_local_batch=cfg.min_local_batch,
                   max_local_batch=cfg.max_local_batch, dbs_model=cfg.dbs_model, smoothing=cfg.dbs_smoothing,
                   follow=cfg.dbs_follow, min_gain=cfg.dbs_min_gain,
                   emulator=emulator or Emulator.from_config(cfg, comm.Get_rank()), timeout=cfg.comm_timeout)

    @property
    def local_batch(self) -> int:
        """This rank's local batch of a full step."""
        return int(self.batch_sizes[self.rank])

    # --- calibration --------------------------------------------------------------
    def calibration_batches(self) -> tuple[int, int]:
        return calibration_batches(self.global_batch, self.world_size, self.min_local, self.max_local)

    def calibrate(self, step, steps: int = 5, warmup: int = 2) -> np.ndarray:
        """Collective. Time `step(b)` (one forward and backward on b samples, on a copy of
        the model: see profiling.model_step) at two local batches on every rank, fit every
        rank's step time, and (static, dbs) allocate the vector from it. Returns the vector.
        A step on a GPU must synchronise the device before it returns (model_step does),
        and the balancer must know the device (`on_device`; calibrate_model tells it)."""
        small, large = self.calibration_batches()
        fit, times = calibrate(self.comm, step, small, large, steps=steps, warmup=warmup,
                               stretch=self.emulator.stretch, affine=self.affine, timeout=self.timeout)
        self.speed_model = fit
        if self.policy != "ssgd":
            self.batch_sizes = fit.allocate(self.global_batch, self.min_local, self.max_local)
        if self.policy == "dbs":
            self.controller = allocation.DBSController(model=fit, global_batch=self.global_batch,
                                                       min_local=self.min_local, max_local=self.max_local,
                                                       **self.damping)
        self.startup = {"local_batch": np.array([small, large], dtype=np.int64), "step_time": times,
                        "batch_sizes": self.batch_sizes.copy()}
        return self.batch_sizes

    def calibrate_model(self, model, loss_fn, dataset, steps: int = 5, warmup: int = 2) -> np.ndarray:
        """calibrate() with the usual step: loss_fn(model(x), y).backward() on a copy of
        `model`, x and y the first samples of `dataset` (a map-style dataset)."""
        from .data import first_samples
        self.on_device(model_device(model))
        inputs, targets = first_samples(dataset, self.calibration_batches()[1])
        return self.calibrate(model_step(model, loss_fn, inputs, targets), steps, warmup)

    def on_device(self, device) -> None:
        """This rank computes on `device`: on a GPU, emulated speeds stretch the step's wall
        time (DistributedOptimizer and calibrate_model tell the balancer)."""
        self.emulator.wall_clock = torch.device(device).type == "cuda"

    # --- an epoch -----------------------------------------------------------------
    def begin_epoch(self, epoch: int, num_samples: int, drop_last: bool = False, first_step: int = 0) -> np.ndarray:
        """Open `epoch`: its (steps x ranks) table of local batches, from the current vector.
        first_step > 0 continues an epoch stopped there (load_state_dict first)."""
        if self._open is not None:
            raise RuntimeError(f"epoch {self._open.epoch + 1} is still open: call balancer.end_epoch() after every "
                               f"epoch, before the next one begins")
        if self.policy == "static" and self.speed_model is None and first_step == 0 and epoch == 0:
            raise RuntimeError("policy 'static' allocates from the start-up calibration: call balancer.calibrate() "
                               "(or calibrate_model()) before the first epoch")
        table = sharding.step_batch_sizes(num_samples, self.global_batch, self.batch_sizes, drop_last)
        if len(table) == 0:
            raise UserError(f"global_batch: {self.global_batch} is larger than the {num_samples} training samples "
                            f"(with drop_last nothing is left)")
        times, elapsed, restored = StepTimes(len(table)), 0.0, self._restored
        self._restored = None
        if first_step == 0:
            self.emulator.start_epoch(epoch, len(table))
        elif restored is not None and (restored["epoch"], restored["step"]) == (epoch, first_step):
            times.restore(restored["times"])
            elapsed = float(restored["elapsed"])
        else:
            raise RuntimeError(f"begin_epoch at step {first_step} of epoch {epoch + 1}: the balancer's state saved "
                               f"there must be loaded first (load_state_dict)")
        now = time.perf_counter()
        self._open = _Epoch(epoch, table, times, first_step, now, elapsed, now)
        return table

    @property
    def open_epoch(self) -> int | None:
        """The epoch begun and not ended yet, or None."""
        return None if self._open is None else self._open.epoch

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

    def stretch(self, compute_seconds: float, cpu_seconds: float | None = None) -> float:
        """Sleep as the emulated device would be slower (heterogeneity.Emulator.stretch)."""
        return self.emulator.stretch(compute_seconds, cpu_seconds)

    def record_step(self, data: float, pre: float, collective: float, update: float,
                    loss: float = float("nan")) -> None:
        """One step's phase times (seconds) on this rank and the step's global loss."""
        e = self._open
        e.times.record(e.step, data, pre, collective, update, loss)
        e.step += 1
        e.last_end = time.perf_counter()

    def end_epoch(self) -> EpochStats:
        """Collective: close the open epoch on every rank, gather everybody's step times,
        and (dbs) re-plan the vector. Returns what the epoch did."""
        e = self._open
        if e is None:
            raise RuntimeError("end_epoch() without an open epoch (a HeteroSampler opens it when iterated)")
        if e.step != len(e.table):
            raise RuntimeError(f"end_epoch() after {e.step} of the {len(e.table)} steps of epoch {e.epoch + 1}: every "
                               f"rank takes every step (one optimizer.step() per batch of the HeteroSampler)")
        duration = e.elapsed_before + e.last_end - e.start
        gathered = mpi.allgather_array(self.comm, e.times.as_array(), self.timeout)     # (R, 6, S)
        data_t, compute_t, collective_t, _, pre_t, loss = (gathered[:, i, :] for i in range(6))
        wait_t, comm_t = split_wait(pre_t, collective_t)
        vector = self.batch_sizes.copy()
        diagnostics = self._replan(e.table, pre_t.sum(axis=1))
        self._open, self.next_epoch = None, e.epoch + 1
        return EpochStats(
            epoch=e.epoch, batch_sizes=vector, table=e.table, duration=duration, data_time=data_t.sum(axis=1),
            compute_time=compute_t.sum(axis=1), comm_time=comm_t.sum(axis=1), wait_time=wait_t.sum(axis=1),
            speed=e.table.sum(axis=0) / np.maximum(pre_t.sum(axis=1), 1e-12), step_loss=loss[0],
            step_compute=compute_t.T, step_comm=comm_t.T, step_wait=wait_t.T,
            next_batch_sizes=self.batch_sizes.copy(), diagnostics=diagnostics)

    def _replan(self, table: np.ndarray, pre_compute: np.ndarray) -> dict:
        """dbs: the controller's new vector from the epoch's measured compute times."""
        if self.policy != "dbs":
            return {}
        if self.controller is None:      # not calibrated: start from the first epoch's measurement
            self.speed_model = allocation.SpeedModel.measured(table.sum(axis=0), pre_compute)
            self.controller = allocation.DBSController(model=self.speed_model, global_batch=self.global_batch,
                                                       min_local=self.min_local, max_local=self.max_local,
                                                       **self.damping)
        new, ratio = self.controller.update(self.batch_sizes, table, pre_compute)
        # Every rank computed the same vector from the same gathered numbers; rank 0's
        # copy is broadcast anyway so that float quirks can never split the ranks.
        new = np.ascontiguousarray(new, dtype=np.int64)
        if self.world_size > 1:
            mpi.wait(self.comm.Ibcast(new, root=0), self.timeout, "broadcasting the new batch vector")
        self.batch_sizes = new
        return {"speed_ratio": ratio}

    # --- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's balancer: the vector, the models, and the open epoch's position and
        step times (a checkpoint in the middle of an epoch). Plain types and arrays."""
        e = self._open
        position = None if e is None else {
            "epoch": e.epoch, "step": e.step, "elapsed": e.elapsed_before + e.last_end - e.start,
            "times": e.times.snapshot(e.step)}
        return {"policy": self.policy, "global_batch": self.global_batch, "world_size": self.world_size,
                "batch_sizes": self.batch_sizes.copy(), "next_epoch": self.next_epoch,
                "speed_model": self.speed_model.state_dict() if self.speed_model is not None else None,
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "startup": self.startup, "open": position, "emulator": self.emulator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("policy", self.policy), ("global_batch", self.global_batch),
                          ("world_size", self.world_size)):
            if state[key] != mine:
                raise UserError(f"balancer: the state was saved with {key} {state[key]!r}, this balancer has {mine!r}")
        self.batch_sizes = np.asarray(state["batch_sizes"], dtype=np.int64).copy()
        self.next_epoch = int(state["next_epoch"])
        self.speed_model = None if state["speed_model"] is None else \
            allocation.SpeedModel.from_state(state["speed_model"])
        self.controller = None if state["controller"] is None else \
            allocation.DBSController.from_state(state["controller"])
        self.startup = state["startup"]
        self.emulator.load_state_dict(state["emulator"])
        self._open, self._restored = None, state["open"]
