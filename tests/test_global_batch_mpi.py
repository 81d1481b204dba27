"""The adaptive global batch under MPI (Balancer(global_batch="auto"), global_batch.py), at
any number of ranks (run at 1, 2 and 4):

* B changes between epochs, to the same value on every rank, and the next epoch's
  steps all sum to it; one rank alone has no noise estimate and keeps its start;
* allocation invariance at a changing B: uneven ranks train as one process does on the
  same sequence of global batches (the lr scaled alike);
* a run stopped after a B switch resumes bit for bit.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dbs_mpi
from dbs_mpi.mpi.collectives import allgather_array
from dbs_mpi.planning import allocation
from mpi4py import MPI
from test_gradient_noise_mpi import Net, Regression, speeds_for

TIMEOUT = 60.0


def adaptive(comm, start=8, upper=64, rule="adascale", policy="dbs", lower=0):
    return dbs_mpi.Balancer(comm, "auto", policy, global_batch_start=start, max_global_batch=upper, lr_scaling=rule,
                            min_global_batch=lower, timeout=TIMEOUT)


class Run:
    """A model, its optimizer and a sampler over a balancer: epochs of training."""

    def __init__(self, comm, balancer, calibrate=True, lr=0.02, calibration=None):
        self.data, self.balancer = Regression(512, seed=3), balancer
        torch.manual_seed(0)
        self.model = Net()
        if calibration is not None:          # recorded step times: a plan no timing can move
            balancer.use_calibration(calibration)
        elif calibrate:
            balancer.calibrate_model(self.model, F.mse_loss, self.data, steps=2, warmup=1)
        self.sampler = dbs_mpi.HeteroSampler(self.data, balancer, seed=4)
        self.optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=lr),
                                                      self.model, balancer)

    def epochs(self, first, last, between=None):
        """Epochs [first, last); between(epoch): after each epoch's end (a forced B)."""
        tables = []
        for epoch in range(first, last):
            self.sampler.set_epoch(epoch)
            for x, y in torch.utils.data.DataLoader(self.data, batch_sampler=self.sampler):
                self.optimizer.zero_grad()
                loss = F.mse_loss(self.model(x), y)
                loss.backward()
                self.optimizer.step(loss=loss)
            tables.append(self.balancer.end_epoch().table)
            if between is not None:
                between(epoch)
        return tables

    def params(self):
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


@pytest.mark.mpi(min_size=1)
def test_the_global_batch_changes_between_epochs_alike_on_every_rank(comm):
    """The tiny network's step costs about the same at any B, and its noise scale is far
    above the start: where it is measured (2 ranks or more), B grows after the first epoch,
    at most doubling at each decision. (static, planned from step times that barely grow
    with the local batch, like the resume test below: with dbs the throughput is timed,
    and on CI's busy cores the timed tiny steps once put the first switch an epoch late.)"""
    flat = {"local_batch": np.array([2, 20]), "step_time": np.tile([0.010, 0.0105], (comm.Get_size(), 1))}
    run = Run(comm, adaptive(comm, policy="static"), calibration=flat)
    tables = run.epochs(0, 3)
    sizes = [int(t[0].sum()) for t in tables]
    everyone = allgather_array(comm, [run.balancer.global_batch, *sizes], TIMEOUT)
    assert (everyone == everyone[0]).all(), everyone
    if comm.Get_size() == 1:
        assert sizes == [8, 8, 8] and run.balancer.lr_factor == 1.0
        return
    assert sizes[0] == 8 and sizes[1] > 8, sizes
    after = sizes + [run.balancer.global_batch]
    assert all(b <= 2 * a for a, b in zip(after, after[1:])), after              # at most doubling each time
    for table in tables:                                     # every step a whole B but the epoch's last
        assert (table[:-1].sum(axis=1) == table[0].sum()).all() and table.sum() == 512
    assert run.balancer.lr_factor > 1.0


