"""SyncBatchNorm and buffers under MPI (pytest-mpi), for any number of ranks (run at 1, 2
and 4): with uneven local batches (a rank with one sample, a rank with none in a partial
step) a BatchNorm model's gradient is one process's on the union batch, its training is
allocation-invariant, and every rank holds the same running statistics; plain BatchNorm
is not, and warns; DistributedOptimizer keeps any buffer equal to rank 0's; a checkpoint
continues bit for bit; under DDP (gloo) the layer gives the weighted gradient, and
torch's own SyncBatchNorm refuses CPU tensors."""
import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader

import dbs_mpi
from dbs_mpi.mpi.collectives import allgather_array
from dbs_mpi.planning import allocation
from dbs_mpi.training import ddp, sync_batchnorm
from test_api_mpi import Pairs, flat_params, speeds_for

TIMEOUT = 60.0


class BNNet(nn.Module):
    """A user's small CNN with BatchNorm2d and BatchNorm1d (1x8x8 inputs, 5 classes)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn2d = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 8)
        self.bn1d = nn.BatchNorm1d(8, momentum=None)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.bn2d(self.conv(x))).flatten(1)
        return self.head(torch.relu(self.bn1d(self.fc(x))))


def vector_for(n):
    """Uneven local batches of a 2n+5 global batch: a rank with 1 sample, a rank with 0."""
    if n == 1:
        return [7]
    rest = [1, 0] + [2] * (n - 3) if n >= 3 else [1]
    return [2 * n + 5 - sum(rest)] + rest


def flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def buffers(model):
    return torch.cat([b.reshape(-1).double() for b in model.buffers() if b.is_floating_point()])


def spread(comm, tensor):
    """The largest difference between any rank's tensor and rank 0's (0 on one rank)."""
    mine = tensor.detach().double().numpy()
    first = comm.bcast(mine, root=0)
    return float(allgather_array(comm, [np.abs(mine - first).max()], TIMEOUT).max())


def check_one_step(comm, device="cpu"):
    """One step of a converted BNNet on uneven local batches (a rank with 1 sample, one
    with none) on `device`: the weighted sum of the ranks' gradients and the running
    statistics are one process's on the union batch, the statistics the same bits on
    every rank (tests/test_cuda.py runs it on GPUs)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    vector = vector_for(n)
    total = sum(vector)
    data = Pairs(total, seed=4)
    torch.manual_seed(0)
    reference = BNNet().to(device)
    model = dbs_mpi.convert_sync_batchnorm(copy.deepcopy(reference), comm, TIMEOUT)
    start, local = sum(vector[:rank]), vector[rank]
    x, y = (data.x[start:start + local], data.y[start:start + local]) if local else (data.x[:1], data.y[:1])
    weight = local / total
    for layer in sync_batchnorm.layers(model):
        layer.share.local, layer.share.weight = local, weight
    F.cross_entropy(model(x.to(device)), y.to(device)).backward()
    summed = flat_grads(model).cpu().double().numpy() * weight
    comm.Allreduce(MPI.IN_PLACE, summed, op=MPI.SUM)
    F.cross_entropy(reference(data.x.to(device)), data.y.to(device)).backward()
    torch.testing.assert_close(torch.from_numpy(summed).float(), flat_grads(reference).cpu(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(buffers(model).cpu(), buffers(reference).cpu(), rtol=1e-5, atol=1e-6)
    assert spread(comm, buffers(model).cpu()) == 0.0             # the same bits on every rank


@pytest.mark.mpi(min_size=1)
def test_a_step_gives_one_processs_gradient_and_statistics_on_the_union(comm):
    check_one_step(comm)


def train(comm, sync, epochs=2, drop_last=False, bf16=False, **optimizer_kw):
    """Two epochs of SGD on a BatchNorm model under a fixed uneven vector (a 2-sample rank
    at 4 ranks; the last step of 6 samples leaves a rank without any, and one with one
    sample, on which plain BatchNorm1d fails: drop_last drops it); bf16: the forward
    under torch.autocast("cpu", bfloat16)."""
    data, global_batch = Pairs(150, seed=2), 48
    torch.manual_seed(0)
    model = BNNet()
    if sync:
        model = dbs_mpi.convert_sync_batchnorm(model, comm, TIMEOUT)
    balancer = dbs_mpi.Balancer(comm, global_batch, "ssgd", timeout=TIMEOUT)
    balancer.batch_sizes = allocation.proportional(global_batch, speeds_for(comm.Get_size()))
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1, drop_last=drop_last)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                             balancer, **optimizer_kw)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_sampler=sampler):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step(loss=loss)
        table = balancer.end_epoch().table
    return model, table


