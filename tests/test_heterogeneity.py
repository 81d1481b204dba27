"""Heterogeneity emulation: no MPI."""
import time

import pytest
import torch

from dbs_mpi.tools.config import Config
from dbs_mpi.planning.heterogeneity import Emulator, others_compute


def test_speed_stretches_compute():
    e = Emulator(0, 0.25)
    e.start_epoch(0, 10)
    start = time.perf_counter()
    slept = e.stretch(0.01)
    assert slept == pytest.approx(0.03)
    assert time.perf_counter() - start >= 0.03


def test_speeds_are_relative_to_the_fastest():
    cfg = Config(speeds=(4.0, 2.0, 1.0))
    assert [Emulator.from_config(cfg, r).speed for r in range(3)] == [1.0, 0.5, 0.25]


def test_a_coupled_rank_is_k_times_slower_only_while_others_of_its_node_compute():
    e = Emulator(0, 0.5, couple=3.0)
    e.start_epoch(0, 10)
    assert (e.factor_with(False), e.factor_with(True)) == (2.0, 6.0)
    assert e.stretch(0.004, others_compute=False) == pytest.approx(0.004)          # its speed alone: 1/0.5
    assert e.stretch(0.004, 0.002, others_compute=True) == pytest.approx(5 * 0.002)   # x 3 more beside others
    assert not e.idle and Emulator(1, 1.0, couple=2.0).stretch(0.004) == 0.0
    with pytest.raises(ValueError, match="couple"):
        Emulator(0, 1.0, couple=0.5)


def test_others_compute_reads_the_step_s_row_and_the_hosts():
    hosts = ["a", "a", "b", "a"]
    assert others_compute(hosts).tolist() == [True, True, False, True]          # the calibration: all compute
    assert others_compute(hosts, [64, 0, 64, 0]).tolist() == [False, True, False, True]
    assert others_compute(hosts, [64, 0, 64, 1]).tolist() == [True, True, False, True]
    assert others_compute([0], [64]).tolist() == [False]                        # alone on its node


def test_couple_is_per_rank_from_the_configuration():
    cfg = Config(couple="0:3,2:1.5")
    assert [Emulator.from_config(cfg, r).couple for r in range(3)] == [3.0, 1.0, 1.5]


def test_slowdown_window():
    e = Emulator(1, 1.0, slow_rank=1, slow_factor=3.0, slow_epochs=(2, 4))
    factors = []
    for epoch in range(6):
        e.start_epoch(epoch, 5)
        factors.append(e.factor)
    assert factors == [1, 1, 3, 3, 1, 1]
    other = Emulator(0, 1.0, slow_rank=1, slow_factor=3.0, slow_epochs=(2, 4))
    other.start_epoch(2, 5)
    assert other.factor == 1


def test_random_sleep_disturbance_is_seeded_and_bounded():
    def trace(seed):
        e = Emulator(0, 1.0, seed=seed, sleep_prob=0.3, sleep_seconds=(5, 10), sleep_epochs=(4, 20))
        out = []
        for epoch in range(60):
            e.start_epoch(epoch, 100)
            out.append(e.epoch_sleep)
        return out
    a = trace(1)
    assert a == trace(1) and a != trace(2)
    assert any(s > 0 for s in a) and any(s == 0 for s in a)
    assert all(s == 0 or 5 <= s <= 10 for s in a)
    runs, current = [], 0                      # lengths of disturbed stretches: 4..20 epochs (merged runs may be longer)
    for s in a + [0]:
        if s > 0:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    complete = runs[:-1] if a[-1] > 0 else runs   # a stretch cut off by the end of the trace may be shorter
    assert len(complete) >= 2 and min(complete) >= 4, (runs, a[-1])


def test_stretch_takes_the_work_not_the_wait_for_a_core():
    """Given the CPU time of the compute, the slow-down stretches the smaller of CPU and
    wall time: a rank that waited for a core (background load, oversubscription) is not
    made to wait 1/s - 1 times as long again."""
    e = Emulator(0, 0.25)
    e.start_epoch(0, 10)
    assert e.stretch(0.010, cpu_seconds=0.002) == pytest.approx(3 * 0.002)     # waited 8 ms for a core
    assert e.stretch(0.002, cpu_seconds=0.008) == pytest.approx(3 * 0.002)     # 4 threads busy: the wall time
    assert e.stretch(0.004) == pytest.approx(3 * 0.004)                        # no CPU time given: the wall


def test_a_gpu_rank_stretches_its_wall_time():
    """On a GPU rank the CPU time is kernel launches and waits, not the device's work: the
    balancer of a model on a GPU sets wall_clock, and the wall time is stretched."""
    e = Emulator(0, 0.25)
    e.start_epoch(0, 10)
    e.wall_clock = True
    assert e.stretch(0.010, cpu_seconds=0.001) == pytest.approx(3 * 0.010)
    from mpi4py import MPI

    from dbs_mpi import Balancer
    balancer = Balancer(MPI.COMM_SELF, 8, "ssgd")
    balancer.on_device("cuda:0")
    assert balancer.emulator.wall_clock
    balancer.on_device(torch.device("cpu"))
    assert not balancer.emulator.wall_clock