@pytest.mark.mpi(min_size=1)
def test_uneven_ranks_at_a_changing_batch_train_as_one_process(comm):
    """The same sequence of global batches set by hand (set_global_batch), the lr scaled
    linearly with B: uneven ranks against one process, the same parameters."""
    sequence = {0: 24, 1: 64, 2: 16, 3: 16}
    n = comm.Get_size()

    def forced(balancer, uneven):
        def between(epoch):
            if epoch in sequence:
                balancer.set_global_batch(sequence[epoch])
                if uneven:
                    balancer.batch_sizes = allocation.proportional(sequence[epoch], speeds_for(n))
        return between

    ranks = Run(comm, adaptive(comm, rule="linear"), calibrate=False)
    ranks.balancer.batch_sizes = allocation.proportional(8, speeds_for(n))
    ranks.epochs(0, 4, forced(ranks.balancer, True))
    alone = Run(MPI.COMM_SELF, adaptive(MPI.COMM_SELF, rule="linear"), calibrate=False)
    alone.epochs(0, 4, forced(alone.balancer, False))
    assert ranks.balancer.global_batch == alone.balancer.global_batch == 16
    torch.testing.assert_close(ranks.params(), alone.params(), rtol=1e-4, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_a_run_stopped_after_a_switch_resumes_bit_for_bit(comm):
    """Two epochs of a run, against its state after the first (model, optimizer and
    balancer through their state_dicts: B has just switched) loaded into a new run for the
    second: the same global batch and vector, the same parameters. (static: no timing
    moves the vector within the epoch; it plans from step times that barely grow with the
    local batch, which make a larger B pay: a timed calibration on CI's busy cores once
    kept B at its start.)"""
    saved = {}
    flat = {"local_batch": np.array([2, 20]), "step_time": np.tile([0.010, 0.0105], (comm.Get_size(), 1))}
    straight = Run(comm, adaptive(comm, policy="static"), calibration=flat)

    def save(epoch):
        if epoch == 0:
            saved.update(copy.deepcopy(dict(model=straight.model.state_dict(),
                                             optimizer=straight.optimizer.state_dict(),
                                             balancer=straight.balancer.state_dict())))

    tables = straight.epochs(0, 2, save)
    resumed = Run(comm, adaptive(comm, policy="static"), calibrate=False)
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed.balancer.load_state_dict(saved["balancer"])
    resumed.sampler.load_state_dict({"epoch": 1, "step": 0, "seed": 4})
    assert np.array_equal(resumed.epochs(1, 2)[0], tables[1])
    assert torch.equal(resumed.params(), straight.params())
    if comm.Get_size() > 1:                              # (one rank has no noise estimate: B stays)
        assert saved["balancer"]["global_batch"] > 8     # it switched after the first epoch


@pytest.mark.mpi(min_size=1)
def test_an_epoch_whose_batch_stays_keeps_its_vector(comm):
    """No change of B, no change of anything else: the vector that ran (here one set by
    hand, uneven under ssgd) stays, as do the planners."""
    balancer = adaptive(comm, start=24, upper=24, lower=24, policy="ssgd")
    uneven = allocation.proportional(24, speeds_for(comm.Get_size()))
    balancer.batch_sizes = uneven.copy()
    Run(comm, balancer, calibrate=False).epochs(0, 2)
    assert balancer.global_batch == 24 and balancer.batch_sizes.tolist() == uneven.tolist()


@pytest.mark.mpi(min_size=1)
def test_a_batch_set_by_hand_is_agreed_first_and_resumes(comm):
    """set_global_batch with another B on one rank fails on every rank, naming it, before
    any rank moves; a fixed balancer whose B was set by hand resumes at that B."""
    balancer = dbs_mpi.Balancer(comm, 24, "dbs", timeout=TIMEOUT)
    mine = 48 if comm.Get_rank() == comm.Get_size() - 1 and comm.Get_size() > 1 else 32
    if comm.Get_size() > 1:
        with pytest.raises(dbs_mpi.AgreedError, match="global_batch"):
            balancer.set_global_batch(mine)
        assert balancer.global_batch == 24
    balancer.set_global_batch(32)
    assert balancer.global_batch == 32 and balancer.batch_sizes.sum() == 32
    resumed = dbs_mpi.Balancer(comm, 24, "dbs", timeout=TIMEOUT)
    resumed.load_state_dict(copy.deepcopy(balancer.state_dict()))
    assert resumed.global_batch == 32 and resumed.batch_sizes.tolist() == balancer.batch_sizes.tolist()
    with pytest.raises(dbs_mpi.UserError, match="saved with global_batch 24, this balancer has 16"):
        dbs_mpi.Balancer(comm, 16, "dbs", timeout=TIMEOUT).load_state_dict(balancer.state_dict())


@pytest.mark.mpi(min_size=1)
def test_a_fixed_batchs_state_and_an_adaptive_one_do_not_mix(comm):
    fixed = dbs_mpi.Balancer(comm, 8, "dbs", timeout=TIMEOUT)
    with pytest.raises(dbs_mpi.UserError, match="saved with a fixed global batch"):
        adaptive(comm).load_state_dict(fixed.state_dict())
    with pytest.raises(dbs_mpi.UserError, match="adapting from 16"):
        adaptive(comm).load_state_dict(adaptive(comm, start=16).state_dict())
    with pytest.raises(dbs_mpi.UserError, match="lr scaling sqrt"):
        adaptive(comm).load_state_dict(adaptive(comm, rule="sqrt").state_dict())
    with pytest.raises(dbs_mpi.UserError, match=r"down to 2, .* this balancer has .*down to 4,"):
        adaptive(comm).load_state_dict(adaptive(comm, lower=2).state_dict())
    before = adaptive(comm, lower=8).state_dict()        # no bound in the state: as saved before B0 / 2 was the default
    assert "lower" not in before["adaptive"]
    old = adaptive(comm)
    old.load_state_dict(before)                          # ... resumes, never going below its start
    assert old.adaptive.lower == 8
    with pytest.raises(dbs_mpi.UserError, match=r"down to 8, .* this balancer has .*down to 2,"):
        adaptive(comm, lower=2).load_state_dict(before)  # a bound given by hand must match
    below = adaptive(comm, lower=2)
    below.load_state_dict(adaptive(comm, lower=2).state_dict())           # the same bounds: it resumes
    assert below.adaptive.lower == 2 and below.global_batch == 8
    with pytest.raises(RuntimeError, match="between epochs"):
        run = Run(comm, adaptive(comm), calibrate=False)
        run.sampler.set_epoch(0)
        iter(torch.utils.data.DataLoader(run.data, batch_sampler=run.sampler)).__next__()
        run.balancer.set_global_batch(16)


@pytest.mark.mpi(min_size=2)
def test_a_new_global_batch_keeps_out_of_a_set_the_set_check_banned(comm):
    """dbs within the epoch (2 ranks or more: one rank has no planner), rank 0 the fastest:
    the set of every rank is banned (as after a trial of the fastest ranks alone that won),
    and the vector runs rank 0 alone. The model alone would take every rank back at B =
    96; set_global_batch starts B within the set that ran, on every rank."""
    n = comm.Get_size()
    times = np.array([[0.002, 0.005]] + [[0.004, 0.010]] * (n - 1))
    balancer = dbs_mpi.Balancer(comm, 24, "dbs", timeout=TIMEOUT)
    balancer.use_calibration({"local_batch": [4, 16], "step_time": times})
    sets = balancer.replanner.planner.sets
    sets.ban(tuple(range(n)), 0, 1 << 20)
    balancer.batch_sizes = np.array([24] + [0] * (n - 1))
    vector = balancer.set_global_batch(96)
    assert vector.tolist() == [96] + [0] * (n - 1)
    assert comm.allgather(vector.tolist()) == [vector.tolist()] * n
    sets.banned.clear()
    assert (balancer.set_global_batch(192) > 0).all()             # a set not banned: the model's
