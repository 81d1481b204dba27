"""Gradient accumulation: a rank's local batch in several micro-batches, one exchange a step.

A fast device's share b_i of the global batch may not fit in its memory at once. The
rank then runs it as micro-batches of at most m samples, each a forward and a
backward, and the gradients accumulate in the exchange buffer; the step's exchange and
the optimizer's update run once, after the last one. For the step to be the one a
single process makes on the global batch, micro-batch k of n_k samples, whose loss is
a mean over its own samples, must count with the share n_k / b_i:

    sum_k (n_k / b_i) grad(mean loss of micro-batch k) = grad(mean loss of the local batch)

and the exchange then weights the local batch by b_i / B as always (docs/method.md). So
each micro-batch's backward goes through `DistributedOptimizer.backward(loss)`, which
seeds autograd with (b_i / B) (n_k / b_i): no scaling pass, and nothing a user must
remember. Buckets that overlap the exchange with backward are held until the last
micro-batch's backward (an earlier start would reduce a partial sum).

SyncBatchNorm normalises over the step's global batch; split into micro-batches it
would normalise over parts of it, and the step would depend on the batch vector: a
model with SyncBatchNorm layers is refused (GroupNorm or LayerNorm do not mind).

No MPI here: `MicroBatches` only cuts the tensors and keeps each micro-batch's share.
"""
from __future__ import annotations

import math

import torch


class MicroBatches:
    """The micro-batches of the step under way (DistributedOptimizer.micro_batches)."""

    def __init__(self, exchange, synced_batchnorm: bool):
        self.exchange, self.synced_batchnorm = exchange, synced_batchnorm
        self.share = None                  # n_k / b_i of the micro-batch under way (None: not accumulating)
        self.backwards = 0                 # backward() calls so far
        self.loss = None                   # sum_k (n_k / b_i) loss_k of the step: the local batch's mean loss

    def split(self, tensors, size: int):
        """Yield `tensors` (each with the local batch first) in micro-batches of at most
        `size` samples; each must have one `backward` of its loss."""
        tensors = tuple(tensors) if isinstance(tensors, (tuple, list)) else (tensors,)
        size = int(size)
        if size < 1:
            raise ValueError(f"micro_batches: size must be at least 1; got {size}")
        local = len(tensors[0])
        if any(len(t) != local for t in tensors):
            raise ValueError(f"micro_batches: the tensors hold {[len(t) for t in tensors]} samples; they must "
                             f"hold the same local batch")
        count = max(1, math.ceil(local / size))
        if self.synced_batchnorm:      # refused on every rank alike, whatever its local batch
            raise ValueError("micro_batches: the model's SyncBatchNorm layers normalise over the step's global "
                             "batch, which micro-batches would cut into parts (the step would depend on the batch "
                             "vector); use GroupNorm or LayerNorm, or a local batch that fits at once")
        self.loss = None
        try:
            for k, parts in enumerate(zip(*(t.split(size) for t in tensors))):
                self.share = len(parts[0]) / local
                self.exchange.hold(k < count - 1)
                before = self.backwards
                yield parts if len(parts) > 1 else parts[0]
                if self.backwards != before + 1:
                    raise RuntimeError("micro_batches: call optimizer.backward(loss) once for each micro-batch (it "
                                       "counts the micro-batch with its share of the local batch); a plain "
                                       "loss.backward() would weight it wrongly")
        finally:
            self.share = None
            self.exchange.hold(False)

    def backward(self, loss: torch.Tensor, scaler=None) -> None:
        """One micro-batch's (or, outside split, the whole local batch's) backward, its
        share seeded into autograd with the exchange's weight; `scaler`: fp16's
        GradScaler, whose scale multiplies the seed too."""
        share = 1.0 if self.share is None else self.share
        root = loss if scaler is None else scaler.scale(loss)
        self.exchange.backward(root, share)
        self.backwards += 1
        if self.share is not None:
            part = loss.detach().float() * share
            self.loss = part if self.loss is None else self.loss + part

    def step_loss(self, loss):
        """The loss step() records: the caller's, else the accumulated one (then forgotten)."""
        accumulated, self.loss = self.loss, None
        return loss if loss is not None else accumulated
