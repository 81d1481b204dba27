"""Dropout keyed by sample (training/sample_dropout.py), pytest-mpi at any number of ranks
(run at 1, 2 and 4): a model with dropout trains on uneven ranks as one process does on
the union batch, up to float rounding, whole or in micro-batches; torch's Dropout does
not (its masks follow the rank and the position in the local batch)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader

import dbs_mpi
from dbs_mpi.training.sample_dropout import SampleDropout, uniforms
from test_api_mpi import Pairs, flat_params, uneven_balancer


class DropNet(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 16),
                                  nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.body(x))


def train(comm, keyed=True, micro=None, epochs=2):
    data, global_batch = Pairs(150, seed=4), 48
    balancer = uneven_balancer(comm, global_batch)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=2)
    torch.manual_seed(0)
    model = DropNet()
    if keyed:
        dbs_mpi.convert_dropout(model, balancer, seed=5)
    torch.manual_seed(1000 + comm.Get_rank())             # torch's dropout: each rank its own stream
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), model, balancer)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_sampler=sampler):
            optimizer.zero_grad()
            if micro:
                for xm, ym in optimizer.micro_batches((x, y), micro):
                    optimizer.backward(F.cross_entropy(model(xm), ym))
            else:
                F.cross_entropy(model(x), y).backward()
            optimizer.step()
        balancer.end_epoch()
    return flat_params(model)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("micro", [None, 5])
def test_keyed_dropout_on_uneven_ranks_equals_one_process(comm, micro):
    alone = train(MPI.COMM_SELF)
    assert rel(train(comm, micro=micro), alone) < 1e-5


@pytest.mark.mpi(min_size=2)
def test_torch_dropout_on_uneven_ranks_is_another_model(comm):
    """The test above can fail: with torch's Dropout the same run is another model."""
    assert rel(train(comm, keyed=False), train(MPI.COMM_SELF, keyed=False)) > 1e-3


def test_the_masks_are_uniform_keyed_and_the_same_on_every_call():
    positions = torch.arange(0, 4096)
    u = uniforms(12345, positions, 64)
    assert u.shape == (4096, 64) and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float((u < 0.3).float().mean()) - 0.3) < 0.01
    torch.testing.assert_close(uniforms(12345, positions[100:200], 64), u[100:200], rtol=0, atol=0)
    assert not torch.equal(uniforms(12346, positions, 64), u)
    assert float((u[:-1] == u[1:]).float().mean()) < 1e-3          # samples differ from their neighbours


def test_outside_an_epoch_it_is_torchs_dropout_and_a_copy_shares_the_balancer():
    import copy
    balancer = dbs_mpi.Balancer(MPI.COMM_SELF, 8, "ssgd")
    layer = SampleDropout(0.5, balancer)
    torch.manual_seed(0)
    out = layer(torch.ones(4, 10))
    assert set(out.unique().tolist()) <= {0.0, 2.0}
    twin = copy.deepcopy(nn.Sequential(layer))[0]
    assert twin.balancer is balancer and twin.p == 0.5
    assert np.isclose(float(layer.eval()(torch.ones(3)).sum()), 3.0)
