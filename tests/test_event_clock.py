"""The GPU step's late clock (training/event_clock.py) without a GPU: events from a fake
that completes them only when later work was queued behind them (a device running behind
the host), so that the reading really is late. The optimizer's records are amended once
the events are passed, and all of them before the epoch ends or a checkpoint reads them;
where the clock reads late and where it must not."""
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import DataLoader

import dbs_mpi
from dbs_mpi.training.event_clock import EventClock, LateSteps
from dbs_mpi.training.optimizer import _reads_late
from test_api_mpi import Pairs, UserNet


class LaggingEvents:
    """Events on a device `lag` events behind the host: an event is complete once `lag`
    more were recorded after it (or once waited for). Times are the host's at recording."""

    def __init__(self, lag=3):
        self.lag, self.recorded, self.waits = lag, 0, 0

    def new(self):
        return SimpleNamespace(t=None, n=None, waited=False)

    def record(self, event):
        self.recorded += 1
        event.t, event.n, event.waited = time.perf_counter(), self.recorded, False

    def done(self, event):
        return event.waited or self.recorded - event.n >= self.lag

    def wait(self, event):
        self.waits += 1
        event.waited = True

    @staticmethod
    def seconds(start, end):
        return end.t - start.t

    @staticmethod
    def host_slot():
        return torch.empty(1)


def test_readings_come_late_in_order_and_the_backlog_is_bounded():
    events = LaggingEvents(lag=4)
    clock = EventClock("cpu", depth=3, events=events)
    got = []
    for step in range(10):
        marks = [clock.mark(), clock.mark()]
        clock.push(step, marks, torch.tensor(float(step)))
        got += clock.harvest()
        assert len(clock) <= 3
    assert [r.key for r in got] == list(range(len(got))) and len(got) >= 7
    assert all(r.loss == r.key and len(r.seconds) == 2 and min(r.seconds) >= 0 for r in got)
    rest = clock.harvest(block=True)
    assert [r.key for r in got + rest] == list(range(10)) and len(clock) == 0
    assert EventClock("cpu", events=LaggingEvents()).harvest() == []


def test_a_step_without_a_loss_reads_nan_and_slots_are_reused():
    events = LaggingEvents(lag=1)
    clock = EventClock("cpu", events=events)
    clock.push("a", [clock.mark()])
    clock.push("b", [clock.mark()], torch.tensor(2.5))
    readings = clock.harvest(block=True)
    assert np.isnan(readings[0].loss) and readings[1].loss == 2.5
    clock.push("c", [clock.mark()], torch.tensor(1.0))
    assert len(clock._free_events) >= 1 and clock.harvest(block=True)[0].loss == 1.0


def late_run(epochs=2, checkpoint_at=None):
    """A 1-rank library loop whose optimizer reads a lagging fake clock (as a GPU rank's
    would read CUDA events): returns the epochs' stats, the losses step() returned, the
    clock, and the balancer's state_dict taken at `checkpoint_at` (epoch, step)."""
    comm = MPI.COMM_SELF
    data = Pairs(60, seed=5)
    torch.manual_seed(0)
    model = UserNet()
    balancer = dbs_mpi.Balancer(comm, 12, "ssgd", timeout=30)
    sampler = dbs_mpi.HeteroSampler(data, balancer, seed=0)
    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, balancer)
    clock = EventClock("cpu", events=LaggingEvents(lag=6))
    optimizer._clock.late = LateSteps(balancer, "cpu", clock)    # what _reads_late gives a GPU rank
    stats, returned, state = [], [], None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler)):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            returned.append(optimizer.step(loss=loss))
            if (epoch, step) == checkpoint_at:
                assert len(clock) > 0
                state = balancer.state_dict()
        stats.append(balancer.end_epoch())
    return stats, returned, clock, state


def test_the_optimizer_records_are_amended_before_the_epoch_ends():
    stats, returned, clock, _ = late_run()
    assert all(isinstance(r, torch.Tensor) and r.dim() == 0 for r in returned)   # nothing read on the host
    losses = np.concatenate([s.step_loss for s in stats])
    np.testing.assert_allclose(losses, [float(r) for r in returned], rtol=1e-6)
    for s in stats:
        assert np.all(s.step_pre > 0) and np.all(np.isfinite(s.step_compute)) and np.all(s.step_comm >= 0)
    assert len(clock) == 0 and clock.events.waits > 0                            # settled at each epoch's end


def test_a_checkpoint_taken_mid_epoch_holds_the_amended_steps():
    _, returned, _, state = late_run(epochs=1, checkpoint_at=(0, 2))
    saved = np.asarray(state["open"]["times"]["loss"])
    assert state["open"]["step"] == 3 and np.all(np.isfinite(saved))
    np.testing.assert_allclose(saved, [float(r) for r in returned[:3]], rtol=1e-6)


@pytest.mark.parametrize("device, exchange, idle, telemetry, synced, late", [
    ("cuda:0", "local", True, 0, False, True),
    ("cuda:0", "nccl", True, 0, False, True),
    ("cuda:0", "host", True, 0, False, False),          # the host copies wait for the device anyway
    ("cuda:0", "cuda-aware", True, 0, False, False),
    ("cuda:0", "local", False, 0, False, False),        # an emulated slower device stretches the compute's end
    ("cuda:0", "nccl", True, 3, False, False),          # dbs within the epoch reads its telemetry every step
    ("cuda:0", "nccl", True, 0, True, False),           # SyncBatchNorm waits inside the compute
    ("cpu", "local", True, 0, False, False),
])
def test_where_the_clock_reads_late(device, exchange, idle, telemetry, synced, late):
    balancer = SimpleNamespace(emulator=SimpleNamespace(idle=idle), telemetry_size=telemetry)
    assert _reads_late(torch.device(device), exchange, balancer, synced) is late


def test_an_emulated_speed_or_disturbance_is_not_idle():
    from dbs_mpi.planning.heterogeneity import Emulator
    assert Emulator(0).idle
    assert not Emulator(0, 0.5).idle
    assert not Emulator(1, slow_rank=1, slow_factor=3.0, slow_steps=(5, 9)).idle
    assert Emulator(0, slow_rank=1, slow_factor=3.0).idle                # another rank is slowed
