"""The bucketed gradient exchange (exchange.GradientExchange): bucket layout as pure unit
tests; under MPI (pytest-mpi), buckets reduced during backward give the blocking
exchange's result and the union-batch gradient at any number of ranks, also when hooks
fire out of order, a parameter is unused, or a rank has no samples in a step."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from dbs_mpi.mpi import transport

from dbs_mpi.planning import allocation
from dbs_mpi.training.exchange import FIRST_BUCKET_BYTES, MIB, GradientExchange, bucket_layout
from dbs_mpi.tools.config import Config
from dbs_mpi.tools.data import load_synthetic
from dbs_mpi.tools.models import MLP, LeNet5
from dbs_mpi.tools.train import train

LENET = [150, 6, 2400, 16, 48000, 120, 10080, 84, 840, 10]     # LeNet5() parameter sizes, registration order
SPEEDS = [1.0, 0.5, 0.2, 0.07, 0.3, 0.6, 0.9, 0.15]


# --- layout (no MPI) -----------------------------------------------------------

def test_default_caps_give_lenet5_and_the_mlp_one_bucket_in_reverse_order():
    assert [p.numel() for p in LeNet5().parameters()] == LENET
    assert bucket_layout(LENET) == [list(range(9, -1, -1))]
    mlp = [p.numel() for p in MLP().parameters()]
    assert 4 * sum(mlp) < FIRST_BUCKET_BYTES                       # 940 kB: still one bucket
    assert bucket_layout(mlp) == [[5, 4, 3, 2, 1, 0]]


def test_first_bucket_and_cap_close_a_bucket_once_reached():
    # sizes in elements of 4 bytes; first cap 40 bytes, then 100 bytes
    sizes = [30, 5, 5, 20, 4, 6]
    layout = bucket_layout(sizes, bucket_bytes=100, first_bucket_bytes=40)
    assert layout == [[5, 4], [3, 2], [1, 0]]                     # 40 B | 80+20=100 B | 20+120 B
    # every parameter exactly once, launch order is reverse registration order
    assert sorted(i for b in layout for i in b) == list(range(len(sizes)))
    assert [i for b in layout for i in b] == list(range(len(sizes) - 1, -1, -1))


def test_a_bucket_exceeds_its_cap_by_at_most_its_last_tensor():
    assert bucket_layout([1, 1000, 1], bucket_bytes=8, first_bucket_bytes=4) == [[2], [1], [0]]
    assert bucket_layout([1, 1000, 1], bucket_bytes=8, first_bucket_bytes=8) == [[2, 1], [0]]
    assert bucket_layout([1000, 1, 1], bucket_bytes=8, first_bucket_bytes=4) == [[2], [1, 0]]


def test_real_cap_sizes():
    sizes = [256 * 1024] * 30                                      # 1 MiB each
    layout = bucket_layout(sizes, bucket_bytes=25 * MIB, first_bucket_bytes=1 * MIB)
    assert [len(b) for b in layout] == [1, 25, 4]


def test_zero_caps_mean_one_bucket_and_no_parameters_one_empty_bucket():
    assert bucket_layout(LENET, 0, 0) == [list(range(9, -1, -1))]
    assert bucket_layout([], 100, 10) == [[]]


def test_grads_view_the_buffer_bucket_after_bucket():
    model = LeNet5()
    ex = GradientExchange(MPI.COMM_SELF, model.parameters(), bucket_bytes=40_000, first_bucket_bytes=4_000)
    assert ex.num_buckets == len(ex.layout) > 2
    assert sum(ex.bucket_numels()) == ex.numel == sum(LENET)
    params = list(model.parameters())
    for b, indices in enumerate(ex.layout):       # bucket b is flat[bounds[b]], registration order inside
        start, _ = ex.bounds[b]
        for index in sorted(indices):
            grad = params[index].grad
            assert grad.data_ptr() == ex.flat.data_ptr() + 4 * start
            start += grad.numel()
    assert ex.bounds[-1][1] == ex.numel + 1                        # the loss slot ends the final bucket
    loss = F.cross_entropy(model(torch.randn(3, 1, 28, 28)), torch.tensor([0, 1, 2]))
    ex.zero_grad(1.0)
    loss.backward()
    reference = torch.cat([p.grad.reshape(-1) for p in params]).clone()
    assert ex.allreduce(1.0, 0.25) == 0.25
    torch.testing.assert_close(ex.gradient(), reference, rtol=0, atol=0)


# --- under MPI -------------------------------------------------------------------

class Reversed(nn.Module):
    """Layers registered in one order and used in the other, plus a parameter that no
    step uses: hooks fire in the opposite of bucket order, and one never fires."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 10)        # registered first, used last
        self.unused = nn.Linear(5, 5)
        self.body = nn.Linear(64, 32)
        self.stem = nn.Linear(784, 64)       # registered last, used first

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x.flatten(1))))))


