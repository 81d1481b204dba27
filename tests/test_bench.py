"""`dbs-mpi bench` reports: formatting and the final table on fake numbers, the ideal
epoch time, the HDF5 summary, and the rank requirements. No timing is asserted here:
speed targets belong to the benchmarks themselves."""
import json

import h5py
import numpy as np
import pytest

from dbs_mpi.tools import bench
from dbs_mpi.tools.config import UserError


def fake_reports():
    exchange = {"case": "exchange", "world_size": 2, "repeats": 2, "iterations": 10, "oversubscribed": False,
                "models": {"lenet5": {"bytes": 246828,
                                      "times": {"framework": [5.5e-5, 5.7e-5], "raw": [5e-5, 5e-5]},
                                      "ratio": [1.1, 1.14]}}}
    exchange["checks"] = [bench.check("lenet5 exchange / raw Allreduce", 1.12, 1.10, "<=")]
    ddp = {"case": "ddp", "world_size": 2, "repeats": 2, "model": "lenet5", "local_batch": 64, "steps": 10,
           "threads": 1, "oversubscribed": False, "throughput": {"dbs-mpi": [12000.0, 12500.0],
                                                                 "ddp": [11000.0, 11600.0]},
           "ratio": [1.09, 1.08], "checks": [bench.check("dbs-mpi / DDP", 1.085, 1.0, ">=")]}
    part = {"compute": 3.9, "comm": 0.1, "update_data": 0.2, "ideal": 4.2}
    hetero = {"case": "hetero", "world_size": 2, "speeds": [1.0, 0.25], "global_batch": 512, "repeats": 2,
              "oversubscribed": True, "times": {"ssgd": [11.0, 11.2], "dbs": [4.5, 4.6]},
              "batch_sizes": {"ssgd": [256, 256], "dbs": [412, 100]}, "ideal": 2.5,
              "ideal_time": {"ssgd": [4.3, 4.3], "dbs": [4.2, 4.2]}, "ideal_parts": {"ssgd": [part], "dbs": [part]},
              "ratios": {"dbs": [2.44, 2.43]}, "median_ratio": {"dbs": 2.435},
              "to_ideal": {"ssgd": [2.6, 2.6], "dbs": [1.07, 1.09]},
              "test_accuracy": {"ssgd": [0.801, 0.803], "dbs": [0.79, 0.75]},
              "checks": [bench.check("ssgd/dbs / ideal", 0.97, 0.9, ">="), bench.check("dbs / ideal", 1.08, 1.1)]}
    overhead = {"case": "overhead", "world_size": 1, "repeats": 2, "model": "lenet5", "local_batch": 64, "steps": 10,
                "threads": 1, "times": {"dbs-mpi": [1.02, 1.03], "plain": [1.0, 1.0]}, "ratio": [1.02, 1.03],
                "overhead_per_step": [2e-4, 3e-4], "checks": [bench.check("1 rank / plain", 1.025, 1.05)]}
    scaling = {"case": "scaling", "sizes": [1, 2, 4], "repeats": 2, "model": "lenet5", "local_batch": 64, "steps": 10,
               "threads": 1, "cores": 2, "throughput": {"1": [9000.0, 9100.0], "2": [17000.0, 17500.0],
                                                        "4": [8000.0, 8100.0]},
               "speedup": {"1": [1.0, 1.0], "2": [1.89, 1.92], "4": [0.89, 0.89]},
               "oversubscribed_at": {"1": False, "2": False, "4": True}, "oversubscribed": True,
               "checks": [bench.check("throughput 2 / 1", 1.9, None), bench.check("throughput 4 / 1", 0.89, None)]}
    overlap = {"case": "overlap", "world_size": 2, "repeats": 2, "steps": 10, "local_batch": 64, "bucket_kb": 64,
               "first_bucket_kb": 16, "oversubscribed": False,
               "models": {"mlp": {"times": {"one bucket": [2e-3, 2e-3], "buckets, overlap": [2.1e-3, 2.2e-3]},
                                  "buckets": {"one bucket": 1, "buckets, overlap": 2}, "ratio": [0.95, 0.91]}},
               "checks": [bench.check("mlp one bucket / overlapped", 0.93, None)]}
    wait = {"case": "wait", "world_size": 4, "cores": 2, "speeds": [1, 0.25, 0.25, 0.25], "global_batch": 512,
            "repeats": 2, "oversubscribed": True, "times": {"ssgd": {"spin": [1.5, 1.6], "sleep": [1.1, 1.2]}},
            "ratios": {"ssgd": [1.36, 1.33]}, "checks": [bench.check("ssgd spin / sleep", 1.345, None)]}
    batchnorm = {"case": "batchnorm", "world_size": 2, "repeats": 2, "steps": 20, "local_batch": 64, "threads": 1,
                 "oversubscribed": False,
                 "times": {"group": [0.20, 0.22], "batch": [0.18, 0.18], "batch, sync": [0.19, 0.21]},
                 "ratio": {"group": [1.0, 1.0], "batch": [0.9, 0.82], "batch, sync": [0.95, 0.955]},
                 "parts": {v: {"sync": [0.0, 0.0] if v != "batch, sync" else [0.004, 0.006], "exposed": [0.001, 0.001]}
                           for v in ("group", "batch", "batch, sync")},
                 "checks": [bench.check("resnet20 step, batch sync / batch", 1.11, None)]}
    return [exchange, ddp, hetero, overhead, scaling, overlap, wait, batchnorm]


