"""Sample-weighted synchronised BatchNorm: every rank normalises over the step's whole
global batch, whatever the vector of local batches.

    model = dbs_mpi.convert_sync_batchnorm(model, comm)      # before DistributedOptimizer

Why. A BatchNorm layer in training mode normalises with the mean and variance of the
batch it sees. Under uneven local batches each rank would see a different batch (one
sample, on a slow rank), so the update would depend on the vector and the ranks'
running statistics would drift apart. Here a layer computes on every rank, for each
channel c, the statistics of the union of the local batches:

    N = sum_i n_i,   mu = sum_i n_i mu_i / N,   var = sum_i n_i (var_i + (mu_i - mu)^2) / N

from every rank's count n_i (local samples times spatial positions), local mean mu_i and
local biased variance var_i (one allgather of 2C + 1 numbers per layer and step,
combined in float64 in rank order, so every rank gets the same bits). A rank without
samples in a partial step (HeteroSampler's placeholder sample) joins with n_i = 0: the
one thing its input cannot tell, which the layer reads, when it runs, from the
balancer's row of the step (StepShare), not from a hook, so a torch.compile'd model
(which runs no forward hook) trains the same. The training step is a graph break
(torch.compiler.disable): its collectives are Python, run eagerly at every call.
Running statistics are updated as torch does, with the unbiased variance var N / (N - 1),
momentum or (momentum=None) the cumulative average; eval mode uses them and sends nothing.

The backward pass is exact for the sample-weighted gradient. DistributedOptimizer sums
sum_i w_i g_i, with w_i = b_i / B (aggregation "weighted"; 1 / n' for "mean"), where g_i
is the gradient of rank i's own mean loss L_i. The input gradient of rank j must then be
d(sum_i w_i L_i)/dx_j / w_j, so each rank contributes its local sums weighted by its w_i:

    S1 = sum_i w_i sum_{s in i} dy_s,    S2 = sum_i w_i sum_{s in i} dy_s (x_s - mu)
    dx_j = gamma invstd (dy - S1 / (w_j N) - (x - mu) invstd^2 S2 / (w_j N))

(one allreduce of 2C numbers per layer). With equal weights this is torch's SyncBatchNorm;
with uneven batches torch's, which sums unweighted, gives a wrong input gradient. The
gradients of gamma and beta are local sums, weighted by the exchange like any parameter.

Where the numbers travel (a StatsChannel): through MPI on a duplicate of the
communicator, host-staged for GPU tensors, with the project's bounded waits; or through
the torch.distributed group of DistributedOptimizer's exchange when it is nccl or gloo
(the optimizer switches the layers over). The layers' own communicator keeps their small
collectives apart from the gradient buckets in flight during backward.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..mpi.collectives import allgather_array
from ..mpi.waits import wait


class MPIChannel:
    """Small float64 collectives on a duplicate of `comm` (bounded; GPU tensors go
    through host memory)."""

    def __init__(self, comm: MPI.Comm, timeout: float = 600.0):
        self.parent, self.timeout = comm, float(timeout)
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.comm = comm
        self.seconds = 0.0            # spent in the layers' collectives (staging included): benchmarks read it
        if self.size > 1:
            self.comm, request = comm.Idup()
            wait(request, self.timeout, "duplicating the communicator for SyncBatchNorm")

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """(size, k): every rank's row, in rank order."""
        start = time.perf_counter()
        out = allgather_array(self.comm, row.detach().cpu().numpy(), self.timeout)
        result = torch.from_numpy(out).to(row.device)
        self.seconds += time.perf_counter() - start
        return result

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        array = np.ascontiguousarray(values.detach().cpu().numpy(), dtype=np.float64)
        wait(self.comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), self.timeout, "SyncBatchNorm's backward")
        result = torch.from_numpy(array).to(values.device)
        self.seconds += time.perf_counter() - start
        return result

    def same_ranks(self, comm: MPI.Comm) -> bool:
        return MPI.Comm.Compare(self.parent, comm) in (MPI.IDENT, MPI.CONGRUENT)

    def __deepcopy__(self, memo):
        return self          # a copy of the model (an EMA, the calibration's probe) shares the channel


