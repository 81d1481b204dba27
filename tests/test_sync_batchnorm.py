"""SyncBatchNorm's arithmetic in one process: with one rank's statistics it is torch's
BatchNorm (1d, 2d, 3d; affine or not; momentum or the cumulative average; with and
without running statistics), forward, running statistics and every gradient; eval mode
sends nothing; convert_sync_batchnorm keeps the layers' tensors; the global statistics
combine ranks exactly. The ranks themselves: tests/test_sync_batchnorm_mpi.py."""
import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import dbs_mpi
from dbs_mpi.training import sync_batchnorm
from dbs_mpi.training.profiling import model_step

SHAPES = {"1d": (8, 4), "1d-seq": (8, 4, 5), "2d": (8, 4, 5, 5), "3d": (6, 4, 3, 3, 3)}
TORCH_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


class OwnRows:
    """A channel of 'two ranks' whose gather returns this rank's row alone: the
    synchronised path of the layer, with the statistics of one process."""
    size, rank = 2, 0

    def __init__(self):
        self.calls = 0

    def gather(self, row):
        self.calls += 1
        return row[None]

    def sum(self, values):
        self.calls += 1
        return values


class Refusing(OwnRows):
    def gather(self, row):
        raise AssertionError("eval mode must not communicate")

    sum = gather


