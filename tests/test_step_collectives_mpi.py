"""A step's communication is held in one place (pytest-mpi, any number of ranks; run at 1,
2 and 4): the collectives of each step of a DistributedOptimizer loop inside a
StopRequest, counted on a communicator that forwards to MPI's (collective_count.py).

* Every rank taking part: one collective a step (the gradient, the loss, the telemetry
  and the stop flag in one allreduce), behind one barrier where waiting ranks sleep;
  none on one rank.
* Ranks sitting out: those taking part sum the gradient over their group (behind its
  barrier where waiting ranks sleep) and every rank sums the step's tail over the world;
  the group's communicator is created at its first step, and the ranks that sat out
  catch up after the epoch's last step (one broadcast of the state: size, then bytes).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import dbs_mpi
from collective_count import Counting, Tally
from test_api_mpi import Pairs, UserNet

GLOBAL_BATCH = 48


def counted_steps(comm, vector):
    """Every step's collectives on this rank: a list of (communicator size, call) lists."""
    tally = Tally()
    counting = Counting(comm, tally)
    data = Pairs(8 * GLOBAL_BATCH)
    balancer = dbs_mpi.Balancer(counting, GLOBAL_BATCH, "ssgd", timeout=60)
    balancer.batch_sizes = np.asarray(vector, dtype=np.int64)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    torch.manual_seed(0)
    model = UserNet()
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, balancer)
    steps = []
    with dbs_mpi.StopRequest(counting) as stop:
        sampler.set_epoch(0)
        for x, y in DataLoader(data, batch_sampler=sampler):
            mark = len(tally.calls)
            stop.start()
            loss = None
            if not optimizer.sits_out:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            optimizer.step(loss=loss)
            assert stop.agreed() == 0
            steps.append(tally.since(mark))
        balancer.end_epoch()
        mark = len(tally.calls)
        assert stop.agreed() == 0                 # no step carried it since: a collective of its own
        steps.append(tally.since(mark))
    return steps, optimizer.sleep_while_waiting


@pytest.mark.mpi(min_size=1)
def test_every_rank_taking_part_is_one_collective_a_step(comm):
    n = comm.Get_size()
    steps, sleeping = counted_steps(comm, [GLOBAL_BATCH // n + (r < GLOBAL_BATCH % n) for r in range(n)])
    steps, alone = steps[:-1], steps[-1]
    assert len(steps) == 8 and alone == ([] if n == 1 else [(n, "Iallreduce")])
    expected = [] if n == 1 else [(n, "Ibarrier")] * sleeping + [(n, "Allreduce")]
    for step in steps[1:]:                          # the first may start the stop agreement as well
        assert step == expected, steps
    assert len(steps[0]) <= len(expected) + 1, steps[0]


@pytest.mark.mpi(min_size=2)
def test_ranks_sitting_out_sum_the_tail_alone(comm):
    """Ranks 1 .. n-2 sit out (at 2 ranks, rank 1: rank 0 then sums alone, over no one)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    members = [0, n - 1] if n > 2 else [0]
    vector = [0] * n
    for r in members:
        vector[r] = GLOBAL_BATCH // len(members)
    steps, sleeping = counted_steps(comm, vector)
    steps = steps[:-1]
    g = len(members)
    group = [(g, "Ibarrier")] * sleeping + [(g, "Allreduce")] if g > 1 else []
    tail = [(n, "Iallreduce")]         # non-blocking whatever the wait policy: a rank out may probe meanwhile
    expected = group + tail if rank in members else tail
    for step in steps[1:-1]:
        assert step == expected, steps
    split, stop = [(n, "Split")], [(n, "Iallreduce")]      # the group's communicator; the first stop agreement
    assert steps[0] in (split + expected, stop + split + expected), steps[0]
    assert steps[-1] == expected + [(n, "Ibcast"), (n, "Ibcast")], steps[-1]     # the catch-up
