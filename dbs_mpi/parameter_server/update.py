"""The parameter server's update rule: how a group of gradients becomes one update.

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

c, the gradients per update, is 1 for asgd and dbs-sgd and floor(lambda / n) for
n-softsync; in rounds (hardsync) it is lambda.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..training.named_optimizers import SGD, fused, make_optimizer
from .groups import group_size, in_rounds
from .protocol import bind_gradients


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


def warm_up_optimizer() -> None:
    """torch's first optimizer step does work of its own: do it before the clocks start,
    on a throwaway parameter."""
    dummy = torch.zeros(1, requires_grad=True)
    dummy.grad = torch.zeros(1)
    fused(SGD, [dummy], lr=0.1, momentum=0.9).step()      # (the update the server runs)


class UpdateRule:
    """The open group of gradients and the optimizer that applies it to `weights` (the
    flat tensor the parameters are views of). `version` counts the updates applied."""

    def __init__(self, cfg, params, weights: torch.Tensor, workers: int):
        self.weights = weights
        self.acc = torch.zeros_like(weights)           # sum_i s_i b_i g_i, then the update's g
        bind_gradients(params, self.acc)
        self.c = group_size(cfg.strategy, workers, cfg.softsync_n)
        self.momentum = server_momentum(cfg, workers, self.c)
        self.optimizer = make_optimizer(cfg.optimizer, params, replace(cfg, momentum=self.momentum))
        warm_up_optimizer()
        rounds = in_rounds(cfg.strategy, cfg.softsync_wait, cfg.softsync_n, workers)
        # Divisor of an update's sample-weighted gradient sum (None: the group's samples);
        # aggregation "mean": every gradient counts once, the group's mean (docs/method.md).
        self.divisor = None if rounds else self.c * cfg.global_batch / workers
        self.per_gradient = cfg.aggregation == "mean"
        self.staleness_lr = cfg.staleness_lr
        self.before = torch.empty_like(weights)        # the weights before an update (its step's norm)
        self.group: list[tuple] = []                   # (worker, timestamp, count, loss, epoch, weight)
        self.group_samples = 0
        self.version = 0

    def add(self, w: int, timestamp: int, count: int, loss: float, epoch: int, gradient) -> None:
        """Worker w's mean gradient over `count` samples, computed on version `timestamp`,
        into the open group with its weight (its samples, over its staleness if
        cfg.staleness_lr). The version does not change until the group is applied."""
        tau = self.version - timestamp
        scale = 1.0 / max(tau, 1) if self.staleness_lr else 1.0
        weight = (1.0 if self.per_gradient else count) * scale if count else 0.0
        if count:
            self.acc.add_(gradient, alpha=weight)
        self.group_samples += count
        self.group.append((w, timestamp, count, loss, epoch, weight))

    @property
    def full(self) -> bool:
        return len(self.group) >= self.c

    def apply(self) -> tuple[list[tuple], float, float]:
        """Apply the open group as one update; returns (its gradients, the divisor, the
        norm of the step). A group without samples changes nothing but the version."""
        divisor, step_norm = self.update_divisor(), 0.0
        if self.group_samples:
            self.acc.div_(divisor)
            self.before.copy_(self.weights)
            self.optimizer.step()
            step_norm = float(self.before.sub_(self.weights).norm())
        group = self.group
        self.version += 1
        self.acc.zero_()
        self.group, self.group_samples = [], 0
        return group, divisor, step_norm

    def update_divisor(self) -> float:
        """What the group's weighted gradient sum is divided by: per gradient ("mean"), the
        gradients with samples; sample-weighted, c B / lambda (or, in rounds, the samples)."""
        if self.per_gradient:
            return float(max(1, sum(1 for g in self.group if g[2])))
        return float(self.divisor or max(self.group_samples, 1))