MODELS = {"lenet5": LeNet5, "mlp": MLP, "reversed": Reversed}
CAPS = {"one": (0, 0), "default": (25 * MIB, MIB), "small": (8_000, 2_000), "tiny": (1, 1)}


def local_rows(comm, vector):
    start = int(np.sum(vector[:comm.Get_rank()]))
    return slice(start, start + int(vector[comm.Get_rank()]))


def run_steps(comm, model_name, caps, vector_per_step, data, armed=True, sleep=False, seeded=True, steps=2, lr=0.1,
              transport="host", stage=None):
    """A few SGD steps with the exchange; returns (per-step global losses, final parameters, exchange).
    armed: the weight is given to zero_grad (buckets may start during backward);
    seeded: exchange.backward(loss) weights the gradients (else loss.backward(): a scaling pass);
    transport, stage: how buckets are summed (transport.py; stage=True copies CPU buckets through
    a host buffer, as GPU ranks do)."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    ex = GradientExchange(comm, model.parameters(), timeout=60, sleep_while_waiting=sleep,
                          bucket_bytes=caps[0], first_bucket_bytes=caps[1], transport=transport, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        vector = vector_per_step[step % len(vector_per_step)]
        total = float(np.sum(vector))
        rows = local_rows(comm, vector)
        b = rows.stop - rows.start
        weight = b / total
        ex.zero_grad(weight if armed else None)
        loss_value = 0.0
        if b:
            loss = F.cross_entropy(model(data.x[rows]), data.y[rows])
            if seeded:
                ex.backward(loss)
            else:
                loss.backward()
            loss_value = loss.item()
        losses.append(ex.allreduce(weight, loss_value * b / total))
        opt.step()
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), ex


def union_steps(model_name, vector_per_step, data, steps=2, lr=0.1):
    """The same steps in one process on each step's union batch."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        total = int(np.sum(vector_per_step[step % len(vector_per_step)]))
        opt.zero_grad()
        loss = F.cross_entropy(model(data.x[:total]), data.y[:total])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def vectors_for(n, total=53):
    """An uneven vector, and one in which the last rank has no samples (n > 1)."""
    uneven = allocation.proportional(total, [SPEEDS[i % len(SPEEDS)] for i in range(n)])
    starved = uneven.copy()
    if n > 1:
        starved[0] += starved[-1]
        starved[-1] = 0
    return [uneven, starved]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("model_name", ["lenet5", "mlp", "reversed"])
@pytest.mark.parametrize("caps", ["default", "small", "tiny"])
def test_bucketed_exchange_equals_blocking_and_union_batch(comm, model_name, caps):
    n = comm.Get_size()
    data = load_synthetic("train", 64, (1, 28, 28), 10, seed=2)
    vectors = vectors_for(n)
    got_losses, got, ex = run_steps(comm, model_name, CAPS[caps], vectors, data, steps=3)
    if caps != "default" and n > 1:
        assert ex.overlap and ex.num_buckets > 1
    blocking_losses, blocking, ref = run_steps(comm, model_name, CAPS["one"], vectors, data, steps=3)
    assert ref.num_buckets == 1 and not ref.overlap
    torch.testing.assert_close(got, blocking, rtol=1e-6, atol=1e-7)
    assert got_losses == pytest.approx(blocking_losses, rel=1e-6)
    union_losses, union = union_steps(model_name, vectors, data, steps=3)
    torch.testing.assert_close(got, union, rtol=1e-4, atol=2e-6)
    assert got_losses == pytest.approx(union_losses, rel=1e-5)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("armed,sleep,seeded", [(False, False, False), (True, False, False), (True, True, True),
                                                (False, False, True)])
