"""dbs_mpi.tools.analysis on small result files written here with RunWriter. No MPI."""
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dbs_mpi.tools import analysis
from dbs_mpi.tools.config import Config
from dbs_mpi.training.results import STATUS_COMPLETE, STATUS_FAILED, RunWriter


def write_sync(path, strategy="dbs", speeds=(1.0, 0.25), seed=0, durations=(2.0, 1.0, 1.5), steps=4,
               status=STATUS_COMPLETE, aggregation="weighted", extra_attrs=None):
    cfg = Config(strategy=strategy, speeds=speeds, seed=seed, epochs=len(durations), aggregation=aggregation)
    ranks = len(speeds)
    w = RunWriter(path, dict(config=cfg.to_json(), strategy=strategy, aggregation=aggregation, dataset="synthetic",
                             model="lenet5", world_size=ranks, hostnames=["h"] * ranks, oversubscribed=False,
                             **(extra_attrs or {})), ranks)
    w.write("startup/batch_sizes", np.full(ranks, 512 // ranks))
    for e, d in enumerate(durations):
        compute = np.arange(1, ranks + 1, dtype=float) * d / (2 * ranks)
        w.append_epoch(
            dict(train_loss=1.0 / (e + 1), test_loss=1.2 / (e + 1), test_accuracy=0.5 + 0.1 * e, duration=d,
                 eval_time=0.1, batch_sizes=np.array([400, 112][:ranks] if ranks == 2 else [512 // ranks] * ranks),
                 compute_time=compute, comm_time=np.full(ranks, 0.1 * d), wait_time=d - compute - 0.1 * d,
                 data_time=np.zeros(ranks), speed=np.full(ranks, 100.0), steps=np.int64(steps)),
            dict(loss=np.linspace(2, 1, steps) / (e + 1), epoch=np.full(steps, e, dtype=np.int64),
                 compute_time=np.full((steps, ranks), 0.1), comm_time=np.full((steps, ranks), 0.01),
                 wait_time=np.tile(np.arange(1, steps + 1)[:, None] * 0.01, (1, ranks))))
    w.close(status)


def write_async(path, strategy="asgd", speeds=(1.0, 1.0, 0.5), updates=10):
    cfg = Config(strategy=strategy, speeds=speeds, epochs=1)
    ranks = len(speeds)
    w = RunWriter(path, dict(config=cfg.to_json(), strategy=strategy, aggregation="weighted", world_size=ranks,
                             hostnames=["h"] * ranks), ranks)
    w.append_epoch(dict(train_loss=1.5, test_loss=1.4, test_accuracy=0.6, duration=3.0, eval_time=0.2,
                        batch_sizes=np.array([0] + [100] * (ranks - 1)), compute_time=np.array([0.0] + [2.5] * (ranks - 1)),
                        comm_time=np.full(ranks, 0.1), wait_time=np.array([2.9] + [0.4] * (ranks - 1)),
                        data_time=np.zeros(ranks), speed=np.zeros(ranks), staleness_mean=1.0, updates=np.int64(updates)),
                   {})
    rows = dict(staleness=np.arange(updates) % 3, worker=1 + np.arange(updates) % (ranks - 1),
                time=np.linspace(0.1, 3.0, updates), local_batch=np.full(updates, 100), loss=np.linspace(2, 1, updates),
                epoch=np.zeros(updates, dtype=np.int64))
    for name, value in rows.items():
        w.write(f"update/{name}", value)
    w.set_attrs(staleness_mean=float(rows["staleness"].mean()), updates=updates)
    w.close(STATUS_COMPLETE)


@pytest.fixture
def folder(tmp_path):
    write_sync(tmp_path / "hetero-ssgd-s0.h5", strategy="ssgd", durations=(4.0, 4.0, 4.2))
    write_sync(tmp_path / "hetero-dbs-s0.h5", strategy="dbs", durations=(3.0, 1.6, 1.8))
    (tmp_path / "sub").mkdir()
    write_async(tmp_path / "sub" / "async-asgd-s0.h5")
    write_sync(tmp_path / "broken-s0.h5", status=STATUS_FAILED)
    (tmp_path / "not-hdf5.h5").write_bytes(b"garbage")
    return tmp_path


def test_runs_table_has_config_columns_and_summaries(folder):
    with pytest.warns(UserWarning, match="not-hdf5"):
        t = analysis.load(folder)
    runs = t.runs.set_index("run")
    assert sorted(runs.index) == ["hetero-dbs-s0", "hetero-ssgd-s0", "sub/async-asgd-s0"]  # failed one left out
    dbs = runs.loc["hetero-dbs-s0"]
    assert dbs.strategy == "dbs" and dbs.aggregation == "weighted" and dbs.seed == 0
    assert dbs.speeds == (1.0, 0.25) and dbs.global_batch == 512 and dbs.world_size == 2
    assert dbs.heterogeneity == pytest.approx((1 + 0.25) / 2 / 0.25)
    assert dbs.epochs_done == 3 and dbs.train_time == pytest.approx(6.4)
    assert dbs.steady_epoch_time == pytest.approx(1.7)
    assert dbs.final_test_accuracy == pytest.approx(0.7) and dbs.best_test_accuracy == pytest.approx(0.7)
    assert dbs.final_train_loss == pytest.approx(1 / 3)
    assert not dbs.asynchronous and runs.loc["sub/async-asgd-s0"].asynchronous
    # the server's speed does not count: workers 1.0 and 0.5
    assert runs.loc["sub/async-asgd-s0"].heterogeneity == pytest.approx(0.75 / 0.5)


def test_failed_runs_only_when_asked(folder):
    with pytest.warns(UserWarning):
        t = analysis.load(folder, statuses=None)
    assert "broken-s0" in set(t.runs.run)
    assert t.runs.set_index("run").loc["broken-s0", "status"] == "failed"
    with pytest.raises(OSError):
        analysis.load(folder, strict=True)


def test_epoch_table_wall_time_is_cumulative_training_time(folder):
    with pytest.warns(UserWarning):
        t = analysis.load(folder)
    e = t.epochs[t.epochs.run == "hetero-dbs-s0"].sort_values("epoch")
    assert e.epoch.tolist() == [0, 1, 2]
    np.testing.assert_allclose(e.wall_time, [3.0, 4.6, 6.4])
    np.testing.assert_allclose(e.wall_time_start, [0.0, 3.0, 4.6])
    np.testing.assert_allclose(e.test_accuracy, [0.5, 0.6, 0.7])
    assert (e.strategy == "dbs").all() and "experiment" in e
    a = t.epochs[t.epochs.run == "sub/async-asgd-s0"]
    assert a.staleness_mean.tolist() == [1.0] and a.updates.tolist() == [10]


def test_rank_table_one_row_per_run_epoch_rank(folder):
    with pytest.warns(UserWarning):
        t = analysis.load(folder)
    r = t.ranks[t.ranks.run == "hetero-dbs-s0"]
    assert len(r) == 3 * 2 and set(r["rank"]) == {0, 1}
    assert r[(r.epoch == 1) & (r["rank"] == 0)].batch_size.item() == 400
    # compute + comm + wait = the epoch's duration in the files written above
    np.testing.assert_allclose(r.groupby("epoch").busy_time.first(), [3.0, 1.6, 1.8])
    assert len(t.ranks[t.ranks.run == "sub/async-asgd-s0"]) == 3


def test_step_wall_time_spreads_each_epoch_over_its_steps(folder):
    with pytest.warns(UserWarning):
        t = analysis.load(folder)
    s = t.steps[t.steps.run == "hetero-dbs-s0"].sort_values("step")
    assert len(s) == 12 and s.step_in_epoch.tolist() == [0, 1, 2, 3] * 3
    ends = s.groupby("epoch").wall_time.max()
    np.testing.assert_allclose(ends, [3.0, 4.6, 6.4])
    assert (np.diff(s.wall_time) > 0).all()
    # later steps waited longer in these files, so they take a larger share of the epoch
    first = s[s.epoch == 0]
    gaps = np.diff(np.concatenate([[0.0], first.wall_time]))
    assert (np.diff(gaps) > 0).all()
    assert t.steps[t.steps.run == "sub/async-asgd-s0"].empty


def test_update_table_for_async_runs(folder):
    with pytest.warns(UserWarning):
        t = analysis.load(folder)
    u = t.updates
    assert set(u.run) == {"sub/async-asgd-s0"} and len(u) == 10
    assert u.staleness.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert set(u.worker) == {1, 2} and (u.strategy == "asgd").all()
    np.testing.assert_allclose(u.wall_time, np.linspace(0.1, 3.0, 10))


def test_utilisation_shares_sum_to_one(folder):
    with pytest.warns(UserWarning):
        t = analysis.load(folder)
    share = analysis.utilisation(t)
    assert set(share.strategy) == {"ssgd", "dbs", "asgd"}
    np.testing.assert_allclose(share[["compute", "comm", "wait", "data"]].sum(axis=1), 1.0)
    server = share[(share.strategy == "asgd") & (share["rank"] == 0)]
    assert server.wait.item() == pytest.approx(2.9 / 3.0)


def test_speedup_pairs_runs_that_differ_only_in_strategy(folder):
    with pytest.warns(UserWarning):
        t = analysis.load(folder)
    sp = analysis.speedup(t, group=("speeds", "seed"))
    assert len(sp) == 1
    row = sp.iloc[0]
    assert row.speedup == pytest.approx(np.median([4.0, 4.2]) / np.median([1.6, 1.8]))
    assert row.proportional_ideal == pytest.approx(2.5)
    # the ideal from the ranks' records: both runs at (400, 112) samples and 100 samples/s,
    # 4.0 s and 1.12 s per step; balanced at 0.01 s per sample each: 256 samples, 2.56 s
    assert row.ideal == pytest.approx(4.0 / 2.56) and row.fraction_of_ideal == pytest.approx(row.speedup / row.ideal)


def test_empty_folder_gives_empty_tables(tmp_path):
    t = analysis.load(tmp_path)
    for df in (t.runs, t.epochs, t.ranks, t.steps, t.updates):
        assert isinstance(df, pd.DataFrame) and df.empty and "run" in df


def test_running_file_is_readable_while_written(tmp_path):
    path = tmp_path / "live.h5"
    w = RunWriter(path, dict(config=Config(speeds=(1.0, 0.5)).to_json(), strategy="dbs", world_size=2), 2)
    w.append_epoch(dict(train_loss=1.0, duration=2.0, batch_sizes=np.array([300, 212])), {})
    t = analysis.load(tmp_path, statuses=("running",))
    assert t.runs.status.tolist() == ["running"] and t.epochs.wall_time.tolist() == [2.0]
    w.close(STATUS_COMPLETE)


def test_ideal_speedup_and_smooth():
    assert analysis.ideal_speedup([1, 0.5, 0.25, 0.25]) == pytest.approx(2.0)
    assert analysis.ideal_speedup([1, 1]) == 1.0
    assert analysis.ideal_speedup([1, 1, 0.5], skip_server=True) == pytest.approx(1.5)
    np.testing.assert_allclose(analysis.smooth([0, 3, 0, 3], 3), [1.5, 1, 2, 1.5])


def test_disturbances_replay_the_emulator():
    from dbs_mpi.planning.heterogeneity import Emulator
    run = dict(seed=4, world_size=3, epochs=12, slow_rank=1, slow_factor=3.0, slow_epochs=(2, 5), sleep_prob=0.3,
               sleep_seconds=(1.0, 2.0), sleep_epochs=(2, 3))
    d = analysis.disturbances(run)
    assert len(d) == 3 * 12
    slowed = d[d.slow_factor > 1]
    assert set(slowed["rank"]) == {1} and sorted(slowed.epoch) == [2, 3, 4] and (slowed.slow_factor == 3.0).all()
    for rank in range(3):    # the same draws as the emulator in a run
        em = Emulator(rank, 1.0, seed=4, sleep_prob=0.3, sleep_seconds=(1.0, 2.0), sleep_epochs=(2, 3))
        expected = []
        for e in range(12):
            em.start_epoch(e, 7)
            expected.append(em.epoch_sleep)
        np.testing.assert_allclose(d[d["rank"] == rank].extra_sleep, expected)
    assert (d.extra_sleep > 0).any() and ((d.extra_sleep == 0) | (d.extra_sleep >= 1.0)).all()
    quiet = analysis.disturbances(dict(seed=0, world_size=2, epochs=3))
    assert (quiet.slow_factor == 1).all() and (quiet.extra_sleep == 0).all()


def test_figure_files_are_reproducible(tmp_path, monkeypatch):
    """The same figure saved twice gives the same bytes (no creation date, no software
    version), so `make figures` on unchanged results leaves the tree clean."""
    import importlib
    import sys
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "analysis"))
    import matplotlib.pyplot as plt
    digests = []
    for run in range(2):
        monkeypatch.setenv("DBS_MPI_FIGURES", str(tmp_path / f"run{run}"))
        sys.modules.pop("figlib", None)
        figlib = importlib.import_module("figlib")
        fig, ax = plt.subplots()
        ax.plot([0, 1, 2], [1, 0.5, 0.2], label="loss")
        ax.legend()
        figlib.save(fig, "probe", "A caption.")
        plt.close(fig)
        digests.append({ext: (tmp_path / f"run{run}" / f"probe.{ext}").read_bytes() for ext in ("png", "pdf", "md")})
        time.sleep(1.1)                 # a timestamp, if any, would differ
    for ext in ("png", "pdf", "md"):
        assert digests[0][ext] == digests[1][ext], ext
    assert b"CreationDate" not in digests[0]["pdf"]
    sys.modules.pop("figlib", None)


def test_measured_ideal_speedup_from_step_times():
    """Two ranks, t_0(b) = 0.01 + 0.001 b, t_1(b) = 0.01 + 0.004 b (a fixed cost of 10 ms
    and a 4x slower rank), B = 100. Equal split, measured: t(50) = (0.06, 0.21). The
    strategy's run at (70, 30): (0.08, 0.13); through the two points per rank the model is
    exact, and the best split equalises b_0 - 4 b_1 = 0 with b_0 + b_1 = 100: (80, 20),
    0.09 s. Ideal 0.21 / 0.09 = 2.33, below the proportional mean(v)/min(v) = 2.5, which
    ignores the fixed cost."""
    t = lambda a, p, b: a + p * b  # noqa: E731
    ideal = analysis.measured_ideal_speedup([50, 50], [t(0.01, 0.001, 50), t(0.01, 0.004, 50)], [70, 30],
                                            [t(0.01, 0.001, 70), t(0.01, 0.004, 30)], 100)
    assert ideal == pytest.approx(0.21 / 0.09, rel=1e-6)
    assert ideal < analysis.ideal_speedup([1, 0.25])
    # equal speeds, batches barely moved: proportional per rank, ideal about 1
    assert analysis.measured_ideal_speedup([50, 50], [0.06, 0.06], [51, 49], [0.061, 0.059], 100) == \
        pytest.approx(1.0, abs=0.02)


def test_vectors_and_replans_show_changes_within_epochs(tmp_path):
    cfg = Config(strategy="dbs", speeds=(1.0, 1.0), epochs=2)
    w = RunWriter(tmp_path / "within.h5", dict(config=cfg.to_json(), strategy="dbs", world_size=2,
                                               hostnames=["h", "h"]), 2)
    tables = [np.array([[256, 256], [256, 256], [400, 112], [400, 112]]), np.array([[400, 112]] * 3 + [[100, 28]])]
    for e, table in enumerate(tables):
        steps = len(table)
        replans = {} if e else dict(epoch=np.array([0]), step=np.array([2]), run_step=np.array([2]),
                                    decided=np.array([0]), batch_sizes=np.array([[400, 112]]),
                                    per_sample=np.array([[1e-4, 4e-4]]), overhead=np.zeros((1, 2)),
                                    predicted_before=np.array([0.1]), predicted_after=np.array([0.05]),
                                    changed=np.array([[False, True]]))
        w.append_epoch(dict(duration=1.0, batch_sizes=table[-2], rank_samples=table.sum(axis=0), steps=np.int64(steps)),
                       dict(loss=np.ones(steps), epoch=np.full(steps, e), batch_sizes=table,
                            compute_time=np.full((steps, 2), 0.1)), replans)
    w.close(STATUS_COMPLETE)
    write_sync(tmp_path / "legacy.h5", strategy="dbs", speeds=(1.0, 0.25))
    t = analysis.load(tmp_path)
    runs = t.runs.set_index("run")
    assert runs.loc["within"].variant == "dbs" and runs.loc["within"].dbs_interval == "1"
    v = t.vectors[t.vectors.run == "within"].pivot(index="step", columns="rank", values="batch_size")
    assert v.values.tolist() == np.concatenate(tables).tolist()
    assert t.vectors[t.vectors.run == "within"].step_in_epoch.max() == 3
    r = t.replans
    assert r.run.tolist() == ["within"] and r.step.tolist() == [2] and r.batch_sizes.tolist() == [(400, 112)]
    assert r.changed_ranks.tolist() == [(1,)] and r.variant.tolist() == ["dbs"]
    legacy = t.vectors[t.vectors.run == "legacy"]           # no step/batch_sizes: the epoch's vector
    assert set(legacy.batch_size) == {400, 112} and len(legacy) == 3 * 4 * 2
