"""Devices and transports without a GPU: the assignment of devices to ranks (auto by
local rank, per-rank lists, GPUs bound per task by the scheduler), thread shares of
mixed CPU/GPU nodes, the choice of gradient exchange, and the errors a missing device
gives, on every rank (pytest-mpi at 1, 2 and 4 ranks). The CUDA paths themselves are
tested in test_cuda.py, on a GPU machine."""
import subprocess
import sys

import pytest
import torch

from dbs_mpi.mpi import devices, transport
from dbs_mpi.tools.config import UserError

ALL = ["GPU-a", "GPU-b"]          # two GPUs every rank of the node sees (plain mpirun)


def test_auto_gives_a_nodes_gpus_by_local_rank_and_the_cpu_to_the_others():
    inventory = [("n1", ALL)] * 4 + [("n2", ALL)] * 3
    assert devices.assign(["auto"] * 7, inventory) == ["cuda:0", "cuda:1", "cpu", "cpu",
                                                        "cuda:0", "cuda:1", "cpu"]


def test_auto_follows_the_gpus_a_scheduler_bound_to_each_task():
    # Slurm --gpus-per-task=1: every rank sees one GPU, its own, as cuda:0
    inventory = [("n1", ["GPU-a"]), ("n1", ["GPU-b"]), ("n1", []), ("n1", ["GPU-b"])]
    assert devices.assign(["auto"] * 4, inventory) == ["cuda:0", "cuda:0", "cpu", "cpu"]


def test_cuda_shares_gpus_round_robin_and_cuda_n_is_taken_as_given():
    inventory = [("n1", ALL)] * 3
    assert devices.assign(["cuda"] * 3, inventory) == ["cuda:0", "cuda:1", "cuda:0"]
    assert devices.assign(["cuda:1", "cuda:1", "cpu"], inventory) == ["cuda:1", "cuda:1", "cpu"]
    # a per-rank list mixing all kinds: auto skips the GPU that cuda:0 took
    assert devices.assign(["cuda:0", "auto", "auto"], inventory) == ["cuda:0", "cuda:1", "cpu"]


def test_a_device_that_does_not_exist_is_named():
    with pytest.raises(UserError, match=r"device: cuda:2 requested for rank 1 on n1, which sees 2 CUDA device\(s\) "
                                        r"\(cuda:0 \.\. cuda:1\)"):
        devices.assign(["cpu", "cuda:2"], [("n1", ALL)] * 2)
    with pytest.raises(UserError, match=r"device: cuda requested for rank 0 on cpu-node, which has no CUDA device"):
        devices.assign(["cuda"], [("cpu-node", [])])


def test_per_rank_lists_and_specs_are_checked():
    assert devices.per_rank_specs("cuda", ("cpu", "CUDA:1"), 2) == ["cpu", "cuda:1"]
    assert devices.per_rank_specs("cuda", (), 3) == ["cuda"] * 3
    with pytest.raises(UserError, match="devices: has 2 entries but there are 3 ranks"):
        devices.per_rank_specs("auto", ("cpu", "cpu"), 3)
    with pytest.raises(UserError, match="devices: 'gpu' is not a device"):
        devices.per_rank_specs("auto", ("cpu", "gpu"), 2)


def test_cpu_ranks_share_the_cores_gpu_ranks_leave():
    # the machine: 16 cores, 1 GPU rank and 7 CPU ranks -> 2 threads each
    places = [("n1", tuple(range(16)))] * 8
    names = ["cuda:0"] + ["cpu"] * 7
    assert [devices.cpu_threads(places, names, r) for r in range(8)] == [1] + [2] * 7
    assert devices.cpu_threads(places, ["cpu"] * 8, 3) == 2
    assert devices.cpu_threads(places, ["cpu"] * 4 + ["cuda:0"] * 4, 0) == 3      # (16 - 4) // 4
    assert devices.cpu_threads(places, names, 5, limit=1) == 1                     # OMP_THREAD_LIMIT
    pinned = [("n1", (r,)) for r in range(8)]                                      # one core per rank
    assert devices.cpu_threads(pinned, names, 2) == 1


def test_gpu_ranks_get_a_core_of_their_own_where_the_launcher_bound_nothing():
    places = [("n1", tuple(range(16)))] * 8
    names = ["cuda:0"] + ["cpu"] * 7
    plan = devices.core_plan(places, names, mode="gpu")
    assert plan[0] == {0} and all(p == set(range(1, 16)) for p in plan[1:])
    pairs = lambda core: {core, core + 8 if core < 8 else core - 8}      # SMT: 0 and 8 are one core
    assert devices.core_plan(places, names, pairs, "gpu")[0] == {0, 8}
    assert devices.core_plan(places, names, pairs)[3] == set(range(16)) - {0, 8}
    assert devices.core_plan(places, names)[:2] == [None, set(range(1, 16))]      # the default: CPU ranks only
    assert devices.core_plan(places, names, mode="none") == [None] * 8
    # nothing to do: no GPU rank, no CPU rank, a launcher's own binding, too few cores
    assert devices.core_plan(places, ["cpu"] * 8) == [None] * 8
    assert devices.core_plan(places, ["cuda:0"] * 8) == [None] * 8
    assert devices.core_plan([("n1", (r,)) for r in range(8)], names) == [None] * 8
    assert devices.core_plan([("n1", (0, 1))] * 3, ["cuda:0", "cpu", "cpu"]) == [None] * 3
    # two nodes are planned apart: n2 has no GPU rank
    two = [("n1", (0, 1, 2, 3))] * 2 + [("n2", (0, 1, 2, 3))] * 2
    assert devices.core_plan(two, ["cuda:0", "cpu", "cpu", "cpu"], mode="gpu") == [{0}, {1, 2, 3}, None, None]