def pair(shape, affine, momentum, track):
    torch.manual_seed(0)
    reference = TORCH_BN[len(shape)](shape[1], affine=affine, momentum=momentum, track_running_stats=track)
    if affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.uniform_(-0.5, 0.5)
    synced = sync_batchnorm._convert(copy.deepcopy(reference), OwnRows())
    return reference, synced


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("momentum, track", [(0.1, True), (None, True), (0.1, False)])
def test_one_ranks_statistics_give_torchs_batchnorm(shape, affine, momentum, track):
    reference, synced = pair(shape, affine, momentum, track)
    assert isinstance(synced, dbs_mpi.SyncBatchNorm)
    for step in range(3):                                  # three steps: the cumulative average moves
        x = (torch.randn(shape) * 3 + 1).requires_grad_()
        upstream = torch.randn(shape)
        xs = x.detach().clone().requires_grad_()
        ref_out, out = reference(x), synced(xs)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        ref_out.backward(upstream)
        out.backward(upstream)
        torch.testing.assert_close(xs.grad, x.grad, rtol=1e-4, atol=1e-5)
        if affine:
            torch.testing.assert_close(synced.weight.grad, reference.weight.grad, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(synced.bias.grad, reference.bias.grad, rtol=1e-4, atol=1e-5)
        if track:
            torch.testing.assert_close(synced.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(synced.running_var, reference.running_var, rtol=1e-5, atol=1e-6)
            assert int(synced.num_batches_tracked) == int(reference.num_batches_tracked) == step + 1
    assert synced.channel.calls == 6                       # one gather and one sum per step: synchronised
    reference.eval()
    synced.eval()
    synced.channel = Refusing()
    x = torch.randn(shape)
    torch.testing.assert_close(synced(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [SHAPES["1d"], SHAPES["2d"]], ids=["1d", "2d"])
def test_the_backward_hands_the_kernel_saved_statistics_as_tensors(shape):
    """CUDA's BatchNorm backward for 2-d and channels-last inputs asserts that the saved
    statistics are tensors (empty ones: it takes the running ones, here the global); the
    CPU kernel also takes None, so the call itself is checked here (the GPU: test_cuda)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Saved(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.native_batch_norm_backward.default:
                self.calls.append(args[5:7])
            return func(*args, **(kwargs or {}))

    _, synced = pair(shape, True, 0.1, True)
    x = torch.randn(shape).requires_grad_()
    with Saved() as mode:
        synced(x).sum().backward()
    assert len(mode.calls) == 1
    assert all(isinstance(t, torch.Tensor) and t.numel() == 0 for t in mode.calls[0])


def test_the_weight_of_a_rank_scales_its_sums_and_cancels_in_its_own_gradient():
    reference, synced = pair(SHAPES["2d"], True, 0.1, True)
    synced.share.weight = 0.25          # w_j: the sums travel scaled by it, the input gradient divides it out
    x = torch.randn(SHAPES["2d"]).requires_grad_()
    xs = x.detach().clone().requires_grad_()
    upstream = torch.randn(SHAPES["2d"])
    reference(x).backward(upstream)
    synced(xs).backward(upstream)
    torch.testing.assert_close(xs.grad, x.grad, rtol=1e-4, atol=1e-5)


def test_global_statistics_combine_ranks_like_one_batch():
    torch.manual_seed(3)
    parts = [torch.randn(n, 3, 4) * (i + 1) + i for i, n in enumerate([5, 1, 0, 9])]
    rows = []
    for p in parts:
        if len(p):
            var, mean = torch.var_mean(p.double(), [0, 2], correction=0)
        else:
            var = mean = torch.zeros(3, dtype=torch.float64)
        rows.append(torch.cat([torch.tensor([p.numel() / 3.0], dtype=torch.float64), mean, var]))
    total, mean, var = sync_batchnorm.global_statistics(torch.stack(rows), 1e-5)
    union = torch.cat(parts).double()
    ref_var, ref_mean = torch.var_mean(union, [0, 2], correction=0)
    assert total == union.numel() / 3
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(var, ref_var)
    lonely = torch.tensor([[1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)    # one value per channel
    for few in (torch.stack(rows[2:3]), torch.cat([lonely, rows[2][None]])):
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            sync_batchnorm.global_statistics(few, 1e-5)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.BatchNorm1d(6, affine=False))
        self.other = nn.SyncBatchNorm(6, momentum=None)

    def forward(self, x):
        return self.other(self.head(self.block(x)))


def test_convert_keeps_every_tensor_mode_and_flag():
    model = Nested()
    model.block[1].weight.requires_grad_(False)
    model.head.eval()
    tensors = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    converted = dbs_mpi.convert_sync_batchnorm(model, MPI.COMM_SELF)
    assert converted is model
    assert [type(m) for m in sync_batchnorm.layers(model)] == [dbs_mpi.SyncBatchNorm] * 3
    assert sync_batchnorm.unsynchronised(model) == []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t is tensors[name], name                            # the same tensors, not copies
    assert not model.block[1].weight.requires_grad and not model.head[2].training
    assert model.head[2].weight is None and model.other.momentum is None
    single = dbs_mpi.convert_sync_batchnorm(nn.BatchNorm2d(3), MPI.COMM_SELF)
    assert isinstance(single, dbs_mpi.SyncBatchNorm)
    assert model(torch.randn(4, 2, 6, 6)).shape == (4, 6)         # one rank: plain BatchNorm


def test_the_calibrations_probe_does_not_synchronise():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    model = sync_batchnorm._convert(model, Refusing())
    step = model_step(model, nn.functional.cross_entropy, torch.randn(8, 1, 6, 6), torch.randint(3, (8,)))
    step(4)                                               # a probe on a copy: no channel, no collective
    assert isinstance(model[1].channel, Refusing)        # the model itself keeps its channel


class SlowRows(OwnRows):
    """OwnRows whose collectives take 100 ms, as when a slower rank is waited for (far
    above a step's own compute: after 30 ms of sleep, a VM's cold memory made a tiny
    step's compute read 25 ms)."""
    seconds = 0.0

    def gather(self, row):
        import time
        start = time.perf_counter()
        time.sleep(0.1)
        self.seconds += time.perf_counter() - start
        return super().gather(row)

    def same_ranks(self, comm):
        return True


def test_waiting_in_sync_batchnorm_is_communication_not_compute():
    """The optimizer's clock takes the layers' collectives out of the step's compute (dbs
    and the emulated speeds see the rank's own work) and counts them as communication."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    model = sync_batchnorm._convert(model, SlowRows())
    balancer = dbs_mpi.Balancer(MPI.COMM_SELF, 8, "ssgd")
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randint(2, (24,)))
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=0)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, balancer)
    for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    stats = balancer.end_epoch()
    assert stats.steps == 3 and (stats.step_pre[:, 0] < 0.08).all(), stats.step_pre
    assert (stats.step_comm[:, 0] + stats.step_wait[:, 0] >= 0.1).all()


class Step:
    """What a layer reads of a balancer: rank 0's row of the step under way."""
    rank, step_pending = 0, True

    def __init__(self, row):
        self.row = row

    def step_batch_sizes(self):
        import numpy as np
        return np.asarray(self.row)


class WithOther(OwnRows):
    """'Rank 0' of two: rank 1's row holds 4 samples of mean 0 and variance 1; what this rank sends is kept."""

    def gather(self, row):
        self.sent = row
        other = torch.cat([torch.tensor([4.0], dtype=row.dtype), torch.zeros((len(row) - 1) // 2, dtype=row.dtype),
                           torch.ones((len(row) - 1) // 2, dtype=row.dtype)])
        return torch.stack([row, other])

    def sum(self, values):
        self.summed = values
        return values


def test_a_placeholder_sample_read_from_the_balancer_counts_0_and_weighs_0():
    """The layer reads the step's row when it runs (no hook: a compiled model runs none):
    rank 0's local batch is 0, so its one input sample joins the statistics with n = 0 and
    its backward sends zero sums; a rank with samples sends its count and its weight's sums."""
    for row, count, weight in (([0, 4], 0.0, 0.0), ([4, 4], 4.0 * 25, 0.5)):
        channel = WithOther()
        layer = sync_batchnorm._convert(nn.BatchNorm2d(4), channel)
        layer.share = sync_batchnorm.StepShare(Step(row))
        x = torch.randn(max(row[0], 1), 4, 5, 5, requires_grad=True)
        layer(x).sum().backward()                                    # dy = 1: sum dy = the count per channel
        assert float(channel.sent[0]) == count
        torch.testing.assert_close(channel.summed[:4], torch.full((4,), count * weight, dtype=torch.float64))
        assert x.grad.abs().max() == 0 if not count else x.grad.abs().max() > 0


def test_convert_gives_the_layers_the_balancer_of_a_loop_of_ones_own():
    balancer = dbs_mpi.Balancer(MPI.COMM_SELF, 8, "ssgd")
    model = dbs_mpi.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3)), MPI.COMM_SELF,
                                           balancer=balancer)
    assert {id(layer.share.balancer) for layer in sync_batchnorm.layers(model)} == {id(balancer)}
    assert copy.deepcopy(model)[0].share is model[0].share          # an EMA copy runs the same steps
    import pickle
    assert pickle.loads(pickle.dumps(model))[0].share.balancer is None     # the communicator stays behind