def test_check_verdicts():
    assert bench.check("x", 1.2, 1.1, "<=")["met"] is False
    assert bench.check("x", 1.0, 1.1, "<=")["met"] is True
    assert bench.check("x", 0.9, 1.0, ">=")["met"] is False
    assert bench.check("x", 1.0, 1.0, ">=")["met"] is True
    assert bench.check("x", 3.0, None)["met"] is None


@pytest.mark.parametrize("report", fake_reports(), ids=lambda r: r["case"])
def test_every_case_formats_its_numbers(report):
    text = bench.FORMATTERS[report["case"]](report)
    assert text.startswith(f"bench {report['case']}")
    assert ("OVERSUBSCRIBED" in text or "oversubscribed" in text) == bool(report.get("oversubscribed"))
    if report["case"] == "hetero":
        assert "ssgd/dbs epoch-time ratio: median 2.435" in text and "0.97 of ideal" in text
        assert "dbs epoch time / ideal" in text and "median 1.080" in text
        assert "test acc" in text and "0.802" in text and "0.770" in text     # medians of the accuracies
    if report["case"] == "ddp":
        assert "12250" in text and "11300" in text          # medians of the two throughputs
    if report["case"] == "batchnorm":
        assert "batch, sync" in text and "200.0" in text and "0.952" in text and "5.00" in text   # medians
    if report["case"] == "scaling":
        assert "1.90" in text and "[oversubscribed]" in text.splitlines()[-1]


def test_the_table_has_one_line_per_check_with_its_verdict():
    reports = fake_reports()
    lines = bench.format_table(reports).splitlines()
    assert len(lines) == 1 + sum(len(r["checks"]) for r in reports)
    verdicts = [line.split()[-1] for line in lines[1:]]
    assert verdicts[:5] == ["MISSED", "met", "met", "met", "met"]
    assert verdicts.count("info") == 5
    assert "<= 1.10" in lines[1] and ">= 1.00" in lines[2]


def test_summary_file(tmp_path):
    path = tmp_path / "bench" / "summary.h5"
    reports = fake_reports()
    bench.write_report(reports, path, {"command": "dbs-mpi bench all", "world_size": 4})
    with h5py.File(path, "r") as f:
        assert f.attrs["command"] == "dbs-mpi bench all"
        assert set(f) == {r["case"] for r in reports}
        assert json.loads(f["hetero"].attrs["report"])["speeds"] == [1.0, 0.25]
        np.testing.assert_allclose(f["hetero/times/dbs"][()], [4.5, 4.6])
        np.testing.assert_allclose(f["exchange/check_value"][()], [1.12])


def test_ideal_epoch_time():
    # 1000 samples, B = 100, vector [80, 20]: rank 0 computes 800 samples, rank 1 200
    record = {"batch_sizes": np.array([80, 20]), "speed": np.array([800.0, 200.0]),
              "compute_time": np.array([1.1, 1.2]), "comm_time": np.array([0.3, 0.1]),
              "data_time": np.array([0.05, 0.05])}
    part = bench.ideal_epoch_time(record, 1000, 100)
    assert part["compute"] == pytest.approx(1000 / 1000.0)
    assert part["comm"] == pytest.approx(0.2)
    assert part["update_data"] == pytest.approx(((1.1 - 1.0) + (1.2 - 1.0)) / 2 + 0.05)
    assert part["ideal"] == pytest.approx(part["compute"] + part["comm"] + part["update_data"])


def test_rank_requirements_are_checked_before_anything_runs():
    with pytest.raises(UserError, match="needs 2 ranks"):
        bench._setup(["ddp"], 1)
    with pytest.raises(UserError, match="needs 3 ranks"):
        bench._setup(["hetero", "--speeds", "1,0.5,0.2"], 2)
    args = bench._setup(["all"], 4)
    assert args.subset == bench.ALL_DEFAULTS["subset"]
    assert bench._setup(["overhead"], 1).case == "overhead"
    with pytest.raises(UserError):
        bench._setup(["nonsense"], 4)


@pytest.mark.parametrize("argv, field", [
    (["hetero", "--speeds", "x"], "speeds"),                 # (a traceback from float())
    (["scaling", "--sizes", "a"], "sizes"),                  # (a traceback from int())
    (["overhead", "--model", "foo"], "model"),               # (refused inside the case: exit 1)
    (["hetero", "--strategies", "ssgd,turbo"], "strategies"),
    (["exchange", "--models", "lenet5,foo"], "models"),
    (["overhead", "--steps", "0"], "steps"),
    (["wait", "--wait-speeds", "1,0"], "wait-speeds"),
    (["overhead", "--repeats", "-1"], "repeats"),
])
def test_bad_values_are_refused_before_any_case_runs(argv, field):
    with pytest.raises(UserError, match=f"^{field}: "):
        bench._setup(argv, 4)


