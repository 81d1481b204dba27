"""The run to simulate (Job: the parts of config.Config that matter here) and what it did
(Result), and which strategies are synchronous.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..machine import ModelCost

SYNC, ASYNC = ("ssgd", "static", "dbs"), ("asgd", "nsoftsync", "dbs-sgd")


@dataclass
class Job:
    """The training run to simulate (the parts of config.Config that matter here)."""
    strategy: str
    model: ModelCost
    samples: int                     # training samples
    global_batch: int
    epochs: int
    speeds: tuple = ()               # emulated relative speeds (heterogeneity.Emulator), () = none
    couple: dict = field(default_factory=dict)   # coupled speeds {rank: K}: K times slower while another rank of its host computes
    drop_last: bool = False
    min_local_batch: int = 1
    max_local_batch: int = 0
    dbs_model: str = "affine"
    dbs_smoothing: float = 0.5
    dbs_follow: float = 0.25
    dbs_min_gain: float = 0.03
    dbs_interval: str = "1"          # dbs: re-plan every N steps, or "epoch"
    dbs_window: int = 32
    participation: str = "auto"      # auto: static and dbs leave out a rank that would slow every step | all
    benchmark_steps: int = 5
    softsync_n: int = 1
    softsync_wait: bool = False
    seed: int = 0
    disturbances: dict = field(default_factory=dict)   # slow_rank, slow_factor, slow_epochs/steps/seconds, sleep_*
    data_per_sample: float = 0.0     # seconds of reading one sample
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    residual: dict = field(default_factory=dict)   # the machine's (machine.Machine.residual)
    compute_extra: dict = field(default_factory=dict)   # the machine's (Machine.compute_extra): replays only
    global_batches: tuple = ()       # a replay of global_batch = auto: the B of every epoch, as recorded
    adaptive: dict = field(default_factory=dict)   # a projection of it: start, lower, upper, rule, noise (adaptive.py)


@dataclass
class Result:
    """What a simulated run did."""
    epoch_time: list = field(default_factory=list)     # seconds per epoch
    batch_sizes: list = field(default_factory=list)    # the vector of every epoch
    compute: float = 0.0                               # seconds summed over ranks and epochs
    comm: float = 0.0
    wait: float = 0.0
    staleness: list = field(default_factory=list)      # asynchronous: every applied gradient's
    simulate_seconds: float = 0.0

    def shares(self) -> dict:
        total = max(self.compute + self.comm + self.wait, 1e-30)
        return {"compute_share": self.compute / total, "comm_share": self.comm / total,
                "wait_share": self.wait / total}

    def as_dict(self) -> dict:
        out = {"epoch_time_predicted": [float(t) for t in self.epoch_time],
               "batch_sizes": [[int(b) for b in v] for v in self.batch_sizes],
               "global_batches": [int(sum(v)) for v in self.batch_sizes], **self.shares(),
               "simulate_seconds": self.simulate_seconds}
        if self.staleness:
            s = np.asarray(self.staleness)
            out.update(staleness_mean=float(s.mean()), staleness_max=int(s.max()))
        return out
