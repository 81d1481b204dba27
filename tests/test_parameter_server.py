"""The parameter server's pure parts (no MPI): how work is handed out, message layout,
update-group sizes, staleness statistics, configuration checks; and the asynchronous
strategies end to end through `dbs-mpi train` under mpirun (bounded in time)."""
import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli
from dbs_mpi.planning import sharding
from dbs_mpi.tools.config import Config, ConfigError, check_world
from dbs_mpi.tools.models import LeNet5
from dbs_mpi.parameter_server import (HEADER, Cursor, Message, bind_gradients, bind_parameters, group_size,
                                      server_momentum, staleness_stats)
from dbs_mpi.training.results import read_run


def drain(cursor, vector, order):
    """Hand out everything, asking for workers in `order` (cycled); returns the assignments."""
    out = []
    for i in range(10_000):
        if cursor.done:
            return out
        if cursor.needs_epoch:
            cursor.begin_epoch(vector)
        w = order[i % len(order)]
        out.append((w, *cursor.take(w)))
    raise AssertionError("the cursor never finished")


@pytest.mark.parametrize("drop_last", [False, True])
def test_stream_hands_out_every_sample_once_per_epoch_in_epoch_order(drop_last):
    n, B = 103, 20
    cursor = Cursor(n, B, epochs=3, drop_last=drop_last, workers=3, rounds=False)
    vector = np.array([10, 6, 4])
    got = drain(cursor, vector, order=[0, 0, 1, 0, 2, 0, 1])   # a fast worker 0 asks most often
    per_epoch = 100 if drop_last else 103
    epochs = [e for _, e, _, _ in got]
    assert epochs == sorted(epochs), "all of epoch e before any of epoch e+1"
    for e in range(3):
        slices = [(s, c) for _, ep, s, c in got if ep == e]
        covered = np.concatenate([np.arange(s, s + c) for s, c in slices])
        assert covered.tolist() == list(range(per_epoch)), "contiguous, each position once, none past the end"
        assert all(c >= 1 for _, c in slices)
    for w, e, s, c in got:   # a worker gets its own local batch, less only at an epoch's end
        assert c == vector[w] or s + c == per_epoch


def test_rounds_are_the_synchronous_steps():
    """Rounds (hardsync): worker w's slice at step s is the synchronous rank w's, tail included."""
    n, B, vector = 107, 30, np.array([10, 10, 10])
    cursor = Cursor(n, B, epochs=2, drop_last=False, workers=3, rounds=True)
    got = drain(cursor, vector, order=[0, 1, 2])
    steps = sharding.steps_per_epoch(n, B)
    assert len(got) == 2 * steps * 3
    for e in range(2):
        perm = sharding.epoch_permutation(n, e, seed=5)
        for w in range(3):
            mine = [perm[s:s + c] for ww, ep, s, c in got if ww == w and ep == e]
            sync = sharding.epoch_shard(n, e, 5, B, vector, w)
            assert [m.tolist() for m in mine] == [x.tolist() for x in sync]
    assert [c for _, _, _, c in got[-3:]] == sharding.step_batch_sizes(n, B, vector)[-1].tolist() == [6, 6, 5]


def test_rounds_refuse_work_out_of_turn():
    cursor = Cursor(60, 30, epochs=1, drop_last=False, workers=3, rounds=True)
    cursor.begin_epoch([10, 10, 10])
    cursor.take(0)
    with pytest.raises(RuntimeError, match="out of turn"):
        cursor.take(2)


def test_group_size():
    assert group_size("asgd", 7, 1) == 1
    assert group_size("dbs-sgd", 7, 1) == 1
    assert [group_size("nsoftsync", 6, n) for n in (1, 2, 3, 4, 6)] == [6, 3, 2, 1, 1]


def test_staleness_stats():
    mean, high, pct = staleness_stats([0, 1, 1, 2, 6])
    assert (mean, high) == (2.0, 6.0)
    assert pct == pytest.approx(np.percentile([0, 1, 1, 2, 6], [50, 90, 99]).tolist())
    assert staleness_stats([]) == (0.0, 0.0, [0.0, 0.0, 0.0])


def test_message_layout_and_views():
    msg = Message(5)
    assert msg.array.dtype == np.float32 and msg.array.size == 2 * HEADER + 5
    msg.header[0] = 2.0 ** 40 + 1          # integers far past float32's range survive in the header
    msg.body[:] = torch.arange(5.0)
    assert msg.array[:2 * HEADER].view(np.float64)[0] == 2.0 ** 40 + 1
    assert msg.array[2 * HEADER:].tolist() == [0, 1, 2, 3, 4]
    assert msg.head[0].size == 2 * HEADER


