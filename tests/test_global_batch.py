"""The adaptive global batch's pure parts and its settings (no MPI): the step time it
predicts at any B, the decision, the lr's factor and how it is applied, the schedule's
position by samples, and the configuration's refusals."""
import math

import numpy as np
import pytest
import torch

from dbs_mpi.options import UserError
from dbs_mpi.planning import allocation, goodput, schedule
from dbs_mpi.tools import config
from dbs_mpi.planning.goodput import AdaptiveBatch
from dbs_mpi.training.global_batch import scaled_step


MODEL = allocation.SpeedModel(per_sample=np.array([1e-4, 2e-4]), overhead=np.array([0.01, 0.01]))


def vector_at(b):
    return allocation.allocate(b, MODEL.per_sample, MODEL.overhead)


def test_the_predicted_step_is_the_slowest_rank_plus_the_fixed_seconds():
    v = vector_at(300)
    expected = float(np.max(MODEL.overhead + MODEL.per_sample * v)) + 0.005
    assert goodput.predicted_step(MODEL, 300, vector_at, 0.005) == pytest.approx(expected)
    assert goodput.predicted_step(MODEL, 300, lambda b: None, 0.005) == math.inf


def test_the_fixed_seconds_are_a_step_beyond_its_slowest_compute():
    pre = np.array([[0.010, 0.012, 0.011], [0.020, 0.019, 0.021]])            # (ranks, steps)
    rest = 0.004                                                               # comm + update + data, each step
    total = pre.max(axis=0) + rest
    data, comm = np.full_like(pre, 0.001), np.full_like(pre, 0.002)
    compute = pre + 0.001
    wait = total - data - comm - compute
    assert goodput.fixed_seconds(data, compute, comm, wait, pre) == pytest.approx(rest)
    assert goodput.fixed_seconds(*(np.full((2, 0), 1.0),) * 5) == 0.0


def test_each_steps_gain_and_goodput_follow_its_noise_scale():
    rows = goodput.per_step(512, [math.nan, 1000.0, 4000.0], 128, 0.25)
    assert np.isnan(rows[0]).all()                                      # no noise scale yet
    for row, noise in zip(rows[1:], (1000.0, 4000.0)):
        assert row[0] == pytest.approx(goodput.gain(512, noise, 128)) and row[1] == pytest.approx(row[0] / 0.25)
    assert rows[1, 0] < rows[2, 0] <= 4                                 # more noise: more gain, at most B / B0
    assert np.isnan(goodput.per_step(512, [1000.0], 128, math.inf)[:, 1]).all()   # B cannot run: no prediction


def test_a_step_time_flat_in_the_batch_doubles_the_batch_where_noise_is_large():
    adaptive = AdaptiveBatch(16, 256)
    choice, records = adaptive.decide(16, 1e5, lambda b: 0.010 + 1e-6 * b, upper=10_000)
    assert choice == 32                                                      # at most twice the current B ...
    assert adaptive.decide(128, 1e5, lambda b: 0.010 + 1e-6 * b, upper=10_000)[0] == 256   # ... up to the bound
    assert adaptive.decide(64, 1e5, lambda b: 0.010 + 1e-6 * b, upper=100)[0] == 100
    assert records["global_batch"] == 16 and records["gain"] == pytest.approx(1.0)
    assert records["goodput"] == pytest.approx(1 / (0.010 + 16e-6))


def test_no_noise_scale_yet_or_a_step_time_linear_in_the_batch_keeps_it():
    adaptive = AdaptiveBatch(16, 256)
    assert adaptive.decide(16, None, lambda b: 0.01, upper=256)[0] == 16
    assert AdaptiveBatch(16, 256, lower=16).decide(16, 50.0, lambda b: 1e-3 * b, upper=256)[0] == 16  # no throughput
    assert adaptive.decide(16, 50.0, lambda b: 1e-3 * b, upper=256)[0] == 8    # to win; below: progress per sample
    assert adaptive.decide(64, 1e5, lambda b: 0.01, upper=32)[0] == 64         # the data bounds it: stay


