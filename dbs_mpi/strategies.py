"""Synchronous data-parallel strategies: who gets how many samples, and how gradients
are combined. Strategies own the communication; the training loop only calls
zero_grad(), backward(), reduce() and end_epoch().

  ssgd    equal local batches, fixed (the baseline every paper compares to)
  static  local batches from the start-up benchmark, fixed for the run
          (static load balancing, Moreno-Alvarez et al. 2020)
  dbs     re-allocated after every epoch from that epoch's measured compute time
          (DBS, Ye et al.; allocation.DBSController)

Aggregation (RESEARCH.md section 1):
  weighted  g = sum_i (b_i / B) g_i : the gradient of the mean loss over the global
            batch, the same update as one process on the whole batch (default)
  mean      g = (1/n) sum_i g_i : plain averaging, over-weights small local batches
"""
from __future__ import annotations

import numpy as np

from . import allocation
from .comm import GradientExchange


class SyncStrategy:
    name = "sync"

    def __init__(self, comm, params, cfg, speed_model: allocation.SpeedModel, sleep_while_waiting: bool = False):
        self.comm = comm
        self.cfg = cfg
        self.world_size = comm.Get_size()
        self.aggregation = cfg.aggregation
        self.exchange = GradientExchange(comm, params, cfg.comm_timeout, sleep_while_waiting,
                                         bucket_bytes=int(cfg.bucket_mb * 2 ** 20),
                                         first_bucket_bytes=int(cfg.first_bucket_mb * 2 ** 20))
        self.max_local = cfg.max_local_batch or None
        self.speed_model = speed_model
        self.batch_sizes = self.initial_batch_sizes()

    def initial_batch_sizes(self) -> np.ndarray:
        raise NotImplementedError

    def zero_grad(self, local_batch: int | None = None, step_batch_sizes=None) -> None:
        """Zero the gradients and begin a step. Given the step's local batches, the
        weight is known before backward, so gradient buckets can start reducing while
        backward still runs (comm.GradientExchange); without, they start in reduce()."""
        weight = None if local_batch is None else self.weight(local_batch, step_batch_sizes)
        self.exchange.zero_grad(weight)

    def backward(self, loss) -> None:
        """loss.backward(), with the gradients weighted by this rank's share b_i/B as
        autograd produces them (the weight given to zero_grad; see comm.GradientExchange)."""
        self.exchange.backward(loss)

    def weight(self, local_batch: int, step_batch_sizes) -> float:
        """This rank's share of the global gradient for a step with these local batches."""
        if local_batch == 0:
            return 0.0
        if self.aggregation == "mean":
            return 1.0 / int(np.count_nonzero(step_batch_sizes))
        return local_batch / float(np.sum(step_batch_sizes))

    def reduce(self, local_loss: float, local_batch: int, step_batch_sizes) -> float:
        """Combine the ranks' gradients in place; returns the step's global mean loss."""
        share = local_loss * local_batch / float(np.sum(step_batch_sizes))
        return self.exchange.allreduce(self.weight(local_batch, step_batch_sizes), share)

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue with the same vector (and controller)."""
        return {"batch_sizes": self.batch_sizes.copy()}

    def load_state(self, state: dict) -> None:
        self.batch_sizes = np.asarray(state["batch_sizes"], dtype=np.int64)

    def end_epoch(self, step_batch_sizes, pre_compute) -> dict:
        """Called on every rank with the same arguments (gathered timings). May change
        self.batch_sizes for the next epoch. Returns diagnostics for the results."""
        return {}


class SSGD(SyncStrategy):
    name = "ssgd"

    def initial_batch_sizes(self):
        return allocation.equal(self.cfg.global_batch, self.world_size, self.cfg.min_local_batch, self.max_local)


class Static(SyncStrategy):
    name = "static"

    def initial_batch_sizes(self):
        return self.speed_model.allocate(self.cfg.global_batch, self.cfg.min_local_batch, self.max_local)


class DBS(Static):
    name = "dbs"

    def __init__(self, comm, params, cfg, speed_model, sleep_while_waiting=False):
        super().__init__(comm, params, cfg, speed_model, sleep_while_waiting)
        self.controller = allocation.DBSController(
            model=speed_model, global_batch=cfg.global_batch, min_local=cfg.min_local_batch,
            max_local=self.max_local, smoothing=cfg.dbs_smoothing, follow=cfg.dbs_follow,
            min_gain=cfg.dbs_min_gain)

    def state_dict(self):
        return {**super().state_dict(), "controller": self.controller}

    def load_state(self, state):
        super().load_state(state)
        self.controller = state["controller"]

    def end_epoch(self, step_batch_sizes, pre_compute):
        new, ratio = self.controller.update(self.batch_sizes, step_batch_sizes, pre_compute)
        # Every rank computed the same vector from the same gathered numbers; rank 0's
        # copy is broadcast anyway so that float quirks can never split the ranks.
        self.batch_sizes = np.asarray(self.comm.bcast(new, root=0), dtype=np.int64)
        return {"speed_ratio": ratio}


STRATEGIES = {cls.name: cls for cls in (SSGD, Static, DBS)}


def make_strategy(comm, params, cfg, speed_model, sleep_while_waiting=False) -> SyncStrategy:
    return STRATEGIES[cfg.strategy](comm, params, cfg, speed_model, sleep_while_waiting)
