"""Loss scaling under MPI (pytest-mpi), for any number of ranks (run at 1, 2 and 4):
torch.amp.GradScaler's recipe (`scaler.scale(loss).backward()`, `scaler.step(optimizer)`,
`scaler.update()`) with DistributedOptimizer keeps the sample weighting exact, and its
inf/NaN decision is the same on every rank: a step whose gradient overflowed on one rank
is skipped on all, and the scale stays equal everywhere. The scaler works alike on the
CPU and on a GPU (tests/test_cuda.py runs fp16 there); here it scales float32 losses."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import DataLoader

import dbs_mpi
from dbs_mpi.mpi.collectives import allgather_array
from dbs_mpi.planning import allocation
from test_api_mpi import Pairs, UserNet, flat_params, speeds_for

TIMEOUT = 60.0
pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")


def train(comm, scaled=True, poison=None, unscale_first=False, epochs=2, device="cpu", dtype=None):
    """Two epochs of SGD with momentum on uneven local batches. poison: (rank, run step) whose
    loss is made infinite; unscale_first: the loop calls scaler.unscale_(optimizer) before
    the exchange (to clip its own gradient, say); dtype: the forward under autocast in it
    (test_cuda: float16 on GPUs). Returns the model, the scales after every step, and the
    parameters before and after every step."""
    data, global_batch = Pairs(96, seed=3), 24
    device = torch.device(device)
    torch.manual_seed(0)
    model = UserNet().to(device)
    balancer = dbs_mpi.Balancer(comm, global_batch, "ssgd", timeout=TIMEOUT)
    balancer.batch_sizes = allocation.proportional(global_batch, speeds_for(comm.Get_size()))
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                             balancer)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12, enabled=scaled)
    scales, params, step = [], [], 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_sampler=sampler):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            if poison == (comm.Get_rank(), step):
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(optimizer)
            before = flat_params(model).clone()
            scaler.step(optimizer, loss=loss)
            scaler.update()
            scales.append(scaler.get_scale())
            params.append((before.cpu(), flat_params(model).cpu()))
            step += 1
        balancer.end_epoch()
    return model, scales, params


def same_everywhere(comm, values) -> bool:
    mine = np.asarray(values, dtype=np.float64)
    return bool(np.all(allgather_array(comm, mine, TIMEOUT) == mine))


@pytest.mark.mpi(min_size=1)
def test_scaled_training_is_one_processs_unscaled_training(comm):
    model, scales, _ = train(comm)
    single, _, _ = train(MPI.COMM_SELF, scaled=False)
    torch.testing.assert_close(flat_params(model), flat_params(single), rtol=1e-5, atol=1e-6)
    assert scales[0] == 2.0 ** 12 and same_everywhere(comm, scales)


def check_overflow_skipped_everywhere(comm, unscale_first, **kw):
    """Rank n-1's loss is infinite at step 3: every rank skips that step, no other."""
    poisoned = comm.Get_size() - 1
    model, scales, params = train(comm, poison=(poisoned, 3), unscale_first=unscale_first, **kw)
    before, after = params[3]
    assert torch.equal(before, after), "the step with an overflow on one rank was applied"
    assert all(not torch.equal(b, a) for b, a in params[4:6])
    assert scales[3] == scales[2] / 2 and same_everywhere(comm, scales)
    assert torch.isfinite(flat_params(model)).all()
    assert same_everywhere(comm, flat_params(model).cpu().numpy())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("unscale_first", [False, True], ids=["unscaled-after", "unscaled-before"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(comm, unscale_first):
    check_overflow_skipped_everywhere(comm, unscale_first)