def test_binding_is_chosen_by_an_environment_variable(monkeypatch):
    monkeypatch.delenv("DBS_MPI_BIND", raising=False)
    assert devices.bind_mode() == "cpu"
    monkeypatch.setenv("DBS_MPI_BIND", "GPU")
    assert devices.bind_mode() == "gpu"
    monkeypatch.setenv("DBS_MPI_BIND", "core")
    with pytest.raises(UserError, match="DBS_MPI_BIND: must be one of cpu, gpu, none; got 'core'"):
        devices.bind_mode()
    assert devices.siblings(0) >= {0}


def test_the_exchange_is_chosen_from_every_ranks_device():
    cpu = [None, None]
    gpu = [("n1", "GPU-a"), ("n1", "GPU-b")]
    shared = [("n1", "GPU-a"), ("n1", "GPU-a")]
    assert transport.choose("auto", [None], False, [None]) == "local"                  # one rank: nothing to sum
    assert transport.choose("auto", [("n1", "GPU-a")], True, [None]) == "local"
    assert transport.choose("auto", cpu, False, [None, None]) == "host"
    assert transport.choose("auto", gpu, True, [False, False]) == "nccl"
    assert transport.choose("auto", gpu, False, [True, True]) == "cuda-aware"
    assert transport.choose("auto", gpu, False, [True, None]) == "host"
    assert transport.choose("auto", [gpu[0], None], True, [True, None]) == "host"       # a mixed job
    assert transport.choose("auto", shared, True, [None, None]) == "host"               # NCCL refuses shared GPUs
    assert transport.choose("auto", shared, True, [True, True]) == "cuda-aware"
    assert transport.choose("cuda-aware", [gpu[0], None], False, [None, None]) == "cuda-aware"
    with pytest.raises(UserError, match=r"nccl needs every rank on a GPU; rank\(s\) \[1\] compute on the CPU"):
        transport.choose("nccl", [gpu[0], None], True, [None, None])
    with pytest.raises(UserError, match=r"nccl takes one rank per GPU, and rank\(s\) \[0, 1\] share a GPU"):
        transport.choose("nccl", shared, True, [None, None])
    with pytest.raises(UserError, match="nccl is not available in this torch build"):
        transport.choose("nccl", gpu, False, [None, None])
    with pytest.raises(UserError, match=r"the MPI library of rank\(s\) \[0\] is not CUDA-aware"):
        transport.choose("cuda-aware", gpu, False, [False, True])
    with pytest.raises(UserError, match="gloo reduces CPU tensors"):
        transport.choose("gloo", gpu, True, [None, None])
    with pytest.raises(UserError, match="exchange: must be one of"):
        transport.choose("mpi", cpu, False, [None, None])


def test_batches_move_to_the_device_whole():
    x, y = torch.randn(3, 2), torch.tensor([1, 2, 3])
    moved = devices.to_device({"x": x, "pair": (x, [y])}, "cpu")
    assert moved["x"] is x and moved["pair"][1][0] is y
    assert devices.model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert devices.model_device(torch.nn.ReLU()) == torch.device("cpu")


def test_the_cpu_and_the_mpi_library_are_described():
    d = devices.describe("cpu")
    assert d["device"] == "cpu" and d["name"] and d["memory_gib"] > 0
    assert devices.mpi_cuda_aware() in (True, False, None)
    v = devices.cuda_versions()
    assert v["gpus"] == torch.cuda.device_count()


# --- under MPI ------------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
def test_auto_selects_the_cpu_on_a_machine_without_gpus(comm):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU (test_cuda.py covers it)")
    assert devices.select(comm, "auto") == torch.device("cpu")
    assert devices.select(comm, "cpu", ["cpu"] * comm.Get_size()) == torch.device("cpu")
    described = devices.all_devices(comm, torch.device("cpu"))
    assert [d["device"] for d in described] == ["cpu"] * comm.Get_size()


@pytest.mark.mpi(min_size=1)
def test_a_missing_gpu_fails_on_every_rank_together(comm):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from dbs_mpi.mpi.agreement import AgreedError
    last = comm.Get_size() - 1
    specs = ["cpu"] * last + ["cuda:0"]          # only the last rank asks for a GPU
    with pytest.raises(AgreedError, match=f"cuda:0 requested for rank {last} on") as info:
        devices.select(comm, "auto", specs)
    assert info.value.origin == 0                # every rank computes the same assignment: rank 0 reports it
    with pytest.raises(AgreedError, match="devices: has"):
        devices.select(comm, "auto", ["cpu"] * (comm.Get_size() + 1))