class TorchChannel:
    """The same collectives through a torch.distributed group (nccl: on the GPU)."""

    def __init__(self, group, parent: MPI.Comm):
        self.group, self.parent = group, parent
        self.size, self.rank = parent.Get_size(), parent.Get_rank()
        self.seconds = 0.0            # launch time on a GPU (the collective runs on NCCL's stream)

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        rows = [torch.empty_like(row) for _ in range(self.size)]
        torch.distributed.all_gather(rows, row.contiguous(), group=self.group)
        result = torch.stack(rows)
        self.seconds += time.perf_counter() - start
        return result

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        values = values.contiguous()
        torch.distributed.all_reduce(values, group=self.group)
        self.seconds += time.perf_counter() - start
        return values

    def same_ranks(self, comm: MPI.Comm) -> bool:
        return MPI.Comm.Compare(self.parent, comm) in (MPI.IDENT, MPI.CONGRUENT)

    def __deepcopy__(self, memo):
        return self


class StepShare:
    """What a step's layers need to know beyond their input, read when they run (so a
    torch.compile'd model, which skips forward hooks, gets it too): whether the input is a
    placeholder sample (a rank whose local batch is 0 gets one, which must count 0), and
    this rank's weight w_i in the exchange. Both come from the balancer's row of the step
    under way (the one HeteroSampler served), given by DistributedOptimizer,
    sample_weighted(balancer=) or convert_sync_batchnorm(balancer=); `weigh(row, rank)` is
    the exchange's rule for w_i (None: the weighted rule b_i / B). `local` and `weight`
    set by hand win over the balancer. Without either: the input's length is the local
    batch, and w_i = n_i / N from the gathered counts."""

    def __init__(self, balancer=None, weigh=None):
        self.balancer, self.weigh = balancer, weigh
        self.local: int | None = None
        self.weight: float | None = None

    def step(self) -> tuple[int | None, float | None]:
        """(local batch, weight) of the step under way; None where it is not known."""
        local, weight, b = self.local, self.weight, self.balancer
        if b is not None and (local is None or weight is None) and b.step_pending:
            row = b.step_batch_sizes()
            if local is None:
                local = int(row[b.rank])
            if weight is None:
                weight = self.weigh(row, b.rank) if self.weigh is not None else \
                    (row[b.rank] / float(np.sum(row)) if row[b.rank] else 0.0)
        return local, weight

    def __deepcopy__(self, memo):
        return self          # a copy of the model (an EMA) runs the same steps: it shares the balancer

    def __reduce__(self):
        return (StepShare, ())       # a pickled model leaves the balancer (and its communicator) behind


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over any input of shape (N, C, ...) (1d, 2d, 3d) that normalises over all
    ranks' samples in training mode (module docstring). Arguments as torch.nn.BatchNorm2d's,
    plus `channel` (an MPIChannel; convert_sync_batchnorm sets it). Without a channel, or
    on one rank, it is plain BatchNorm."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, channel=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.channel = channel
        self.share = StepShare()
        _never_compiled()

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}")

    def _average_factor(self) -> float:
        """torch's factor for the running statistics (counting this batch, as torch does)."""
        if not (self.training and self.track_running_stats):
            return 0.0 if self.momentum is None else self.momentum
        self.num_batches_tracked.add_(1)
        return 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = self._average_factor()
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not self.training or self.channel is None or self.channel.size == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats, factor, self.eps)
        return _synchronised(input, self.weight, self.bias, running_mean, running_var, self.eps, factor,
                             self.channel, self.share)


def _synchronised(*args):
    """The layer's training step over all ranks, always run eagerly: in a torch.compile'd
    model it is a graph break, so its collectives (mpi4py, or torch.distributed) and the
    step's row (StepShare) are Python that runs at every call, never traced into a graph
    nor guarded on. The first SyncBatchNorm made puts torch.compiler.disable around it
    (_never_compiled): decorating here would import torch._dynamo into every run (1.3 s
    of CPU a rank), models without SyncBatchNorm included."""
    return _SyncBatchNormFunction.apply(*args)


