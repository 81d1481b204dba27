"""dbs_mpi.sample_weighted (training/ddp.py) under MPI (pytest-mpi): torch DistributedDataParallel on gloo, started
from the MPI communicator, with the sample-weighted comm hook. Every test holds for any
number of ranks (run at 1, 2 and 4):

* a comm hook gets DDP's raw local gradient (not divided by the world size);
* sample_weighted gives every .grad the gradient of the mean loss over the union of
  the step's samples, step after step with changing uneven batches (an empty batch, a
  partial step, one bucket and several), and it is not DDP's default average;
* a HeteroSampler + DataLoader loop with a balancer: exact for the placeholder sample
  of a rank without samples, over two dbs epochs (the balancer's steps move on);
* init_process_group and misuses fail loudly, on every rank together.

Every wait is bounded: the TCPStore and gloo time out after TIMEOUT seconds.
"""
import contextlib
import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import dbs_mpi
from dbs_mpi.mpi import process_group
from dbs_mpi.planning import allocation
from dbs_mpi.training import ddp
from dbs_mpi.planning.sharding import epoch_permutation
from test_api_mpi import SPEEDS, Pairs, UserNet as Net   # a user's model and data, uneven speeds

TIMEOUT = 60.0
CAPS = {"one bucket": 25.0, "several buckets": 0.0001}     # DDP's bucket_cap_mb (rebuilt after the first step)
TIGHT = dict(rtol=1e-5, atol=1e-6)


class Boxed:
    """An input that is not a tensor: nothing to count samples from."""

    def __init__(self, x):
        self.x = x


class BoxedNet(Net):
    def forward(self, box):
        return super().forward(box.x if isinstance(box, Boxed) else box)


@pytest.fixture
def group(comm):
    group = ddp.init_process_group(comm, "gloo", timeout=TIMEOUT)
    yield group
    ddp.destroy_process_group()


def models(net_class=Net, **ddp_kwargs):
    """The same seeded model on every rank: DDP-wrapped, and a plain copy (the reference)."""
    torch.manual_seed(0)
    net = net_class()
    reference = copy.deepcopy(net)
    return DDP(net, **ddp_kwargs), reference


