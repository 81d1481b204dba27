"""Gradient accumulation (pytest-mpi, any number of ranks, run at 1, 2 and 4): each rank's
local batch in micro-batches through DistributedOptimizer.micro_batches and backward,
one exchange a step, trains the model one process trains on the whole global batch
without accumulation, with uneven micro-batches, with buckets that overlap backward,
with loss scaling, and with a rank given more samples than its micro-batch bound; a
plain backward inside the loop and a model with SyncBatchNorm are refused."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader

import dbs_mpi
from test_api_mpi import Pairs, UserNet, flat_params, uneven_balancer

TIMEOUT = 60.0
TINY = 1e-4           # MiB: one parameter per bucket, so buckets start during backward (overlap)
pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")


class GroupNet(UserNet):
    """UserNet with a GroupNorm after the convolution (normalises each sample alone)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.head(F.relu(self.norm(self.conv(x))).flatten(1)) * self.scale


def train(comm, micro=None, model_class=UserNet, buckets_mb=25.0, scaled=False, plain_backward=False, epochs=2):
    """Two epochs on uneven local batches (global batch 24); micro: micro-batch size (None:
    no accumulation). Returns the model and the last epoch's stats."""
    data, global_batch = Pairs(96, seed=5), 24
    torch.manual_seed(0)
    model = model_class()
    balancer = uneven_balancer(comm, global_batch, timeout=TIMEOUT)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                             balancer, bucket_mb=buckets_mb, first_bucket_mb=buckets_mb)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=scaled)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_sampler=sampler):
            optimizer.zero_grad()
            if micro is None:
                loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
            else:
                loss = None
                for xm, ym in optimizer.micro_batches((x, y), micro):
                    part = F.cross_entropy(model(xm), ym)
                    part.backward() if plain_backward else optimizer.backward(part, scaler=scaler)
            scaler.step(optimizer, loss=loss)
            scaler.update()
        stats = balancer.end_epoch()
    return model, stats


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("micro, model_class, buckets_mb", [
    (5, UserNet, 25.0),              # uneven micro-batches: 24 = 5 + 5 + 5 + 5 + 4 on one rank
    (2, GroupNet, TINY),             # buckets that overlap backward, held until the last micro-batch
    (100, UserNet, 25.0),            # a bound larger than every local batch: one micro-batch
])
def test_micro_batches_train_one_processs_model_on_the_whole_global_batch(comm, micro, model_class, buckets_mb):
    model, stats = train(comm, micro, model_class, buckets_mb)
    single, single_stats = train(MPI.COMM_SELF, None, model_class)
    torch.testing.assert_close(flat_params(model), flat_params(single), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.as_tensor(stats.step_loss), torch.as_tensor(single_stats.step_loss),
                               rtol=1e-5, atol=1e-6)           # the records get the local batches' mean loss


@pytest.mark.mpi(min_size=1)
def test_micro_batches_with_loss_scaling(comm):
    model, _ = train(comm, 3, scaled=True)
    single, _ = train(MPI.COMM_SELF, None)
    torch.testing.assert_close(flat_params(model), flat_params(single), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_a_plain_backward_inside_micro_batches_is_refused(comm):
    with pytest.raises(RuntimeError, match=r"call optimizer.backward\(loss\) once for each micro-batch"):
        train(comm, 4, plain_backward=True, epochs=1)


@pytest.mark.mpi(min_size=1)
def test_micro_batches_of_a_model_with_sync_batchnorm_are_refused(comm):
    from test_sync_batchnorm_mpi import BNNet
    torch.manual_seed(0)
    model = dbs_mpi.convert_sync_batchnorm(BNNet(), comm, TIMEOUT)
    balancer = dbs_mpi.Balancer(comm, 8 * comm.Get_size(), "ssgd", timeout=TIMEOUT)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, balancer)
    x = torch.randn(8, 1, 8, 8)
    with pytest.raises(ValueError, match="SyncBatchNorm layers normalise over the step's global batch"):
        next(iter(optimizer.micro_batches((x,), 100)))
