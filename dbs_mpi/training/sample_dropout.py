"""Dropout keyed by sample: the same masks whatever the batch vector, rank or launch.

torch's Dropout draws its mask from the rank's random stream, position by position in
the rank's local batch, so a sample's mask depends on which rank computed it and where
in its local batch it stood: two launches whose calibrations gave two vectors, or a
resume whose vector differs from the run never stopped, train on other masks, and differ
as much as two dropout seeds (relative L2 3e-2 after a few epochs).

`SampleDropout` keys each element's mask by (seed, layer, epoch, step, the sample's
position in the step's global batch, the element's index in the sample). The position is
the rank's offset in the step's row (the ranks before it hold the global batch's first
samples: sharding.py) plus the sample's place in the local batch (plus the micro-batches
before it in the step), so a sample gets the same mask on any rank, at any vector, in any
launch: runs with dropout then agree up to float rounding as runs without it do
(allocation invariance), and 2 uneven ranks match 1 rank.

The mask is a counter-based hash (a 32-bit integer mix, exact in int64 arithmetic on any
device, so CPUs and GPUs draw the same masks), computed where the activations are: no
random stream is touched, nothing moves to the host. Outside a balancer's epoch (the
calibration times a copy of the model) it is torch's dropout.

    dbs_mpi.convert_dropout(model, balancer, seed=0)   # every nn.Dropout -> SampleDropout

Only nn.Dropout modules are converted: the functional dropout inside
nn.MultiheadAttention (its dropout= argument) and Dropout1d/2d/3d keep torch's stream.
A layer is assumed to run once per forward (a module applied twice in one forward would
count its samples twice).
"""
from __future__ import annotations

import zlib

import numpy as np
import torch
from torch import nn

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) as int64, without int64 overflow."""
    high, low = x >> 16, x & 0xFFFF
    return (low * c + (((high * c) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (Wellons' lowbias32) of x in [0, 2^32), elementwise, int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(base: int, positions: torch.Tensor, per_sample: int) -> torch.Tensor:
    """(n, per_sample) float32 in [0, 1): element e of the sample at global position p, from
    the step's 32-bit key `base`; the same numbers on every device."""
    sample = hash32((positions.to(torch.int64) + base) & MASK32)
    element = torch.arange(per_sample, dtype=torch.int64, device=positions.device)
    bits = hash32((sample[:, None] ^ hash32(element + 0x9E3779B9)[None, :]) & MASK32)
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


class SampleDropout(nn.Dropout):
    """nn.Dropout whose mask is keyed by sample (see the module's docstring). `balancer`:
    the dbs_mpi.Balancer whose HeteroSampler feeds the loop; `layer`: this layer's number
    in the model (its own stream)."""

    def __init__(self, p: float, balancer, seed: int = 0, layer: int = 0, inplace: bool = False):
        super().__init__(p, inplace)
        self.balancer, self.seed, self.layer = balancer, int(seed), int(layer)
        self._step = None               # (epoch, step) of the samples counted in `_seen`
        self._seen = 0                  # samples this layer saw in that step (micro-batches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.balancer
        if not self.training or self.p == 0.0 or x.dim() == 0 or not b.step_pending:
            return super().forward(x)
        step = (b.open_epoch, b.step)
        if step != self._step:
            self._step, self._seen = step, 0
        row = b.step_batch_sizes()
        first = int(np.sum(row[:b.rank])) + self._seen
        self._seen += len(x)
        if self.p == 1.0:
            return x * 0.0
        key = zlib.crc32(np.array([self.seed, self.layer, step[0], step[1]], dtype=np.int64).tobytes())
        positions = torch.arange(first, first + len(x), device=x.device)
        keep = uniforms(key, positions, x[0].numel()).view_as(x) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def __deepcopy__(self, memo):
        """A copy (the calibration's probe, an EMA model) shares the balancer."""
        copy = SampleDropout(self.p, self.balancer, self.seed, self.layer, self.inplace)
        copy.train(self.training)
        return copy

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.seed}, layer={self.layer}"


def convert_dropout(model: nn.Module, balancer, seed: int = 0) -> nn.Module:
    """Replace every nn.Dropout in `model` (in place; returned) by a SampleDropout of the
    same p, numbered in the order of model.modules()."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, SampleDropout(child.p, balancer, seed, count, child.inplace))
                count += 1
    return model
