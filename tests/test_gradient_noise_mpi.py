"""The gradient noise scale measured in training (Balancer(noise_scale=True); training/
gradient_noise.py) under MPI, at any number of ranks (run at 1, 2 and 4):

* the norms that ride the step are each rank's own gradient's (before the weighting,
  whether backward or the exchange weights it, in one bucket or many) and the sum's;
* on a linear model at rest (learning rate 0), whose noise scale follows exactly from
  its per-sample gradients, the fitted |G|^2 and tr(Sigma), averaged over the steps,
  are within 10% of the truth (uneven ranks); one rank alone gives no estimate.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbs_mpi
from dbs_mpi.mpi.collectives import allgather_array
from dbs_mpi.planning import allocation
from dbs_mpi.planning.sharding import epoch_permutation

SPEEDS = [1.0, 0.4, 0.7, 0.25]
CAPS = {"one bucket": (25.0, 1.0), "many buckets": (0.0005, 0.0002)}


def speeds_for(n):
    return [SPEEDS[i % len(SPEEDS)] for i in range(n)]


class Regression(torch.utils.data.Dataset):
    """y = x . w_true + noise, d features."""

    def __init__(self, n=2048, d=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d, generator=g)
        self.y = self.x @ torch.randn(d, generator=g) + 0.5 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.hidden = nn.Linear(d, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x))).squeeze(-1)


def measuring(comm, global_batch):
    balancer = dbs_mpi.Balancer(comm, global_batch, "ssgd", noise_scale=True)
    balancer.batch_sizes = allocation.proportional(global_batch, speeds_for(comm.Get_size()))
    return balancer


def grad_of(model, x, y) -> torch.Tensor:
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("caps", list(CAPS))
@pytest.mark.parametrize("seeded", [False, True], ids=["loss.backward", "optimizer.backward"])
@pytest.mark.parametrize("exchange", ["host", "gloo"])
def test_the_norms_that_ride_the_step_are_each_rank_s_gradient_and_the_sum_s(comm, caps, seeded, exchange):
    """(gloo, and the one rank's exchange, once handed the balancer a view of the tail, which
    the step's zeroing cleared before the balancer read it: every dbs step time was 0.)"""
    data, global_batch = Regression(256), 48
    balancer = measuring(comm, global_batch)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, balancer,
                                             bucket_mb=CAPS[caps][0], first_bucket_mb=CAPS[caps][1], exchange=exchange)
    perm = torch.from_numpy(epoch_permutation(len(data), 0, 1))
    sampler.set_epoch(0)
    for s, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_sampler=sampler)):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        optimizer.backward(loss) if seeded else loss.backward()
        optimizer.step()
        own = grad_of(reference, x, y) if len(x) else torch.zeros(1)
        mine = float(own @ own) if len(x) else 0.0
        kept_row, kept_local = balancer.noise.kept
        assert kept_row.tolist() == balancer.epoch_table[s].tolist()
        expected = allgather_array(comm, [mine], 60)[:, 0]
        np.testing.assert_allclose(kept_local, expected, rtol=1e-4, atol=1e-9)
        if comm.Get_rank() == 0:
            union = perm[s * global_batch:(s + 1) * global_batch]
            summed = grad_of(reference, data.x[union], data.y[union])
            assert balancer.noise.summed == pytest.approx(float(summed @ summed), rel=1e-4)
    balancer.end_epoch()
    optimizer.close()


def true_noise(model, data) -> tuple[float, float]:
    """|G|^2 and tr(Sigma) of one sample's gradient over the whole dataset, from every
    per-sample gradient, with the finite-population correction of sampling without
    replacement folded in (what E|g_b|^2 = |G|^2 + tr/b's line fits)."""
    grads = torch.stack([grad_of(model, data.x[i:i + 1], data.y[i:i + 1]) for i in range(len(data))]).double()
    mean = grads.mean(0)
    trace = float(((grads - mean) ** 2).sum(1).mean())
    n = len(data)
    return float(mean @ mean) - trace / (n - 1), trace * n / (n - 1)


@pytest.mark.mpi(min_size=1)
def test_on_a_model_at_rest_the_fit_finds_the_true_noise_scale(comm):
    data, global_batch, epochs = Regression(2048), 64, 4
    balancer = measuring(comm, global_batch)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=2)
    torch.manual_seed(0)
    model = Net()
    grad_sq, trace = true_noise(model, data)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, balancer)
    records = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
        records.append(balancer.end_epoch().noise)
    noise = np.concatenate(records)
    optimizer.close()
    if comm.Get_size() == 1:
        assert np.isnan(noise).all()           # one abscissa: no line
        return
    fitted = noise[~np.isnan(noise[:, 1])]
    print(f"noise scale: true {trace / grad_sq:.2f}, fitted |G|^2 {np.mean(fitted[:, 1]) / grad_sq - 1:+.3f}, "
          f"tr {np.mean(fitted[:, 2]) / trace - 1:+.3f}, smoothed {np.mean(fitted[-60:, 0]) / (trace / grad_sq) - 1:+.3f}")
    assert len(fitted) == epochs * (len(data) // global_batch - 1)     # every step but each epoch's last
    assert np.mean(fitted[:, 1]) == pytest.approx(grad_sq, rel=0.10)
    assert np.mean(fitted[:, 2]) == pytest.approx(trace, rel=0.10)
    # the smoothed value (an average of about 20 steps: noisy), over the last two epochs
    assert np.mean(fitted[-60:, 0]) == pytest.approx(trace / grad_sq, rel=0.20)


def train_epochs(comm, balancer, epochs, first=0):
    """`epochs` epochs of the network at rest (a fresh optimizer: nothing else carries over)."""
    data = Regression(512)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=4)
    torch.manual_seed(0)
    model = Net()
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, balancer)
    for epoch in range(first, first + epochs):
        sampler.set_epoch(epoch)
        for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
        balancer.end_epoch()
    optimizer.close()


@pytest.mark.mpi(min_size=1)
def test_a_run_stopped_between_epochs_continues_the_estimate_exactly(comm):
    """Three epochs straight, against one, the balancer's state through a state_dict, two
    more: the same estimator, and the step before the stop fitted once its sum arrives."""
    straight = measuring(comm, 32)
    train_epochs(comm, straight, 3)
    first = measuring(comm, 32)
    train_epochs(comm, first, 1)
    resumed = measuring(comm, 32)
    resumed.load_state_dict(first.state_dict())
    train_epochs(comm, resumed, 2, first=1)
    assert resumed.noise.estimator.state_dict() == straight.noise.estimator.state_dict()
    assert straight.noise.estimator.steps == (0 if comm.Get_size() == 1 else 3 * 16 - 1)