def fake_tracking_run(follow, give_back, slowed=100, steps=120, start=30, stop=90, seconds=(0.02, 0.05)):
    """A 2-rank run's step record: rank 1 at 256 until `follow` steps after start, then
    `slowed` until `give_back` steps after stop."""
    batches = np.tile([256, 256], (steps, 1))
    moved = slice(start + follow, stop + give_back)
    batches[moved] = [512 - slowed, slowed]
    seconds_per_step = np.full(steps, seconds[0])
    seconds_per_step[start:stop] = seconds[1]
    compute = np.column_stack([batches[:, 0] * 1e-4, batches[:, 1] * np.where(
        (np.arange(steps) >= start) & (np.arange(steps) < stop), 4e-4, 1e-4)])
    return {"batches": batches, "seconds": seconds_per_step, "compute": compute}


def test_tracking_figures_from_step_records():
    from dbs_mpi.tools import bench_tracking as tracking
    run = fake_tracking_run(follow=4, give_back=5)
    m = tracking.run_metrics(run, 30, 90, share=0.2)
    assert (m["follow"], m["give_back"]) == (4, 5)
    assert m["stretch_seconds"] == pytest.approx(60 * 0.05)
    assert m["after"] == pytest.approx(1.0) and m["moves"] == 0 and m["moved_per_step"] == 0.0
    never = tracking.run_metrics(fake_tracking_run(follow=200, give_back=0), 30, 90, share=0.2)
    assert never["follow"] is None and tracking.median_of([None, 3, 4]) == 4.0
    np.testing.assert_allclose(tracking.measured_speeds(run, 30, 90), [10000, 2500])
    runs = {"ssgd": [fake_tracking_run(200, 0, seconds=(0.02, 0.1))], "dbs": [run], "dbs-epoch": [run]}
    summary = tracking.summarize(runs, 30, 90, factor=4.0)
    assert summary["ideal"] == pytest.approx(0.4) and summary["share"] == pytest.approx(0.2)
    assert summary["stretch_ratio"]["dbs"] == [pytest.approx(0.5)]
    measured = tracking.summarize(runs, 30, 90, factor=None)      # the speeds ssgd measured: 1 : 0.25
    assert measured["ideal"] == pytest.approx(0.4)


def test_tracking_report_formats_and_checks():
    from dbs_mpi.tools import bench_tracking as tracking
    runs = {"ssgd": [fake_tracking_run(200, 0, seconds=(0.02, 0.1))] * 2,
            "dbs": [fake_tracking_run(4, 5)] * 2, "dbs-epoch": [fake_tracking_run(10, 30)] * 2}
    summary = tracking.summarize(runs, 30, 90, factor=4.0)
    report = {"case": "tracking", "world_size": 2, "global_batch": 512, "repeats": 2, "steps": [30, 90],
              "factor": 4.0, "epochs": 3, "steps_per_epoch": 40, "oversubscribed": False,
              "scenarios": {"emulated": summary}, "checks": bench._tracking_checks("emulated", summary)}
    text = bench.format_tracking(report)
    assert text.startswith("bench tracking") and "ideal stretch ratio min(v)/mean(v) = 0.400" in text
    assert [c["met"] for c in report["checks"]][:4] == [True, True, True, True]
    with pytest.raises(UserError, match="tracking-steps"):
        bench._setup(["tracking", "--tracking-steps", "5,90"], 2)
    with pytest.raises(UserError, match="scenarios"):
        bench._setup(["tracking", "--scenarios", "emulated,storm"], 2)


def test_steady_scenario_counts_the_vector_s_changes():
    from dbs_mpi.tools import bench_tracking as tracking
    still = {"batches": np.tile([341, 171], (100, 1)), "seconds": np.full(100, 0.03),
             "compute": np.full((100, 2), 0.02)}
    moving = dict(still, batches=still["batches"].copy())
    moving["batches"][50:] = [331, 181]
    moving["batches"][-1] = [20, 12]                                   # an epoch's partial last step
    steady = tracking.summarize_steady({"ssgd": [still], "dbs": [moving]})
    assert steady["share"] == pytest.approx(1 / 3)
    assert steady["metrics"]["ssgd"][0]["moves"] == 0
    d = steady["metrics"]["dbs"][0]
    assert d["moves"] == 1 and d["moved_per_step"] == pytest.approx(10 / 512 / 88)
    assert (d["low"], d["high"]) == (171, 181)
    report = {"case": "tracking", "world_size": 2, "global_batch": 512, "repeats": 1, "steps": [30, 90],
              "factor": 4.0, "epochs": 10, "steps_per_epoch": 118, "oversubscribed": False, "scenarios": {},
              "steady": steady, "checks": bench._steady_checks(steady)}
    text = bench.format_tracking(report)
    assert "1 changes in 90 steps" in text and "b_1 171..181" in text
