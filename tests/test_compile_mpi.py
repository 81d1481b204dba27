"""torch.compile with DistributedOptimizer (pytest-mpi, any number of ranks, run at 1, 2
and 4): the optimizer's forward hook stays out of the compiled graph, so a compiled model
trains as the eager one does (the sample weighting is the exchange's, which runs
eagerly); a compiled model with SyncBatchNorm, whose layers read each step's row from the
balancer and run their collectives in a graph break, trains as one process on the union
batch, placeholder samples included, and micro-batches stay refused with it.
The tests compile with Dynamo's "eager" backend (the tracing that broke, without a C++
build per rank); the default backend is measured in the README."""
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import DataLoader

import dbs_mpi
from dbs_mpi.planning import allocation
from test_api_mpi import Pairs, UserNet, flat_params, speeds_for
from test_sync_batchnorm_mpi import BNNet, buffers, spread

TIMEOUT = 60.0


def train(comm, compiled: bool, make=UserNet, epochs=2, data=None, global_batch=24, vector=None):
    """SGD on the model make() builds (seeded), under the vector (default: proportional to
    uneven speeds); returns the model, the last epoch's stats and its steps' seconds."""
    data = data or Pairs(96, seed=11)
    torch.manual_seed(0)
    model = make()
    balancer = dbs_mpi.Balancer(comm, global_batch, "ssgd", timeout=TIMEOUT)
    balancer.batch_sizes = allocation.proportional(global_batch, speeds_for(comm.Get_size())) if vector is None \
        else np.asarray(vector)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                             balancer)
    forward = torch.compile(model, backend="eager") if compiled else model
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        seconds = []                       # the epoch's forward and backward, as the loop sees them
        for x, y in DataLoader(data, batch_sampler=sampler):
            optimizer.zero_grad()
            began = time.perf_counter()
            loss = F.cross_entropy(forward(x), y)
            loss.backward()
            seconds.append(time.perf_counter() - began)
            optimizer.step(loss=loss)
        stats = balancer.end_epoch()
    return model, stats, seconds


@pytest.mark.mpi(min_size=1)
def test_a_compiled_model_trains_as_the_eager_one(comm):
    torch._dynamo.reset()
    model, stats, seconds = train(comm, compiled=True)
    single, _, _ = train(MPI.COMM_SELF, compiled=False)
    torch.testing.assert_close(flat_params(model), flat_params(single), rtol=1e-4, atol=1e-6)
    assert (stats.step_loss > 0).all()                                   # the global loss still reaches the records


@pytest.mark.mpi(min_size=1)
def test_a_compiled_models_compute_time_is_measured(comm):
    """The hook does not run in a compiled model, so the compute clock starts at the last
    step's end: what dbs plans from and --speeds stretches is at least the loop's forward
    and backward (it read about 0 when the clock started at the exchange)."""
    torch._dynamo.reset()
    _, stats, seconds = train(comm, compiled=True, epochs=1)
    measured = stats.step_pre[:, comm.Get_rank()]
    assert (measured >= 0.9 * np.asarray(seconds)).all(), (measured, seconds)


def lopsided(n: int, global_batch: int) -> list:
    """[B - 2(n - 1), 2, ..., 2]: a partial step of 6 samples goes all to rank 0, so every
    other rank feeds a placeholder sample (b_i = 0) in it."""
    return [global_batch - 2 * (n - 1)] + [2] * (n - 1)


def train_synced(comm, compiled: bool, epochs=2):
    """BNNet with SyncBatchNorm over comm: 150 samples in global batches of 48, so each
    epoch's last step has 6 samples, on rank 0 alone."""
    return train(comm, compiled, lambda: dbs_mpi.convert_sync_batchnorm(BNNet(), comm, TIMEOUT), epochs,
                 Pairs(150, seed=2), 48, lopsided(comm.Get_size(), 48))


@pytest.mark.mpi(min_size=1)
def test_a_compiled_model_with_sync_batchnorm_trains_as_one_process_on_the_union(comm):
    """SyncBatchNorm reads each step's row from the balancer when it runs (no hook) and
    its collectives are a graph break: the compiled model's parameters and running
    statistics are one eager process's on the union batch, through steps where ranks
    feed a placeholder sample, and the same bits on every rank."""
    torch._dynamo.reset()
    model, stats, _ = train_synced(comm, compiled=True)
    single, _, _ = train_synced(MPI.COMM_SELF, compiled=False)
    if comm.Get_size() > 1:
        assert stats.table[-1].tolist() == [6] + [0] * (comm.Get_size() - 1), stats.table     # placeholders
    torch.testing.assert_close(flat_params(model), flat_params(single), rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(buffers(model), buffers(single), rtol=1e-4, atol=2e-5)
    assert spread(comm, buffers(model)) == 0.0
    assert (stats.step_loss > 0).all()


@pytest.mark.mpi(min_size=1)
def test_micro_batches_stay_refused_with_a_compiled_sync_batchnorm_model(comm):
    """SyncBatchNorm normalises over the step's global batch, which micro-batches would cut
    into parts: refused on every rank, compiled or not."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = dbs_mpi.convert_sync_batchnorm(BNNet(), comm, TIMEOUT)
    data = Pairs(48, seed=2)
    balancer = dbs_mpi.Balancer(comm, 24, "ssgd", timeout=TIMEOUT)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, balancer)
    forward = torch.compile(model, backend="eager")
    x, y = next(iter(DataLoader(data, batch_sampler=dbs_mpi.HeteroSampler(data, balancer, seed=1))))
    with pytest.raises(ValueError, match="SyncBatchNorm layers normalise over the step's global batch"):
        for (xm, ym) in optimizer.micro_batches((x, y), 2):
            optimizer.backward(F.cross_entropy(forward(xm), ym))