@pytest.mark.mpi(min_size=1)
def test_bf16_autocast_trains_allocation_invariant_with_sync(comm):
    """Under bf16 autocast the layer's statistics and backward stay in float32 (the
    parameters' dtype), so it trains at any number of ranks, and the run is one
    process's within bf16's rounding: the local batches' shapes change how the
    reduced-precision convolutions round, nothing else."""
    model, _ = train(comm, sync=True, bf16=True)
    single, _ = train(MPI.COMM_SELF, sync=True, bf16=True)
    fp32, _ = train(MPI.COMM_SELF, sync=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert spread(comm, buffers(model)) == 0.0
    bf16_gap = (flat_params(model) - flat_params(single)).norm() / flat_params(single).norm()
    precision_gap = (flat_params(single) - flat_params(fp32)).norm() / flat_params(fp32).norm()
    assert bf16_gap <= 2e-2, bf16_gap
    assert bf16_gap <= max(precision_gap, 1e-6) * 2, (bf16_gap, precision_gap)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("exchange", ["auto", "gloo"])
def test_training_a_batchnorm_model_is_allocation_invariant_with_sync(comm, exchange):
    model, table = train(comm, sync=True, exchange=exchange)
    single, _ = train(MPI.COMM_SELF, sync=True)
    channel = sync_batchnorm.layers(model)[0].channel
    if comm.Get_size() > 1:            # the statistics travel with the gradients' torch.distributed group
        assert isinstance(channel, sync_batchnorm.TorchChannel if exchange == "gloo" else sync_batchnorm.MPIChannel)
    if comm.Get_size() == 4:
        assert 0 in table[-1] and table[:-1].min() <= 2, table
    torch.testing.assert_close(flat_params(model), flat_params(single), rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(buffers(model), buffers(single), rtol=1e-4, atol=2e-5)
    assert spread(comm, buffers(model)) == 0.0


@pytest.mark.mpi(min_size=2)
def test_plain_batchnorm_depends_on_the_vector_and_warns(comm):
    """The warning comes once a job (rank 0) and points at the user's line (the loop's
    optimizer.step, here in this file), not at dbs-mpi's or torch's."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = train(comm, sync=False, epochs=1, drop_last=True)
    mine = [w for w in caught if "BatchNorm layers" in str(w.message)]
    if comm.Get_rank() == 0:
        assert len(mine) == 1 and mine[0].filename == __file__, [(w.filename, str(w.message)) for w in mine]
        assert re.search(r"BatchNorm layers \(bn2d, bn1d\).*convert_sync_batchnorm.*--sync-bn", str(mine[0].message))
    else:
        assert not mine
    single, _ = train(MPI.COMM_SELF, sync=False, epochs=1, drop_last=True)
    assert not torch.allclose(flat_params(model), flat_params(single), rtol=1e-3, atol=1e-4)
    assert spread(comm, buffers(model)) == 0.0                  # broadcast_buffers: rank 0's statistics


@pytest.mark.mpi(min_size=1)
def test_even_batches_or_one_rank_do_not_warn(comm):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(MPI.COMM_SELF, sync=False, epochs=1)


class Drifting(nn.Module):
    """A model whose buffer each rank changes differently (an EMA of rank-dependent values)."""

    def __init__(self, rank):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.rank = rank

    def forward(self, x):
        if self.training:
            self.ema.mul_(0.9).add_(0.1 * (self.rank + 1))
        return self.fc(x)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_rank_0_after_every_step_unless_turned_off(comm, broadcast):
    n = comm.Get_size()
    torch.manual_seed(0)
    model = Drifting(comm.Get_rank())
    balancer = dbs_mpi.Balancer(comm, 4 * n, "ssgd", timeout=TIMEOUT)
    data = torch.utils.data.TensorDataset(torch.randn(12 * n, 4), torch.randint(2, (12 * n,)))
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=0)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, balancer,
                                             broadcast_buffers=broadcast)
    for x, y in DataLoader(data, batch_sampler=sampler):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if broadcast:
            assert spread(comm, model.ema) == 0.0
    balancer.end_epoch()
    expected = 1.0 * (1 - 0.9 ** 3)                            # three steps of rank 0's update
    differ = spread(comm, model.ema)
    if broadcast or comm.Get_rank() == 0:
        torch.testing.assert_close(model.ema, torch.full((3,), expected))
    else:
        assert differ > 0.05


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_with_sync_batchnorm_continues_bit_for_bit(comm, shared_tmp):
    data = Pairs(150, seed=2)

    def parts():
        torch.manual_seed(0)
        model = dbs_mpi.convert_sync_batchnorm(BNNet(), comm, TIMEOUT)
        balancer = dbs_mpi.Balancer(comm, 24, "ssgd", timeout=TIMEOUT)
        balancer.batch_sizes = allocation.proportional(24, speeds_for(comm.Get_size()))
        optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                                 balancer)
        return model, optimizer, balancer, dbs_mpi.HeteroSampler(data, balancer, seed=5)

    def steps(p, count=None):
        model, optimizer, balancer, sampler = p
        for taken, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler), 1):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            if taken == count:
                return
        balancer.end_epoch()

    whole = parts()
    whole[3].set_epoch(0)
    steps(whole)
    cut = parts()
    cut[3].set_epoch(0)
    steps(cut, 3)
    path = shared_tmp / "bn.ckpt"
    model, optimizer, balancer, sampler = cut
    dbs_mpi.save_checkpoint(comm, path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                         "sampler": sampler.state_dict()}, {"balancer": balancer.state_dict()})
    comm.Barrier()
    again = parts()
    state = dbs_mpi.load_checkpoint(path)
    again[0].load_state_dict(state["model"])
    again[1].load_state_dict(state["optimizer"])
    again[2].load_state_dict(state["per_rank"][comm.Get_rank()]["balancer"])
    again[3].load_state_dict(state["sampler"])
    again[3].set_epoch(0)
    steps(again)
    for a, b in zip([*whole[0].parameters(), *whole[0].buffers()], [*again[0].parameters(), *again[0].buffers()]):
        assert torch.equal(a, b)


@pytest.fixture
def group(comm):
    group = ddp.init_process_group(comm, "gloo", timeout=TIMEOUT)
    yield group
    ddp.destroy_process_group()


@pytest.mark.mpi(min_size=1)
def test_under_ddp_the_layer_gives_the_weighted_gradient_of_the_union(comm, group):
    from torch.nn.parallel import DistributedDataParallel as DDP
    n, rank = comm.Get_size(), comm.Get_rank()
    vector = [v or 1 for v in vector_for(n)]               # DDP: every rank feeds real samples
    total = sum(vector)
    data = Pairs(total, seed=4)
    torch.manual_seed(0)
    reference = BNNet()
    model = DDP(dbs_mpi.convert_sync_batchnorm(copy.deepcopy(reference), comm, TIMEOUT))
    dbs_mpi.sample_weighted(model)
    start = sum(vector[:rank])
    F.cross_entropy(model(data.x[start:start + vector[rank]]), data.y[start:start + vector[rank]]).backward()
    F.cross_entropy(reference(data.x), data.y).backward()
    torch.testing.assert_close(flat_grads(model.module), flat_grads(reference), rtol=1e-4, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_torchs_syncbatchnorm_refuses_cpu_tensors(comm, group):
    layer = nn.SyncBatchNorm(4)
    with pytest.raises(ValueError, match="expected input tensor to be on GPU"):
        layer(torch.randn(3, 4, 2, 2))