def test_below_the_start_only_down_to_the_lower_bound_and_halving_at_most():
    """A step whose cost is all per sample (no throughput to lose) and a small noise
    scale: the smallest B makes the most progress a second, where the lower bound lets
    it."""
    step = lambda b: 1e-3 * b
    default = AdaptiveBatch(128, 1024)
    assert default.decide(128, 10.0, step, upper=1024)[0] == 64                          # by default B0 / 2 ...
    assert default.decide(64, 10.0, step, upper=1024)[0] == 64 and default.lower == 64    # ... and no lower
    assert AdaptiveBatch(128, 1024, lower=128).decide(128, 10.0, step, upper=1024)[0] == 128   # never below B0
    below = AdaptiveBatch(128, 1024, lower=16)
    assert below.decide(128, 10.0, step, upper=1024)[0] == 64                           # at most halved ...
    assert below.decide(32, 10.0, step, upper=1024)[0] == 16                            # ... down to the bound
    assert below.decide(16, 10.0, step, upper=1024)[0] == 16
    assert below.decide(64, 1e5, lambda b: 0.010 + 1e-6 * b, upper=1024)[0] == 128      # and up again with noise
    for rule in ("adascale", "sqrt", "linear"):                                          # the start's lr below it
        assert AdaptiveBatch(128, 1024, rule, lower=16).factor(64, 10.0) == 1.0
    assert below.state_dict() == {"start": 128, "upper": 1024, "rule": "adascale", "lower": 16}
    assert default.state_dict() == {"start": 128, "upper": 1024, "rule": "adascale", "lower": 64}
    assert AdaptiveBatch(128, 1024, lower=128).state_dict() == {"start": 128, "upper": 1024, "rule": "adascale"}


@pytest.mark.parametrize("rule, expected", [("linear", 4.0), ("sqrt", 2.0), ("adascale", 4 * 116 / 164)])
def test_the_lr_factor_follows_the_rule(rule, expected):
    adaptive = AdaptiveBatch(16, 256, rule)
    assert adaptive.factor(64, 100.0) == pytest.approx(expected)
    assert adaptive.factor(16, 100.0) == pytest.approx(1.0)


def test_the_bounds_and_the_rule_are_checked():
    with pytest.raises(UserError, match="lr_scaling"):
        AdaptiveBatch(16, 256, "cubic")
    with pytest.raises(UserError, match="max_global_batch"):
        AdaptiveBatch(512, 256)
    with pytest.raises(UserError, match="min_global_batch"):
        AdaptiveBatch(128, 256, lower=256)
    with pytest.raises(UserError, match="global_batch_start"):
        AdaptiveBatch.of(512, 64, 0, "adascale")
    with pytest.raises(UserError, match="min_global_batch"):
        AdaptiveBatch.of(512, 0, 0, "adascale", 32)
    assert AdaptiveBatch.of(512, 0, 0, "adascale") is None
    assert AdaptiveBatch.of("auto", 0, 0, "adascale").state_dict() == {"start": 128, "upper": 4096, "rule": "adascale",
                                                                      "lower": 64}
    assert AdaptiveBatch.of("auto", 0, 0, "adascale", 32).state_dict()["lower"] == 32


def test_the_scaled_step_applies_lr_times_the_factor_and_puts_the_lr_back():
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(3)
    scaled_step(optimizer, 3.0)
    torch.testing.assert_close(p.detach(), torch.full((3,), -0.3))
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_the_schedule_advances_by_samples():
    # a fixed batch: one schedule step per training step, the partial last one included
    steps = 4                                                                     # 100 samples at B = 30
    done = np.cumsum([30, 30, 30, 10])
    assert [schedule.position(0, d, 100, steps) for d in done] == [1, 2, 3, 4]
    assert schedule.position(2, 0, 100, steps) == 8
    # four times the batch: four schedule steps per training step; an epoch is still `steps`
    assert schedule.position(1, 100, 100, steps) == 8
    assert schedule.position(1, 50, 100, steps) == 6


def test_a_scheduler_is_stepped_up_to_the_position():
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=8)
    optimizer.step()
    schedule.step_to(scheduler, 4)
    assert scheduler.last_epoch == 4 and optimizer.param_groups[0]["lr"] == pytest.approx(0.5)
    schedule.step_to(scheduler, 3)                                               # never back
    assert scheduler.last_epoch == 4