def step_samples(step, total, classes=5):
    """The union batch of a step: `total` seeded samples, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(total, 1, 8, 8, generator=g), torch.randint(classes, (total,), generator=g)


def my_part(x, y, sizes, rank):
    start = int(sum(sizes[:rank]))
    return x[start:start + sizes[rank]], y[start:start + sizes[rank]]


def step_sizes(world):
    """Local batches of every step: uneven, changing; an empty batch; a partial step."""
    rows = [[3 * i + 2 for i in range(world)],
            [(5 * i + 1) % 4 + 1 for i in range(world)],
            [2 * i + 1 for i in range(world)],
            [1] + [0] * (world - 1)]
    if world > 1:
        rows[2][-1] = 0                              # the last rank has no samples in step 3
    return rows


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def reference_grads(reference, x, y):
    reference.zero_grad()
    F.cross_entropy(reference(x), y).backward()
    return grads(reference)


def assert_grads_equal(model, expected):
    for (name, p), e in zip(model.module.named_parameters(), expected):
        torch.testing.assert_close(p.grad, e, **TIGHT, msg=lambda m: f"{name}: {m}")


def step_and_align(optimizers, model, reference):
    """Both optimizers' step; the parameters agree; the reference then takes the model's
    (so that float rounding cannot build up over the steps of a tight comparison)."""
    for optimizer in optimizers:
        optimizer.step()
    with torch.no_grad():
        for p, q in zip(model.module.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, **TIGHT)
            q.copy_(p)


@pytest.mark.mpi(min_size=1)
def test_init_process_group_matches_the_communicator(comm):
    group = ddp.init_process_group(comm, timeout=TIMEOUT)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (comm.Get_rank(), comm.Get_size())
        if not torch.cuda.is_available():
            assert dist.get_backend() == "gloo"                            # CPU ranks agree on gloo
        value = torch.tensor([float(comm.Get_rank() + 1)])
        dist.all_reduce(value)
        assert value.item() == comm.Get_size() * (comm.Get_size() + 1) / 2
        assert ddp.init_process_group(comm, timeout=TIMEOUT) is group        # already there: no second rendezvous
    finally:
        ddp.destroy_process_group()
    assert not dist.is_initialized()
    ddp.destroy_process_group()                                            # a no-op now


@pytest.mark.mpi(min_size=1)
def test_an_unavailable_backend_fails_on_every_rank(comm):
    if dist.is_nccl_available() and torch.cuda.is_available():
        pytest.skip("nccl is available here")
    with pytest.raises(dbs_mpi.AgreedError, match=r"nccl (is not available|needs a GPU)") as exc:
        ddp.init_process_group(comm, "nccl", timeout=TIMEOUT)
    assert exc.value.origin == 0 and exc.value.local == (comm.Get_rank() == 0)
    assert isinstance(exc.value, dbs_mpi.UserError)
    with pytest.raises(dbs_mpi.AgreedError, match="unknown torch.distributed backend 'bogus'"):
        ddp.init_process_group(comm, "bogus", timeout=TIMEOUT)
    assert not dist.is_initialized()


@pytest.mark.mpi(min_size=1)
def test_a_group_initialised_otherwise_is_refused_on_every_rank(comm):
    ddp.init_process_group(MPI.COMM_SELF, "gloo", timeout=TIMEOUT)        # every rank alone
    try:
        if comm.Get_size() == 1:
            assert ddp.init_process_group(comm, timeout=TIMEOUT) is dist.group.WORLD
        else:
            with pytest.raises(dbs_mpi.AgreedError, match="already initialised as rank 0 of 1"):
                ddp.init_process_group(comm, timeout=TIMEOUT)
    finally:
        ddp.destroy_process_group()


def test_the_backend_is_agreed_from_every_ranks_device():
    gpu = lambda host, uuid: (host, uuid)
    own = [(None, gpu("a", "G0"), True), (None, gpu("a", "G1"), True)]
    assert process_group.agree_backend(own) == "nccl"
    assert process_group.agree_backend([own[0], (None, gpu("a", "G0"), True)]) == "gloo"          # ranks sharing a GPU
    assert process_group.agree_backend([own[0], (None, None, True)]) == "gloo"                   # a CPU rank
    assert process_group.agree_backend([(None, gpu("a", "G0"), False), own[1]]) == "gloo"        # no NCCL on one rank
    assert process_group.agree_backend([("gloo", gpu("a", "G0"), True), (None, None, True)]) == "gloo"
    with pytest.raises(dbs_mpi.UserError, match=r"different torch.distributed backends \(gloo, nccl\)"):
        process_group.agree_backend([("nccl", gpu("a", "G0"), True), ("gloo", None, True)])


def test_the_master_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert process_group.master_address(["a", "a", "a"]) == "127.0.0.1"
    assert process_group.master_address(["a", "no-such-host.invalid"]).count(".") == 3


@pytest.mark.mpi(min_size=1)
def test_a_comm_hook_gets_the_raw_local_gradient(comm, group):
    """DDP does not divide by the world size before a registered hook (so the
    sample-weighted hook must not multiply it back); its default reduction does."""
    model, reference = models()
    plain, _ = models()

    def identity(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    model.register_comm_hook(None, identity)
    sizes = [3 * i + 2 for i in range(comm.Get_size())]
    x, y = my_part(*step_samples(0, sum(sizes)), sizes, comm.Get_rank())
    F.cross_entropy(model(x), y).backward()
    assert_grads_equal(model, reference_grads(reference, x, y))
    F.cross_entropy(plain(x), y).backward()                                # DDP's own reduction: the mean
    mine = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    total = mine.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(mine, total / comm.Get_size(), **TIGHT)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("caps", list(CAPS))
def test_the_gradient_is_the_union_batch_s_step_after_step(comm, group, caps):
    model, reference = models(bucket_cap_mb=CAPS[caps])
    state = ddp.sample_weighted(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step, sizes in enumerate(step_sizes(comm.Get_size())):
        union = step_samples(step, sum(sizes))
        x, y = my_part(*union, sizes, comm.Get_rank())
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()                            # an empty batch's loss is NaN: zeroed
        assert state.local_batch == sizes[comm.Get_rank()]
        assert_grads_equal(model, reference_grads(reference, *union))
        step_and_align((optimizer, ref_optimizer), model, reference)
    buckets = model._get_ddp_logging_data()["num_buckets_reduced"]
    assert (buckets == 1) == (caps == "one bucket"), buckets


@pytest.mark.mpi(min_size=1)
def test_the_weighted_gradient_is_not_ddp_s_average(comm, group):
    """Uneven batches: DDP's default (1/n) sum_i g_i misses the union gradient, the hook hits it."""
    sizes = [3 * i + 2 for i in range(comm.Get_size())]
    union = step_samples(0, sum(sizes))
    x, y = my_part(*union, sizes, comm.Get_rank())
    weighted, reference = models()
    ddp.sample_weighted(weighted)
    default, _ = models()
    F.cross_entropy(weighted(x), y).backward()
    F.cross_entropy(default(x), y).backward()
    expected = reference_grads(reference, *union)
    assert_grads_equal(weighted, expected)
    if comm.Get_size() == 1:
        assert_grads_equal(default, expected)                              # one rank: the same thing
        return
    gap = max(float((p.grad - e).abs().max()) for p, e in zip(default.module.parameters(), expected))
    assert gap > 1e-3, f"DDP's average should differ from the union gradient (max difference {gap})"