def test_parameters_and_gradients_view_flat_buffers():
    torch.manual_seed(0)
    model = LeNet5()
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    n = before.numel()
    weights, grads = torch.zeros(n), torch.zeros(n)
    bind_parameters(model.parameters(), weights)
    bind_gradients(model.parameters(), grads)
    assert torch.equal(weights, before), "values kept"
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    assert grads.abs().sum() > 0, "autograd accumulated into the flat buffer"
    weights.zero_()
    assert all((p.detach() == 0).all() for p in model.parameters()), "parameters are views"


def test_config_checks_for_the_parameter_server():
    with pytest.raises(ConfigError, match="^strategy: asgd needs at least 2 ranks"):
        check_world(Config(strategy="asgd", speeds=()), 1)
    with pytest.raises(ConfigError, match="^softsync_n: "):
        check_world(Config(strategy="nsoftsync", softsync_n=4), 4)
    check_world(Config(strategy="nsoftsync", softsync_n=3), 4)
    with pytest.raises(ConfigError, match="^time_budget: "):
        Config(time_budget=-1.0)


def test_only_dbs_sgd_keeps_the_workers_timings_it_re_plans_from():
    """asgd and nsoftsync have no controller: the per-gradient timings, which every
    checkpoint holds, are not kept (they grew for the whole run)."""
    from dbs_mpi.parameter_server.work import WorkPlan
    for controller, kept in ((None, 0), (object(), 3)):
        plan = WorkPlan(Config(strategy="asgd"), 600, 2, [32, 32], controller, print)
        for _ in range(3):
            plan.measured(1, 32, 0.01)
        assert len(plan.measure[1]) == kept


def test_a_worker_resumed_with_another_number_of_workers_continues_its_emulated_windows():
    """Resumed by another number of workers, a worker's emulator starts afresh: its step
    and time windows then count from its own gradients and seconds so far (its stats), and
    the epoch it is in is set up (slow_epochs), not skipped until the next one."""
    from mpi4py import MPI
    from dbs_mpi.parameter_server import Worker
    from dbs_mpi.parameter_server.records import C_COMPUTE, C_DATA, C_GRADIENTS
    from dbs_mpi.planning.heterogeneity import Emulator
    from dbs_mpi.tools.data import load_synthetic
    cfg = Config(strategy="asgd", dataset="synthetic", synthetic_samples=64, global_batch=16, epochs=3,
                 slow_rank=1, slow_factor=4.0, slow_epochs=(1, 2), slow_steps=(5, 9), speeds=(1.0, 0.5))
    emulator = Emulator.from_config(cfg, 1)
    worker = Worker(MPI.COMM_SELF, cfg, LeNet5(), load_synthetic("train", 64, (1, 28, 28), 10, seed=0), emulator)
    stats = np.zeros_like(worker.stats)
    stats[0, C_GRADIENTS], stats[1, C_GRADIENTS], stats[0, C_COMPUTE], stats[1, C_DATA] = 4, 2, 1.5, 0.25
    worker.load_state({"stats": stats, "perm_epoch": 1, "epoch": 1})
    worker.resume_emulator()
    assert (emulator.run_step, emulator.trained) == (6, 1.75)
    assert emulator.epoch_slowed and emulator.factor == 4.0 / 0.5
    emulator.load_state_dict({**emulator.state_dict(), "factor": 1.0})    # a state's factor is re-derived
    assert emulator.factor == 4.0 / 0.5


TINY = ["--dataset", "synthetic", "--synthetic-samples", "512", "--test-subset", "128", "--global-batch", "64",
        "--benchmark-steps", "1", "--benchmark-warmup", "0"]


