"""Misuses of the library that would train another model without a word, caught (pytest-
mpi, any number of ranks, run at 1, 2 and 4): a loop that forgets sampler.set_epoch is
warned once a job, at its own line; clipping has a one-call form that clips the global
gradient, as one process would; a checkpoint part of another rank is refused naming both
ranks; a sampler reports the position a checkpoint gave it before it is iterated."""
import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import DataLoader

import dbs_mpi
from test_api_mpi import Pairs, UserNet, flat_params, uneven_balancer

TIMEOUT = 60.0


def loop(comm, epochs=2, set_epoch=True, clip=None, local_clip=None, zero_grad="optimizer", scaler=None):
    data, global_batch = Pairs(96, seed=7), 24
    torch.manual_seed(0)
    model = UserNet()
    balancer = uneven_balancer(comm, global_batch, timeout=TIMEOUT)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=3)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, balancer)
    norms = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_sampler=sampler):
            optimizer.zero_grad() if zero_grad == "optimizer" else model.zero_grad()   # model: set_to_none
            loss = F.cross_entropy(model(x), y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is not None:
                scaler.unscale_(optimizer)
            if local_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), local_clip)
            if clip is not None:
                norms.append(float(dbs_mpi.clip_grad_norm_(optimizer, clip, loss=loss)))
            if scaler is None:
                optimizer.step(loss=loss)
            else:
                scaler.step(optimizer, loss=loss)
                scaler.update()
        balancer.end_epoch()
    return model, norms, sampler, balancer


@pytest.mark.mpi(min_size=1)
def test_a_forgotten_set_epoch_is_warned_once_a_job_at_the_users_line(comm):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop(comm, epochs=3, set_epoch=False)
    mine = [w for w in caught if "set_epoch" in str(w.message)]
    if comm.Get_rank() == 0:
        assert len(mine) == 1 and mine[0].filename == __file__, [(w.filename, str(w.message)) for w in mine]
        assert "epoch 0 begins again" in str(mine[0].message)
    else:
        assert not mine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop(comm, epochs=2)                                          # set_epoch called: nothing to say


@pytest.mark.mpi(min_size=1)
def test_clip_grad_norm_clips_the_global_gradient_as_one_process_does(comm):
    model, norms, _, _ = loop(comm, clip=0.05)
    single, single_norms, _, _ = loop(MPI.COMM_SELF, clip=0.05)
    assert min(single_norms) > 0.05                                     # it clipped every step
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(single_norms), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(flat_params(model), flat_params(single), rtol=1e-4, atol=1e-6)


def local_edit_warnings(comm, **kwargs) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop(comm, epochs=2, **kwargs)
    return [w for w in caught if "changed in place" in str(w.message)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("zero_grad", ["optimizer", "model"])
def test_clipping_the_local_gradient_is_warned_once_at_the_users_line(comm, zero_grad):
    """torch.nn.utils.clip_grad_norm_ between backward and step clips each rank's own part:
    warned once (of 8 steps), at the loop's line, naming dbs_mpi.clip_grad_norm_, whether
    the .grad tensors view the exchange's buffer or were made anew after model.zero_grad()
    (set_to_none). The global clip, and GradScaler's unscale_ before the exchange (exact:
    every rank divides by the same factor), are not warned."""
    found = local_edit_warnings(comm, local_clip=0.05, zero_grad=zero_grad)
    assert len(found) == 1 and found[0].filename == __file__, [(w.filename, str(w.message)) for w in found]
    assert "dbs_mpi.clip_grad_norm_" in str(found[0].message)
    assert not local_edit_warnings(comm, clip=0.05, zero_grad=zero_grad)
    assert not local_edit_warnings(comm, zero_grad=zero_grad, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))


@pytest.mark.mpi(min_size=1)
def test_a_copys_backward_is_not_read_as_the_models(comm):
    """A copy of the model (what a rank sitting out probes on, in a thread) shares the
    watcher's hook; its backward ending is not the model's: read as the model's, the
    exchange's zeroing after the step looked like a local edit (warned in every run where a
    rank sat out and probed)."""
    from dbs_mpi.training.clipping import LocalEdits
    torch.manual_seed(0)
    model = UserNet()
    edits = LocalEdits(model, list(model.parameters()))
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])
    F.cross_entropy(copy.deepcopy(model)(x), y).backward()
    assert edits.after_backward is None
    F.cross_entropy(model(x), y).backward()
    assert edits.after_backward is not None                  # the model's own backward is read


@pytest.mark.mpi(min_size=1)
def test_another_ranks_part_of_a_checkpoint_is_refused_naming_both(comm):
    _, _, _, balancer = loop(comm, epochs=1)
    state = balancer.state_dict()
    other = (comm.Get_rank() + 1) % max(comm.Get_size(), 2)
    with pytest.raises(dbs_mpi.UserError, match=f"saved by rank {other}, and this is rank {comm.Get_rank()}"):
        balancer.load_state_dict({**state, "rank": other})
    balancer.load_state_dict(state)                                    # its own part loads


@pytest.mark.mpi(min_size=1)
def test_a_sampler_reports_a_loaded_position_before_it_is_iterated(comm):
    _, _, sampler, _ = loop(comm, epochs=1)
    sampler.load_state_dict({"epoch": 1, "step": 2, "seed": 3})
    assert sampler.state_dict() == {"epoch": 1, "step": 2, "seed": 3}
    fresh = dbs_mpi.HeteroSampler(Pairs(96, seed=7), uneven_balancer(comm, 24, timeout=TIMEOUT), seed=3)
    fresh.load_state_dict({"epoch": 2, "step": 0, "seed": 3})     # at an epoch's start, before the balancer's load
    assert fresh.state_dict() == {"epoch": 2, "step": 0, "seed": 3}