def uneven_balancer(comm, global_batch, policy="dbs"):
    speeds = [SPEEDS[i % len(SPEEDS)] for i in range(comm.Get_size())]
    balancer = dbs_mpi.Balancer(comm, global_batch, policy, speeds=speeds, min_gain=0.0, timeout=TIMEOUT)
    balancer.batch_sizes = allocation.proportional(global_batch, speeds)
    return balancer


@pytest.mark.mpi(min_size=1)
def test_a_hetero_sampler_loop_with_a_balancer_gives_the_union_gradient(comm, group):
    data, global_batch = Pairs(150), 48          # 4 steps; the last has 6 samples (some ranks none at 4 ranks)
    balancer = uneven_balancer(comm, global_batch)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    model, reference = models(bucket_cap_mb=CAPS["several buckets"])
    state = ddp.sample_weighted(model, balancer=balancer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for epoch in range(2):                       # dbs re-plans within the epochs (its telemetry rides with DDP)
        sampler.set_epoch(epoch)
        perm = torch.from_numpy(epoch_permutation(len(data), epoch, 1))
        for s, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler)):
            if (epoch, s) == (0, 0):
                balancer.propose(np.roll(balancer.batch_sizes, 1))        # announced with this step
            row = balancer.step_batch_sizes().copy()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert balancer.step == s + 1, "the step's last bucket moves the balancer on"
            assert state.local_batch == row[comm.Get_rank()] and len(y) == max(row[comm.Get_rank()], 1)
            union = perm[s * global_batch:(s + 1) * global_batch]
            assert_grads_equal(model, reference_grads(reference, data.x[union], data.y[union]))
            step_and_align((optimizer, ref_optimizer), model, reference)
        stats = balancer.end_epoch()
        assert stats.steps == 4 and stats.table.sum(axis=1).tolist() == [48, 48, 48, 6]
        assert (stats.step_compute > 0).all() and np.isnan(stats.step_loss).all()
        if comm.Get_size() > 1 and epoch == 0:
            assert stats.changes and stats.changes[0].step == 1, "the proposal applies from the next step"
            assert (stats.table[0] != stats.table[1]).any()


@pytest.mark.mpi(min_size=1)
def test_a_compiled_ddp_model_gives_the_union_gradient(comm, group):
    """torch.compile of the DDP-wrapped model (Dynamo's eager backend): the step's local
    batch and the hook's weighting still run eagerly, so each step's gradient is the union
    batch's, with uneven, changing local batches."""
    torch._dynamo.reset()
    data, global_batch = Pairs(150), 48
    balancer = uneven_balancer(comm, global_batch)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    model, reference = models()
    ddp.sample_weighted(model, balancer=balancer)
    for _, expected in compiled_epoch(model, reference, data, sampler, global_batch):
        assert_grads_equal(model, expected)
    assert (balancer.end_epoch().step_compute > 0).all()


def compiled_epoch(model, reference, data, sampler, global_batch):
    """One epoch of the DDP `model` compiled (Dynamo's eager backend) beside `reference` on the
    union batches: yields after each backward (the model's and the reference's gradients),
    then both take the step and align."""
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    sampler.set_epoch(0)
    perm = torch.from_numpy(epoch_permutation(len(data), 0, 1))
    for s, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler)):
        optimizer.zero_grad()
        F.cross_entropy(compiled(x), y).backward()
        union = perm[s * global_batch:(s + 1) * global_batch]
        yield grads(model), reference_grads(reference, data.x[union], data.y[union])
        step_and_align((optimizer, ref_optimizer), model, reference)