def test_distributed_optimizer_stretches_cpu_time_not_waiting():
    """A forward that waits 200 ms without computing (as a rank does while other processes
    hold its core) on an emulated 0.25-speed rank: the step sleeps about 3 x its CPU work
    (milliseconds), not 3 x its wall time (over 600 ms). With the wall time stretched, ssgd beside a slow rank on a loaded machine
    ran up to 3 times slower than the same run on a quiet one (the grid of 2026-11-23)."""
    import torch

    from dbs_mpi import Balancer, DistributedOptimizer, init

    class Waiting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x):
            time.sleep(0.2)                      # off the CPU, like a rank waiting for a core
            return self.linear(x)

    comm = init()
    if comm.Get_size() != 1:
        pytest.skip("a 1-rank test")
    model = Waiting()
    balancer = Balancer(comm, 8, "ssgd", emulator=Emulator(0, 0.25))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, balancer)
    stretched = []
    original = balancer.stretch
    balancer.stretch = lambda wall, cpu=None, row=None: stretched.append((wall, original(wall, cpu, row))) or stretched[-1][1]
    from dbs_mpi import HeteroSampler
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(2, (16,)))
    sampler = HeteroSampler(data, balancer, seed=0)
    for idx in sampler:
        x, y = data[idx]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    balancer.end_epoch()
    assert len(stretched) == 2
    assert all(wall >= 0.2 and slept < wall for wall, slept in stretched), \
        f"(wall, slept) {stretched}: the wait was stretched as if it were compute"


def test_steps_and_seconds_windows_slow_the_slow_rank_only():
    slow = Emulator(1, 1.0, slow_rank=1, slow_factor=4.0, slow_steps=(2, 4), slow_seconds=(10.0, 12.0))
    other = Emulator(0, 1.0, slow_rank=1, slow_factor=4.0, slow_steps=(2, 4))
    factors = []
    for e in (slow, other):
        e.start_epoch(0, 10)
        seen = [e.factor]
        for step, trained in enumerate([1.0, 2.0, 3.0, 4.0, 10.5, 11.0, 12.5]):
            e.step_done(trained)
            seen.append(e.factor)
        factors.append(seen)
    #            steps 0    1    2    3    4    5 (10.5 s) 6 (11 s) 7 (12.5 s)
    assert factors[0] == [1.0, 1.0, 4.0, 4.0, 1.0, 4.0, 4.0, 1.0]
    assert factors[1] == [1.0] * 8
    restored = Emulator(1, 1.0, slow_rank=1, slow_factor=4.0, slow_steps=(2, 4))
    restored.load_state_dict(slow.state_dict())
    assert (restored.run_step, restored.trained, restored.factor) == (7, 12.5, 1.0)


def test_contention_is_a_real_process_on_the_rank_s_core_for_its_steps():
    import os

    from dbs_mpi.planning.heterogeneity import Contention
    before = os.sched_getaffinity(0)
    contention = Contention(1, 3)
    contention.at(0)
    assert contention.process is None
    contention.at(1)
    try:
        pid = contention.process.pid
        core = {min(before)}
        assert os.sched_getaffinity(0) == core and os.sched_getaffinity(pid) == core
        start = time.process_time()
        time.sleep(0.3)
        with open(f"/proc/{pid}/stat") as f:                     # it computes: utime + stime in clock ticks
            fields = f.read().rsplit(")", 1)[1].split()
        assert int(fields[11]) + int(fields[12]) > 0
        assert time.process_time() - start < 0.1
        contention.at(2)
        assert contention.process is not None
    finally:
        contention.at(3)
    assert contention.process is None and os.sched_getaffinity(0) == before
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_the_balancer_couples_a_rank_from_the_step_s_row_and_its_node():
    """Balancer.stretch reads the step's row (None: the calibration, every rank computes)
    against the ranks' hosts it gathered at construction; alone on its node a coupled
    rank is never slowed."""
    from mpi4py import MPI

    from dbs_mpi import Balancer
    balancer = Balancer(MPI.COMM_SELF, 8, "ssgd", emulator=Emulator(0, 1.0, couple=3.0))
    assert balancer.stretch(0.002, 0.002) == 0.0                     # one rank: nobody beside it
    balancer.hosts = ["node-a", "node-a", "node-b"]                   # as if two more ranks had been gathered
    assert balancer.stretch(0.002, 0.002, [8, 0, 8]) == 0.0            # only a rank of another node computes
    assert balancer.stretch(0.002, 0.002, [8, 1, 0]) == pytest.approx(0.004)
    assert balancer.stretch(0.002, 0.002) == pytest.approx(0.004)      # the calibration: all compute