def _never_compiled() -> None:
    """_synchronised becomes a graph break for torch.compile (once a process)."""
    global _synchronised
    if not getattr(_synchronised, "_never_compiled", False):
        _synchronised = torch.compiler.disable(_synchronised)
        _synchronised._never_compiled = True


def _per_channel(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast over (N, C, ...) of `dims` dimensions."""
    return t.view(1, -1, *([1] * (dims - 2)))


def global_statistics(rows: torch.Tensor, eps: float):
    """(N, mean, var) over all ranks from the gathered rows [n_i, mu_i (C), var_i (C)]
    (float64, combined in rank order: every rank gets the same bits)."""
    counts = rows[:, 0]
    channels = (rows.shape[1] - 1) // 2
    means, variances = rows[:, 1:1 + channels], rows[:, 1 + channels:]
    total = float(counts.sum())
    if total <= 1:
        raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over all ranks when training, got "
                         f"{total:g}")
    weights = (counts / total)[:, None]
    mean = (weights * means).sum(0)
    var = (weights * (variances + (means - mean) ** 2)).sum(0)
    return total, mean, var


class _SyncBatchNormFunction(torch.autograd.Function):
    """The layer in training mode. Elementwise work goes through torch's fused BatchNorm
    kernels (in their eval form, fed the global statistics); only the statistics and the
    two per-channel sums of the backward are this module's own."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, channel, share):
        x = x.contiguous()
        local, own_weight = share.step()
        placeholder = local == 0 or x.shape[0] == 0     # this rank has no samples in this step
        count = 0 if placeholder else x.numel() // x.shape[1]
        # Under autocast the input may be bf16 or fp16 while the parameters stay float32:
        # the statistics are taken in float32 (at least) and kept in the parameters' dtype,
        # which torch's BatchNorm kernels take beside a reduced-precision input.
        stat_dtype = _statistics_dtype(x, weight)
        if count:
            var_l, mean_l = torch.var_mean(x.to(torch.promote_types(x.dtype, torch.float32)),
                                           [0, *range(2, x.dim())], correction=0)
        else:
            var_l = mean_l = torch.zeros(x.shape[1], device=x.device, dtype=stat_dtype)
        row = torch.cat([torch.tensor([float(count)], device=x.device, dtype=torch.float64),
                         mean_l.to(torch.float64), var_l.to(torch.float64)])
        total, mean64, var64 = global_statistics(channel.gather(row), eps)
        mean, var = mean64.to(stat_dtype), var64.to(stat_dtype)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(factor * mean.to(running_mean.dtype))
            running_var.mul_(1 - factor).add_(factor * (var64 * total / (total - 1)).to(running_var.dtype))
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)     # (x - mean) / sqrt(var + eps) w + b
        ctx.save_for_backward(x, weight, mean, var)
        ctx.channel, ctx.total, ctx.count, ctx.eps = channel, total, count, eps
        ctx.own_weight = float(own_weight if own_weight is not None else count / total)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, var = ctx.saved_tensors
        dy = dy.contiguous()
        gain = weight if weight is not None else torch.ones_like(mean)
        need_input = ctx.needs_input_grad[0]                 # the same on every rank: the same model
        if ctx.count:
            # eval-form BatchNorm backward with the global statistics: gamma invstd dy, and the
            # local sums of dy x_hat (gamma's gradient) and of dy (beta's). The saved statistics
            # are empty, not None: CUDA's kernel for 2-d and channels-last inputs asserts that
            # they are given, and takes the running ones (here the global) when they are empty.
            unsaved = mean.new_empty(0)
            partial, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, gain, mean, var, unsaved, unsaved, False, ctx.eps, [need_input, True, True])
        else:                                                 # a placeholder sample: no part in anything
            partial, sum_dy_xhat, sum_dy = None, torch.zeros_like(mean), torch.zeros_like(mean)
        grad_weight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_input = None
        if need_input:
            w = ctx.own_weight
            sums = ctx.channel.sum(torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64) * w)
            if w > 0 and ctx.count:
                grad_input = _input_gradient(partial, x, gain, mean, var, ctx.eps, sums, w * ctx.total)
            else:
                grad_input = torch.zeros_like(x)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _statistics_dtype(x: torch.Tensor, weight) -> torch.dtype:
    """The dtype of the global mean and variance: the affine parameters' (float32 under
    autocast, whatever the input's), else the input's promoted to at least float32."""
    if weight is not None:
        return weight.dtype
    return torch.promote_types(x.dtype, torch.float32)