@pytest.mark.mpi(min_size=2)
def test_ranks_with_another_global_batch_are_told_at_once(comm):
    """The last rank builds its balancer with another global batch (200 against 256): it
    would wait in other collectives than the others; every rank stops at once instead."""
    import time
    last = comm.Get_rank() == comm.Get_size() - 1
    start = time.monotonic()
    with pytest.raises(dbs_mpi.AgreedError) as caught:
        dbs_mpi.Balancer(comm, 200 if last else 256, "ssgd", timeout=TIMEOUT)
    assert time.monotonic() - start < 10
    assert str(caught.value).startswith("Balancer: global_batch differs between the ranks: rank 0 has 256, "
                                        f"rank(s) [{comm.Get_size() - 1}] have 200")
    assert caught.value.local == (comm.Get_rank() == 0)           # one rank prints it


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting, mine, theirs", [("policy", "static", "dbs"), ("interval", "8", "epoch")])
def test_ranks_with_another_policy_or_interval_are_told_at_once(comm, setting, mine, theirs):
    last = comm.Get_rank() == comm.Get_size() - 1
    settings = {"policy": "dbs", "interval": "epoch", setting: mine if last else theirs}
    with pytest.raises(dbs_mpi.AgreedError) as caught:
        dbs_mpi.Balancer(comm, 24, settings["policy"], interval=settings["interval"], timeout=TIMEOUT)
    assert str(caught.value).startswith(f"Balancer: {setting} differs between the ranks: rank 0 has {theirs!r}, "
                                        f"rank(s) [{comm.Get_size() - 1}] have {mine!r}"), str(caught.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting", ["seed", "dataset_length"])
def test_ranks_whose_samplers_disagree_are_told_at_the_epochs_start(comm, setting):
    last = comm.Get_rank() == comm.Get_size() - 1
    balancer = dbs_mpi.Balancer(comm, 24, "ssgd", timeout=TIMEOUT)
    data = Pairs(96 if not (last and setting == "dataset_length") else 95, seed=7)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=5 if last and setting == "seed" else 3)
    with pytest.raises(dbs_mpi.AgreedError, match=f"HeteroSampler: {setting} differs between the ranks"):
        next(iter(sampler))


@pytest.mark.mpi(min_size=2)
def test_ranks_with_another_model_are_told_which(comm):
    last = comm.Get_rank() == comm.Get_size() - 1
    torch.manual_seed(0)
    model = UserNet(classes=6 if last else 5)
    balancer = dbs_mpi.Balancer(comm, 24, "ssgd", timeout=TIMEOUT)
    with pytest.raises(dbs_mpi.AgreedError, match=rf"the model of rank\(s\) \[{comm.Get_size() - 1}\] has other "
                                                  r"parameters than rank 0's \(\d+ values against \d+"):
        dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, balancer)



@pytest.mark.mpi
def test_a_fused_optimizer_over_channels_last_weights_is_refused(comm):
    """torch's fused update pairs weights and gradients by memory position; the exchange's
    gradients are in the default order: a channels-last weight (3 input channels: with one,
    both orders are the same memory) would be updated wrongly."""
    torch.manual_seed(0)                           # (the same weights on every rank)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    model = model.to(memory_format=torch.channels_last)
    balancer = dbs_mpi.Balancer(comm, 24, "ssgd", timeout=TIMEOUT)
    try:
        fused = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    except (TypeError, RuntimeError) as error:      # (a torch without a fused SGD on the CPU)
        pytest.skip(f"this torch builds no fused SGD here: {error}")
    with pytest.raises(ValueError, match="fused optimizer .* channels-last .* build it with fused=False"):
        dbs_mpi.DistributedOptimizer(fused, model, balancer)
    dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, foreach=True), model, balancer).close()

def rank_0_alone(comm):
    """A loop's parts where rank 0 alone takes part (the others left the gradient's sum)."""
    data = Pairs(96, seed=7)
    torch.manual_seed(0)
    model = UserNet()
    balancer = dbs_mpi.Balancer(comm, 24, "ssgd", timeout=TIMEOUT)
    balancer.batch_sizes = np.eye(comm.Get_size(), dtype=np.int64)[0] * 24
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=3)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, balancer)
    sampler.set_epoch(0)
    return model, balancer, DataLoader(data, batch_sampler=sampler), optimizer


@pytest.mark.mpi(min_size=2)
def test_a_grad_scaler_after_ranks_left_the_exchange_is_refused_on_every_rank(comm):
    """Only rank 0 takes part, so the others left the gradient's sum: a GradScaler's skip
    decision would need the reduced gradient on every rank, so it is refused, naming the fix."""
    model, _, loader, optimizer = rank_0_alone(comm)
    x, y = next(iter(loader))
    if not optimizer.sits_out:
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="construct the optimizer with leave_exchange=False"):
        optimizer.step(grad_scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.mpi(min_size=1)
def test_the_clipped_norm_is_the_same_on_ranks_out_of_the_sum(comm):
    """Only rank 0 takes part: the others hold no gradient, yet clip_grad_norm_ returns the
    global norm on every rank (a loop that skips a step on a bad norm skips it everywhere)."""
    model, balancer, loader, optimizer = rank_0_alone(comm)
    for x, y in loader:
        loss = 0.0
        if not optimizer.sits_out:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        norm = float(dbs_mpi.clip_grad_norm_(optimizer, 1.0, loss=loss))
        assert norm > 0 and comm.allgather(norm) == [norm] * comm.Get_size()
        optimizer.step()
    balancer.end_epoch()