def test_auto_on_the_command_line_starts_at_the_start_and_refuses_what_does_not_fit():
    cfg = config.load(overrides={"global_batch": "auto"})
    assert cfg.global_batch_auto and cfg.global_batch == goodput.DEFAULT_START
    cfg = config.load(overrides={"global_batch": "AUTO", "global_batch_start": "64", "max_global_batch": "1024"})
    assert (cfg.global_batch, cfg.global_batch_start, cfg.max_global_batch) == (64, 64, 1024)
    assert config.from_dict(cfg.to_dict()) == cfg                                 # what a result file keeps
    for overrides, field in [({"global_batch": "256", "global_batch_start": "64"}, "global_batch_start"),
                             ({"max_global_batch": "64"}, "max_global_batch"),
                             ({"min_global_batch": "64"}, "min_global_batch"),
                             ({"global_batch": "auto", "min_global_batch": "256"}, "min_global_batch"),
                             ({"global_batch": "auto", "min_global_batch": "-1"}, "min_global_batch"),
                             ({"global_batch": "auto", "strategy": "asgd"}, "global_batch"),
                             ({"global_batch": "auto", "global_batch_start": "256", "max_global_batch": "64"},
                              "max_global_batch"),
                             ({"global_batch": "auto", "lr_scaling": "cubic"}, "lr_scaling")]:
        with pytest.raises(config.ConfigError, match=f"^{field}: "):
            config.load(overrides=overrides)


def test_the_command_line_adapts_the_batch_and_records_it(tmp_path):
    """2 ranks, a small network on random labels (a noise scale far above the start, a step
    costing about the same at any B): B grows after the first epoch; every full step of an
    epoch sums to its recorded B; the lr recorded is the scaled one; every record is in the
    schema; the cosine schedule ends at 0 although the steps per epoch changed."""
    import h5py

    from conftest import run_cli
    from dbs_mpi.training.results import SCHEMA_DATASETS
    out = tmp_path / "auto.h5"
    proc = run_cli(["train", "--global-batch", "auto", "--global-batch-start", "16", "--max-global-batch", "256",
                    "--model", "mlp", "--dataset", "synthetic", "--synthetic-samples", "1024", "--test-subset", "100",
                    "--epochs", "3", "--lr", "0.01", "--lr-schedule", "cosine", "--benchmark-steps", "2",
                    "--participation", "all", "--out", str(out)], ranks=2, timeout=240)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        epoch, steps = {k: f["epoch"][k][:] for k in f["epoch"]}, {k: f["step"][k][:] for k in f["step"]}
        datasets = []
        f.visititems(lambda name, obj: datasets.append(name) if isinstance(obj, h5py.Dataset) else None)
    assert set(datasets) <= set(SCHEMA_DATASETS)
    sizes = epoch["global_batch"]
    assert sizes[0] == 16 and sizes[1] > 16 and list(sizes[1:]) == list(epoch["next_global_batch"][:-1]), epoch
    for e, b in enumerate(sizes):
        sums = steps["batch_sizes"][steps["epoch"] == e].sum(axis=1)
        assert (sums[:-1] == b).all() and sums.sum() == 1024
    assert epoch["steps"][0] == 64 and epoch["steps"][1] < 64
    assert epoch["lr_factor"][1] > 1.0 and epoch["gain"][1] == pytest.approx(epoch["lr_factor"][1])
    assert epoch["lr"][-1] < 0.05 * 0.01 * epoch["lr_factor"][-1]   # cosine over the run's samples: near 0
    for e, b in enumerate(sizes):                                      # each step's gain and goodput at its B
        at, noise = steps["epoch"] == e, steps["noise_scale"][steps["epoch"] == e]
        known = np.isfinite(noise)
        assert known[:-1].all() if e else known.any()     # (a last step is heard next epoch; epoch 1 starts unknown)
        expected = [goodput.gain(int(b), n, 16) for n in noise[known]]
        np.testing.assert_allclose(steps["gain"][at][known], expected, rtol=1e-9)
        np.testing.assert_allclose(steps["goodput"][at][known], np.array(expected) / epoch["predicted_step"][e],
                                   rtol=1e-9)