def _input_gradient(partial, x, gain, mean, var, eps, sums, scale):
    """dx = gamma invstd (dy - S1 / (w N) - x_hat S2' / (w N)), with S1 = sum_i w_i sum dy,
    S2' = sum_i w_i sum dy x_hat (= invstd S2), written as partial + b x + c per channel
    (partial = gamma invstd dy from the fused kernel)."""
    channels = mean.numel()
    invstd = torch.rsqrt(var.to(torch.float64) + eps)
    s1, s2 = sums[:channels] / scale, sums[channels:] / scale
    g = gain.to(torch.float64) * invstd
    b = -g * invstd * s2
    c = -g * s1 - b * mean.to(torch.float64)
    return torch.addcmul(partial, x, _per_channel(b.to(x.dtype), x.dim())).add_(_per_channel(c.to(x.dtype), x.dim()))


def convert_sync_batchnorm(module: nn.Module, comm: MPI.Comm, timeout: float = 600.0, balancer=None) -> nn.Module:
    """`module` with every torch BatchNorm layer (BatchNorm1d/2d/3d, torch's SyncBatchNorm)
    replaced by a SyncBatchNorm over the ranks of `comm`, keeping its parameters, buffers,
    training mode and requires_grad. Collective (the layers share one duplicate of comm).
    balancer: the one whose HeteroSampler feeds the model, for the layers to read each
    step's row from (a placeholder sample counts 0) in a loop of one's own;
    DistributedOptimizer and sample_weighted(balancer=) give it anyway. Returns the module
    (a new one if `module` itself is a BatchNorm layer)."""
    channel = MPIChannel(comm, timeout)
    if balancer is not None and not channel.same_ranks(balancer.comm):
        raise ValueError("convert_sync_batchnorm: the balancer's communicator is not `comm`: the layers read "
                         "this rank's local batch from the balancer's row of the step")
    module = _convert(module, channel)
    share = StepShare(balancer)
    for layer in layers(module):
        if layer.channel is channel:
            layer.share = share
    return module


def _convert(module: nn.Module, channel) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, channel=channel)
        new = new.to(device=_device_of(module))
        if module.affine:
            with torch.no_grad():
                new.weight = module.weight
                new.bias = module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        if hasattr(module, "qconfig"):
            new.qconfig = module.qconfig
        return new
    for name, child in module.named_children():
        module.add_module(name, _convert(child, channel))
    return module


def _device_of(module: nn.Module) -> torch.device:
    for t in [*module.parameters(), *module.buffers()]:
        return t.device
    return torch.device("cpu")


def layers(model: nn.Module) -> list[SyncBatchNorm]:
    return [m for m in model.modules() if isinstance(m, SyncBatchNorm)]


def unsynchronised(model: nn.Module) -> list[str]:
    """Names of the model's BatchNorm layers that normalise over the local batch alone."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm) and not isinstance(m, SyncBatchNorm)]


def make_local(model: nn.Module) -> nn.Module:
    """Turn `model`'s SyncBatchNorm layers into plain BatchNorm (no channel): for a copy
    that one rank runs alone, such as the calibration's probe."""
    for layer in layers(model):
        layer.channel = None
    return model