@pytest.mark.mpi(min_size=1)
def test_a_bad_binding_setting_fails_on_every_rank_together(comm, monkeypatch):
    from dbs_mpi.mpi.agreement import AgreedError
    monkeypatch.setenv("DBS_MPI_BIND", "core")
    with pytest.raises(AgreedError, match="DBS_MPI_BIND: must be one of cpu, gpu, none"):
        devices.select(comm, "cpu")


@pytest.mark.mpi(min_size=1)
def test_the_exchange_is_agreed_and_refused_together(comm):
    from dbs_mpi.mpi.agreement import AgreedError
    cpu = torch.device("cpu")
    assert transport.agree(comm, "auto", cpu) == ("host" if comm.Get_size() > 1 else "local")
    assert transport.agree(comm, "cuda-aware", cpu) == "cuda-aware"     # CPU ranks then use host memory
    if not torch.cuda.is_available():
        with pytest.raises(AgreedError, match="nccl needs every rank on a GPU"):
            transport.agree(comm, "nccl", cpu)


@pytest.mark.mpi(min_size=1)
def test_select_gives_cpu_ranks_their_share_of_the_cores_unless_init_was_told(comm, monkeypatch):
    from dbs_mpi.mpi import placement
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(7)
        monkeypatch.setattr(placement, "THREADS_GIVEN", True)      # dbs_mpi.init(threads=7)
        devices.select(comm, "cpu")
        assert torch.get_num_threads() == 7
        monkeypatch.setattr(placement, "THREADS_GIVEN", False)
        devices.select(comm, "cpu")
        places = placement.placement(comm)
        assert torch.get_num_threads() == devices.cpu_threads(places, ["cpu"] * comm.Get_size(), comm.Get_rank(),
                                                              placement.thread_limit())
    finally:
        torch.set_num_threads(before)


@pytest.mark.mpi(min_size=1)
def test_resync_makes_drifted_replicas_and_their_optimizer_state_equal_again(comm):
    import dbs_mpi
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    balancer = dbs_mpi.Balancer(comm, 4 * comm.Get_size(), "ssgd", timeout=60)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), model, balancer)
    data = torch.utils.data.TensorDataset(torch.randn(8 * comm.Get_size(), 4), torch.randint(3, (8 * comm.Get_size(),)))
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=0)
    for x, y in torch.utils.data.DataLoader(data, batch_sampler=sampler):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    balancer.end_epoch()
    with torch.no_grad():                     # what rounding differences would do, exaggerated
        for p in model.parameters():
            p.add_(1e-3 * comm.Get_rank())
            optimizer.state[p]["exp_avg"].add_(0.5 * comm.Get_rank())
    drift = optimizer.resync()
    assert drift == pytest.approx(0.5 * (comm.Get_size() - 1), rel=1e-5)     # the largest: the optimizer state's
    from dbs_mpi.mpi.collectives import allgather_object
    mine = [t.detach().clone() for t in model.parameters()] + \
           [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()] + [model[1].running_mean.clone()]
    for other in allgather_object(comm, mine):
        for a, b in zip(mine, other):
            assert torch.equal(a, b)


def test_binding_reaches_every_thread_of_the_process():
    code = ("import os, threading, time\n"
            "from dbs_mpi.mpi import devices\n"
            "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
            "devices.bind_process({0})\n"
            "print(sorted({tuple(sorted(os.sched_getaffinity(int(x)))) for x in os.listdir('/proc/self/task')}))\n"
            "t.join()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[(0,)]"


def test_the_calibration_step_takes_the_model_s_memory_order_and_the_caller_s_autocast():
    """model_step (the start-up calibration's step) feeds a channels-last model its inputs
    in that order, as training does with --channels-last, and computes under the autocast
    it is called in (train.py calibrates under its --amp)."""
    from dbs_mpi.mpi.devices import autocast_dtype, memory_format
    from dbs_mpi.training.profiling import model_step
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    assert memory_format(model) == torch.contiguous_format
    model = model.to(memory_format=torch.channels_last)
    assert memory_format(model) == torch.channels_last and autocast_dtype("cpu") is None
    pointwise_first = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Conv2d(4, 4, 3))
    assert memory_format(pointwise_first.to(memory_format=torch.channels_last)) == torch.channels_last   # (1x1: both)
    seen = []
    step = model_step(model, torch.nn.functional.cross_entropy, torch.randn(8, 3, 8, 8), torch.randint(2, (8,)))
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append((args[0].is_contiguous(memory_format=torch.channels_last)
                                               and not args[0].is_contiguous(), out.dtype))
        if isinstance(module, torch.nn.Conv2d) else None)
    try:
        step(4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert autocast_dtype("cpu") == torch.bfloat16
            step(4)
    finally:
        handle.remove()
    assert seen == [(True, torch.float32), (True, torch.bfloat16)], seen