def test_unarmed_unseeded_and_sleeping_exchanges_give_the_same_result(comm, armed, sleep, seeded):
    data = load_synthetic("train", 64, (1, 28, 28), 10, seed=4)
    vectors = vectors_for(comm.Get_size())
    _, got, ex = run_steps(comm, "reversed", CAPS["tiny"], vectors, data, armed=armed, sleep=sleep, seeded=seeded)
    _, expected, _ = run_steps(comm, "reversed", CAPS["one"], vectors, data, seeded=False)
    assert ex.sleep_while_waiting == (sleep and comm.Get_size() > 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)     # seeding rounds differently


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("transport,stage", [("host", True), ("gloo", None)])
@pytest.mark.parametrize("caps", ["one", "tiny"])
@pytest.mark.parametrize("sleep", [False, True])
def test_staged_and_torch_distributed_transports_give_the_mpi_result(comm, transport, stage, caps, sleep):
    """The host-staged path (a GPU rank's, here on CPU tensors: every bucket copied into a
    separate host buffer and back) and torch.distributed (gloo: the nccl path's logic) sum
    the same weighted buckets as MPI on the buffer itself, with buckets started during
    backward, a rank without samples, and either wait policy."""
    data = load_synthetic("train", 64, (1, 28, 28), 10, seed=6)
    vectors = vectors_for(comm.Get_size())
    losses, got, ex = run_steps(comm, "reversed", CAPS[caps], vectors, data, sleep=sleep, steps=3,
                                transport=transport, stage=stage)
    assert ex.transport.name == transport
    if stage:
        assert ex.transport.staged and ex.transport.host.data_ptr() != ex.flat.data_ptr()
    expected_losses, expected, _ = run_steps(comm, "reversed", CAPS["one"], vectors, data, steps=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert losses == pytest.approx(expected_losses, rel=1e-6)


class LateCopies(transport.HostMPI):
    """A GPU rank's host-staged path on CPU tensors: bucket copies that odd ranks see
    complete only when they wait for them (even ranks at once), so that their buckets'
    collectives begin at different times on different ranks."""

    def __init__(self, comm, flat, bounds):
        super().__init__(comm, flat, bounds, stage=True)
        self.side = "emulated"                     # start() defers, as on a GPU
        self.deferred = True                       # and the exchange begins the ready ones as it progresses

    def stage(self, b):
        start, stop = self.bounds[b]
        self.host[start:stop].copy_(self.flat[start:stop])
        self.ready[b] = "copying"

    def _ready(self, b, block):
        if self.ready[b] is None or block or self.comm.Get_rank() % 2 == 0:
            self.ready[b] = None
            return True
        return False

    def finish(self):
        self.flat.copy_(self.host)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sleep", [False, True])
def test_buckets_that_begin_late_keep_the_order_of_collectives(comm, sleep, monkeypatch):
    """Deferred bucket collectives (GPU staging) all begin before the sleeping barrier:
    otherwise one rank's Ibarrier meets another's Iallreduce and the sums are garbage."""
    monkeypatch.setattr(transport, "make", lambda name, comm, flat, bounds, *a, **k: LateCopies(comm, flat, bounds))
    data = load_synthetic("train", 64, (1, 28, 28), 10, seed=7)
    vectors = vectors_for(comm.Get_size())
    losses, got, ex = run_steps(comm, "reversed", CAPS["tiny"], vectors, data, sleep=sleep, steps=3)
    assert isinstance(ex.transport, LateCopies) and ex.num_buckets > 2
    monkeypatch.undo()
    expected_losses, expected, _ = run_steps(comm, "reversed", CAPS["one"], vectors, data, steps=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert losses == pytest.approx(expected_losses, rel=1e-6)


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_no_samples_still_reduces_every_bucket(comm):
    """The last rank computes nothing in every step (no backward, no hook); the others
    start their buckets from hooks. Same buckets, same order: no hang, right result."""
    n = comm.Get_size()
    data = load_synthetic("train", 64, (1, 28, 28), 10, seed=5)
    starved = vectors_for(n)[1]
    assert starved[-1] == 0
    losses, got, ex = run_steps(comm, "mlp", CAPS["small"], [starved], data, steps=3)
    assert ex.num_buckets > 2
    union_losses, union = union_steps("mlp", [starved], data, steps=3)
    torch.testing.assert_close(got, union, rtol=1e-4, atol=2e-6)
    assert losses == pytest.approx(union_losses, rel=1e-5)


@pytest.mark.mpi(min_size=2)
def test_misuse_is_reported(comm):
    """Every rank makes the same mistake, raises, and the exchange can still be drained."""
    torch.manual_seed(0)
    model = MLP()
    ex = GradientExchange(comm, model.parameters(), timeout=60, bucket_bytes=8_000, first_bucket_bytes=2_000)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([1, 2, 3, 4])
    ex.zero_grad(0.5)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="after its bucket's allreduce had started"):
        F.cross_entropy(model(x), y).backward()                    # a second backward in the same step
    ex.allreduce(0.5, 0.0)
    ex.zero_grad(0.5)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="weight"):
        ex.allreduce(0.25, 0.0)
    ex.allreduce(0.5, 0.0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("caps", ["one", "small"])
def test_grads_replaced_by_zero_grad_set_to_none_are_taken_over(comm, caps):
    """optimizer.zero_grad() / model.zero_grad() set .grad to None; the next backward makes
    fresh tensors. The exchange copies them into its buffer (in the hooks, or in
    allreduce) and puts its views back: the reduced gradient is still the union batch's."""
    n = comm.Get_size()
    data = load_synthetic("train", 64, (1, 28, 28), 10, seed=5)
    vector = vectors_for(n)[0]
    torch.manual_seed(0)
    model = MLP()
    ex = GradientExchange(comm, model.parameters(), timeout=60, bucket_bytes=CAPS[caps][0],
                          first_bucket_bytes=CAPS[caps][1])
    total = float(np.sum(vector))
    rows = local_rows(comm, vector)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        assert not ex.views_intact()
        ex.zero_grad(vector[comm.Get_rank()] / total)
        model.zero_grad(set_to_none=True)                        # after ours, too: still right
        F.cross_entropy(model(data.x[rows]), data.y[rows]).backward()
        ex.allreduce(vector[comm.Get_rank()] / total, 0.0)
        assert ex.views_intact()
        got = ex.gradient()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    F.cross_entropy(reference(data.x[:int(total)]), data.y[:int(total)]).backward()
    torch.testing.assert_close(got, torch.cat([p.grad.reshape(-1) for p in reference.parameters()]),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_training_with_small_buckets_is_allocation_invariant(comm, shared_tmp):
    """train() with many buckets and uneven local batches (the last partial step may
    leave a rank without samples) ends with the same model as one rank."""
    n, rank = comm.Get_size(), comm.Get_rank()
    cfg = Config(dataset="synthetic", synthetic_samples=400, test_subset=50, model="mlp", epochs=1,
                 global_batch=97, lr=0.05, momentum=0.9, seed=3, strategy="static",
                 speeds=tuple(SPEEDS[i % len(SPEEDS)] for i in range(n)), benchmark_steps=1, benchmark_warmup=0,
                 progress=False, bucket_mb=0.01, first_bucket_mb=0.002)
    many = train(comm, cfg, out=str(shared_tmp / f"buckets-{n}.h5"), log=lambda m: None)
    single = train(MPI.COMM_SELF, cfg.replace(speeds=()), out=str(shared_tmp / f"buckets-1-{rank}.h5"),
                   log=lambda m: None)
    flat = lambda s: torch.cat([p.detach().reshape(-1) for p in s.model.parameters()])
    torch.testing.assert_close(flat(many), flat(single), rtol=1e-4, atol=2e-5)