@pytest.mark.mpi(min_size=1)
def test_a_compiled_ddp_model_with_sync_batchnorm_gives_the_union_gradient(comm, group):
    """torch.compile of a DDP model with dbs_mpi's SyncBatchNorm and sample_weighted(balancer=):
    the layers read each step's row from the balancer when they run, so every step's
    gradient and running statistics are one process's on the union batch, the step where
    every rank but rank 0 feeds a placeholder sample (6 samples, all rank 0's) included."""
    from test_sync_batchnorm_mpi import BNNet, buffers
    torch._dynamo.reset()
    n, data, global_batch = comm.Get_size(), Pairs(150), 48
    balancer = dbs_mpi.Balancer(comm, global_batch, "ssgd", timeout=TIMEOUT)
    balancer.batch_sizes = np.array([global_batch - 2 * (n - 1)] + [2] * (n - 1))
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    torch.manual_seed(0)
    net = BNNet()
    reference = copy.deepcopy(net)
    model = DDP(dbs_mpi.convert_sync_batchnorm(net, comm, TIMEOUT))
    ddp.sample_weighted(model, balancer=balancer)
    for got, expected in compiled_epoch(model, reference, data, sampler, global_batch):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(buffers(model.module), buffers(reference), rtol=1e-5, atol=1e-6)
    table = balancer.end_epoch().table
    assert table[-1].tolist() == [6] + [0] * (n - 1), table


@pytest.mark.mpi(min_size=1)
def test_a_batch_that_is_not_the_sampler_s_is_refused_before_the_forward(comm, group):
    data = Pairs(64)
    balancer = uneven_balancer(comm, 16, "ssgd")
    model, _ = models()
    ddp.sample_weighted(model, balancer=balancer)
    with pytest.raises(RuntimeError, match="no epoch is open"):
        model(data.x[:4])
    batches = iter(DataLoader(data, batch_sampler=dbs_mpi.HeteroSampler(data, balancer)))
    x, y = next(batches)
    with pytest.raises(RuntimeError, match="HeteroSampler"):
        model(torch.cat([x, x[:1]]))                                       # one sample too many
    F.cross_entropy(model(x), y).backward()                                # the right batch goes through
    assert balancer.step == 1


@pytest.mark.mpi(min_size=1)
def test_an_adaptive_global_batch_is_refused_by_the_hook(comm, group):
    """global_batch="auto" chooses B from the ranks' gradient norms, which the hook does not carry."""
    model, _ = models()
    balancer = dbs_mpi.Balancer(comm, "auto", "ssgd", global_batch_start=16)
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        ddp.sample_weighted(model, balancer=balancer)


@pytest.mark.mpi(min_size=1)
def test_a_forward_without_a_batch_first_tensor_needs_the_local_batch_by_hand(comm, group):
    model, reference = models(BoxedNet)
    state = ddp.sample_weighted(model)
    sizes = [2 * i + 1 for i in range(comm.Get_size())]
    union = step_samples(0, sum(sizes))
    x, y = my_part(*union, sizes, comm.Get_rank())
    with pytest.raises(RuntimeError, match="state.local_batch"):
        model(Boxed(x))
    state.local_batch = len(x)
    F.cross_entropy(model(Boxed(x)), y).backward()
    assert_grads_equal(model, reference_grads(reference, *union))
    with pytest.raises(AttributeError, match="balancer"):
        ddp.SampleWeightedState(balancer=uneven_balancer(comm, 16, "ssgd")).local_batch = 3


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("how", ["state.micro_batches", "no_sync by hand"])
@pytest.mark.parametrize("counted", [True, False], ids=["counted", "balancer"])
def test_accumulation_under_no_sync_gives_the_union_gradient(comm, group, how, counted):
    """Gradient accumulation under DDP: each rank's local batch in micro-batches of 3
    (uneven: 3 need not divide b_i), the micro-batch's mean loss scaled by n_k / b_i, all
    but the last under no_sync(). The hook weighs the accumulated local gradient by the
    step's b_i (counted over the micro-batches, or the balancer's), so every step is the
    one a single process makes on the union batch, as without accumulation."""
    data, global_batch = Pairs(150), 48
    balancer = uneven_balancer(comm, global_batch)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=1)
    model, reference = models(bucket_cap_mb=CAPS["several buckets"])
    state = ddp.sample_weighted(model, balancer=None if counted else balancer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    sampler.set_epoch(0)
    perm = torch.from_numpy(epoch_permutation(len(data), 0, 1))
    for s, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler)):
        local = int(balancer.step_batch_sizes()[comm.Get_rank()])
        x, y = (x[:local], y[:local]) if counted else (x, y)          # counted: no placeholder sample
        optimizer.zero_grad()
        if how == "state.micro_batches":
            for (xm, ym), weight in state.micro_batches((x, y), 3):
                (F.cross_entropy(model(xm), ym) * weight).backward()
        else:
            parts = list(zip(x.split(3), y.split(3)))
            for k, (xm, ym) in enumerate(parts):
                with model.no_sync() if k < len(parts) - 1 else contextlib.nullcontext():
                    (F.cross_entropy(model(xm), ym) * len(ym) / max(len(y), 1)).backward()
        if counted:
            balancer.record_step(0.0, 0.0, 0.0, 0.0)                     # the loop moves the balancer on
        assert state.local_batch == local
        union = perm[s * global_batch:(s + 1) * global_batch]
        assert_grads_equal(model, reference_grads(reference, data.x[union], data.y[union]))
        step_and_align((optimizer, ref_optimizer), model, reference)
    assert s == 3
    balancer.end_epoch()