@pytest.mark.parametrize("strategy, extra", [
    ("asgd", []),
    ("nsoftsync", ["--softsync-n", "2", "--staleness-lr", "true"]),
    ("dbs-sgd", ["--speeds", "1,1,0.25", "--benchmark-steps", "3", "--benchmark-warmup", "1"]),
])
def test_cli_runs_every_asynchronous_strategy(tmp_path, strategy, extra):
    out = tmp_path / f"{strategy}.h5"
    proc = run_cli(["train", *TINY, "--strategy", strategy, "--epochs", "2", "--out", str(out), *extra], ranks=3,
                   timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("final: train loss") == 1 and "staleness over" in proc.stdout
    run = read_run(out)
    attrs, data = run["attrs"], run["data"]
    assert attrs["status"] == "complete" and attrs["strategy"] == strategy
    assert data["epoch/batch_sizes"].shape == (2, 3) and (data["epoch/batch_sizes"][:, 0] == 0).all()
    assert (data["epoch/batch_sizes"][:, 1:].sum(axis=1) == 64).all()
    for key in ("compute_time", "comm_time", "wait_time", "data_time", "speed", "gradients"):
        assert data[f"epoch/{key}"].shape == (2, 3)
    assert data["update/local_batch"].sum() == 2 * 512
    assert len(data["update/staleness"]) == len(data["update/worker"]) == len(data["update/time"])
    assert set(np.unique(data["update/worker"]).tolist()) == {1, 2}
    assert 0 < data["epoch/test_accuracy"][-1] <= 1
    if strategy == "dbs-sgd":
        b = data["epoch/batch_sizes"][-1]
        assert b[1] > b[2], f"the 0.25-speed worker should get the smaller local batch: {b.tolist()}"
    # every gradient's weight in its update: b_i / (c B / lambda), sample-weighted (c = 1 but nsoftsync's 1)
    c = 1
    counts, weights = data["update/local_batch"], data["update/weight"]
    expected = np.where(counts > 0, counts / (c * 64 / 2), 0.0)
    if strategy == "nsoftsync":       # staleness_lr: times 1/max(tau, 1)
        expected = expected / np.maximum(data["update/staleness"], 1)
    assert np.allclose(weights, expected)
    assert (data["update/step_norm"] > 0).any() and np.isfinite(data["update/step_norm"]).all()


def test_per_gradient_aggregation_weighs_every_gradient_alike(tmp_path):
    """aggregation = mean on the parameter server: each gradient (the mean over its own
    local batch) counts once, whatever its local batch."""
    out = tmp_path / "mean.h5"
    proc = run_cli(["train", *TINY, "--strategy", "dbs-sgd", "--aggregation", "mean", "--speeds", "1,1,0.25",
                    "--epochs", "1", "--out", str(out)], ranks=3, timeout=180)
    assert proc.returncode == 0, proc.stderr
    data = read_run(out)["data"]
    counts = data["update/local_batch"]
    assert len(set(counts.tolist())) > 1, "the workers should have different local batches"
    assert np.allclose(data["update/weight"][counts > 0], 1.0)


def test_server_momentum_subtracts_what_asynchrony_adds():
    cfg = Config(strategy="asgd", momentum=0.9)
    assert server_momentum(cfg, workers=3, c=1) == pytest.approx(0.9 - 2 / 3)
    assert server_momentum(cfg, workers=7, c=1) == pytest.approx(0.9 - 6 / 7)
    assert server_momentum(cfg, workers=3, c=3) == pytest.approx(0.9)          # hardsync: nothing in flight
    assert server_momentum(cfg, workers=20, c=1) == 0.0                       # never negative
    assert server_momentum(Config(strategy="asgd", implicit_momentum=False), 3, 1) == 0.9
    assert server_momentum(Config(strategy="asgd", optimizer="adam"), 3, 1) == cfg.momentum


DIVERGED = ["--dataset", "fashion-mnist", "--model", "lenet5", "--speeds", "1,1,0.5,0.25", "--global-batch", "96",
            "--subset", "9600", "--epochs", "2", "--lr", "0.05", "--seed", "3", "--test-subset", "2000"]


@pytest.mark.skipif(not (ROOT / "data" / "fashion-mnist").is_dir(), reason="Fashion-MNIST not in data/ (make data)")
@pytest.mark.parametrize("strategy", ["dbs-sgd", "asgd"])
def test_asynchronous_defaults_train_where_they_diverged(tmp_path, strategy):
    """dbs-sgd (and, at this seed, asgd) ended at chance with momentum 0.9 on the server:
    the step norms grew every update until the loss jumped to 5-7 and the network died
    (loss ln 10 = 2.30 from then on). Asynchrony adds its own momentum; the server's
    default momentum now leaves room for it (server_momentum)."""
    out = tmp_path / f"{strategy}.h5"
    proc = run_cli(["train", *DIVERGED, "--strategy", strategy, "--out", str(out)], ranks=4, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    accuracy, loss = run["data"]["epoch/test_accuracy"][-1], run["data"]["epoch/train_loss"][-1]
    assert accuracy > 0.5 and loss < 1.5, f"{strategy}: accuracy {accuracy:.3f}, train loss {loss:.3f}"


def test_cli_refuses_one_rank(tmp_path):
    proc = run_cli(["train", *TINY, "--strategy", "asgd", "--out", str(tmp_path / "x.h5")])
    assert proc.returncode == 2
    assert "strategy: asgd needs at least 2 ranks" in proc.stderr
    assert not (tmp_path / "x.h5").exists()