@pytest.mark.mpi(min_size=1)
def test_accumulation_that_would_weight_the_gradient_wrongly_raises(comm, group):
    """With a balancer, micro-batches that reach the local batch before the forward DDP
    reduces are refused (the last must be outside no_sync()); SyncBatchNorm under no_sync()
    is refused (its statistics would be a micro-batch's)."""
    data = Pairs(64)
    balancer = uneven_balancer(comm, 16, "ssgd")
    model, _ = models()
    ddp.sample_weighted(model, balancer=balancer)
    x, y = next(iter(DataLoader(data, batch_sampler=dbs_mpi.HeteroSampler(data, balancer))))
    with pytest.raises(RuntimeError, match="outside no_sync"), model.no_sync():
        model(x)
    torch.manual_seed(0)
    bn = DDP(dbs_mpi.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4),
                                                                 torch.nn.BatchNorm1d(4)), comm))
    ddp.sample_weighted(bn)
    with pytest.raises(RuntimeError, match="SyncBatchNorm"), bn.no_sync():
        bn(x)


@pytest.mark.mpi(min_size=1)
def test_misuses_that_would_weight_the_gradient_wrongly_raise(comm, group):
    """Every rank makes the same mistake, so every rank raises before any collective."""
    x, y = step_samples(0, 4)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ddp.sample_weighted(Net())
    model, _ = models()
    ddp.sample_weighted(model)
    model.eval()                                                           # DDP reduces, nothing was counted
    with pytest.raises(RuntimeError, match="no training forward"):
        F.cross_entropy(model(x), y).backward()
    empty, _ = models()                                                    # (DDP cannot go on after a failed hook)
    ddp.sample_weighted(empty)
    with pytest.raises(RuntimeError, match="no rank had samples"):
        F.cross_entropy(empty(x[:0]), y[:0]).backward()
    if comm.Get_size() > 1:
        alone = dbs_mpi.Balancer(MPI.COMM_SELF, 16, "ssgd")
        with pytest.raises(ValueError, match="not the DDP process group"):
            ddp.sample_weighted(models()[0], balancer=alone)


@pytest.mark.mpi(min_size=1)
@pytest.mark.filterwarnings("ignore:.*GradScaler.*:FutureWarning")
def test_a_grad_scaler_with_the_sample_weighted_hook_agrees_on_every_rank(comm, group):
    """DDP reduces in backward, so GradScaler's unscale and inf/NaN check see the reduced
    gradient, the same on every rank: the scaled run is the unscaled one, and an overflow
    planted on one rank skips that step on all, with the scale halved everywhere."""
    rank, world = comm.Get_rank(), comm.Get_size()
    results = {}
    for scaled, poison in ((False, None), (True, None), (True, 1)):     # step 1: every rank has samples
        model, _ = models()
        ddp.sample_weighted(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=scaled)
        scales, unchanged = [], []
        for step, sizes in enumerate(step_sizes(world)[:4]):
            x, y = my_part(*step_samples(step, sum(sizes)), sizes, rank)
            before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y) if len(y) else model(x).sum() * 0     # an empty batch: 0
            if poison == step and rank == world - 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            scales.append(scaler.get_scale() if scaled else 1.0)
            unchanged.append(bool(torch.equal(before, after)))
        results[(scaled, poison)] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]), scales,
                                     unchanged)
    torch.testing.assert_close(results[(True, None)][0], results[(False, None)][0], **TIGHT)
    _, scales, unchanged = results[(True, 1)]
    assert unchanged == [False, True, False, False] and scales[1] == scales[0] / 2
    every = comm.allgather(scales)
    assert all(s == scales for s in every)
