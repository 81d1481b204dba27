"""The experiment grid runner (dbs_mpi.tools.experiments): the grid file, the commands, and
a tiny grid on synthetic data at 1 and 2 ranks, run, resumed and re-run."""
import os
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest

from conftest import ROOT, mpiexec
from dbs_mpi.tools import analysis, experiments
from dbs_mpi.tools.config import Config, UserError
from dbs_mpi.training.results import STATUS_FAILED, RunWriter

TINY = """
[defaults]
dataset = "synthetic"
synthetic_samples = 256
model = "mlp"
global_batch = 64
epochs = 1
progress = false

[scale.small]
seeds = [0]
timeout = 120

[scale.paper]
seeds = [0, 1]
epochs = 3
timeout = 600

[[experiment]]
name = "one"
figures = ["fig-a"]
vary.strategy = ["ssgd", "dbs"]
paper.epochs = 4

[[experiment]]
name = "two"
figures = ["fig-a", "fig-b"]
speeds = [1.0, 0.5]
vary.aggregation = ["weighted", "mean"]
vary.speeds = [[1.0, 0.5], [1.0, 0.25]]
small = { seeds = [3], lr = 0.01 }
"""


def write_grid(tmp_path, text=TINY):
    path = tmp_path / "grid.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_grid_expands_cases_seeds_and_scales(tmp_path):
    grid = write_grid(tmp_path)
    small = experiments.load_grid(grid, "small")
    assert [r.name for r in small] == ["one-ssgd-s0", "one-dbs-s0", "two-weighted-1_0.5-s3", "two-weighted-1_0.25-s3",
                                       "two-mean-1_0.5-s3", "two-mean-1_0.25-s3"]
    one = small[0]
    assert one.ranks == 1 and one.timeout == 120 and one.figures == ("fig-a",) and one.case == "ssgd"
    assert one.options["strategy"] == "ssgd" and one.options["epochs"] == 1 and one.options["seed"] == 0
    assert "seeds" not in one.options and "timeout" not in one.options and "figures" not in one.options
    two = small[3]
    assert two.ranks == 2 and two.options["speeds"] == [1.0, 0.25] and two.options["lr"] == 0.01
    assert two.seed == 3 and two.experiment == "two" and two.case == "weighted-1_0.25"
    paper = experiments.load_grid(grid, "paper")
    assert len(paper) == 2 * len(small)
    # seed by seed, every case of a seed before the next (side by side: drift falls on every case)
    assert [r.name for r in paper[:4]] == ["one-ssgd-s0", "one-dbs-s0", "one-ssgd-s1", "one-dbs-s1"]
    assert {r.options["epochs"] for r in paper if r.experiment == "one"} == {4}    # experiment.paper wins
    assert {r.options["epochs"] for r in paper if r.experiment == "two"} == {3}    # scale.paper
    assert {r.seed for r in paper} == {0, 1} and paper[0].timeout == 600


def test_only_matches_experiment_figure_or_run(tmp_path):
    runs = experiments.load_grid(write_grid(tmp_path), "small")
    assert {r.experiment for r in runs if r.matches(["fig-b"])} == {"two"}
    assert len([r for r in runs if r.matches(["fig-a"])]) == 6
    assert [r.name for r in runs if r.matches(["one-dbs-s0"])] == ["one-dbs-s0"]
    assert all(r.matches([]) for r in runs)


@pytest.mark.parametrize("extra, message", [
    ('[[experiment]]\nname = "x"\nbogus_option = 3\n', "'bogus_option' is not a dbs-mpi train option"),
    ('[[experiment]]\nname = "x"\nlr = "fast"\n', "lr: expected a number"),
    ('[[experiment]]\nname = "x"\nspeeds = [1.0, 0.5]\nranks = 3\n', "speeds: has 2 values but there are 3 ranks"),
    ('[[experiment]]\nname = "x"\nstrategy = "asgd"\n', "needs at least 2 ranks"),
    ('[[experiment]]\nname = "x"\nout = "elsewhere.h5"\n', "'out' is not a dbs-mpi train option the grid may set"),
    ('[[experiment]]\nname = "one"\nvary.strategy = ["ssgd"]\n', "two runs are named 'one-ssgd-s0'"),
    ('[[experiment]]\nname = "x"\nvary.strategy = []\n', "vary must map option names to non-empty lists"),
    ('[[experiment]]\nfigures = []\n', "has no name"),
    ('[bogus]\n', "unknown top-level key 'bogus'"),
])
def test_grid_errors_name_the_experiment_and_field(tmp_path, extra, message):
    grid = write_grid(tmp_path, TINY + "\n" + extra)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        experiments.load_grid(grid, "small")


def test_unknown_scale_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="scale: must be one of small, paper"):
        experiments.load_grid(write_grid(tmp_path), "huge")
    with pytest.raises(UserError, match="no such file"):
        experiments.load_grid(tmp_path / "none.toml", "small")


def test_commands(tmp_path):
    runs = experiments.load_grid(write_grid(tmp_path), "small")
    cmd = experiments.train_command(runs[2], tmp_path / "r.h5", "mpiexec -x", data_dir="d")
    assert cmd[:4] == ["mpiexec", "-x", "-n", "2"]
    i = cmd.index("train")
    args = dict(zip(cmd[i + 1::2], cmd[i + 2::2]))
    assert args["--speeds"] == "1.0,0.5" and args["--aggregation"] == "weighted" and args["--progress"] == "false"
    assert args["--seed"] == "3" and args["--data-dir"] == "d" and args["--out"] == str(tmp_path / "r.h5")
    # what the command says is what dbs-mpi train parses
    from dbs_mpi.tools.cli import parse_train_args
    cfg = parse_train_args(cmd[i + 1:])
    assert cfg.speeds == (1.0, 0.5) and cfg.lr == 0.01 and cfg.seed == 3 and cfg.progress is False
    one = experiments.train_command(runs[0], tmp_path / "r.h5", "mpiexec")
    assert "-n" not in one[:3] and one[1] == "train"       # one rank: no launcher
    resume = experiments.resume_command(runs[2], tmp_path / "r.h5", "mpiexec")
    assert resume[-3:] == ["train", "--resume", str(tmp_path / "r.h5")]


def test_dry_run_decides_skip_resume_rerun(tmp_path):
    runs = experiments.load_grid(write_grid(tmp_path), "small")[:3]
    out = tmp_path / "out"
    out.mkdir()

    def make(name, status):
        w = RunWriter(out / f"{name}.h5", dict(config=Config().to_json(), strategy="dbs", world_size=1), 1)
        w.close(status)

    make(runs[0].name, "complete")
    make(runs[1].name, "interrupted")
    (out / f"{runs[1].name}.h5.ckpt").write_bytes(b"ckpt")
    make(runs[2].name, STATUS_FAILED)
    lines = []
    outcomes = experiments.run_grid(runs, out, "small", "mpiexec", dry_run=True, log=lines.append)
    assert outcomes == {runs[0].name: "skipped", runs[1].name: "would-resume", runs[2].name: "would-run"}
    assert "--resume" in lines[1] and "--resume" not in lines[2]
    assert (out / f"{runs[2].name}.h5").exists()          # a dry run removes nothing


def test_launch_stops_a_job_past_its_timeout(tmp_path):
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(3))\n"
              "time.sleep(60)\n")
    start = time.monotonic()
    code, timed_out = experiments.launch([sys.executable, "-c", script], tmp_path / "a.log", timeout=1.0, grace=30)
    assert timed_out and code == 3 and time.monotonic() - start < 20
    assert "stopped after the timeout of 1 s" in (tmp_path / "a.log").read_text()
    stubborn = "import signal, time\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\ntime.sleep(60)\n"
    code, timed_out = experiments.launch([sys.executable, "-c", stubborn], tmp_path / "b.log", timeout=1.0, grace=1.0)
    assert timed_out and code == -9
    code, timed_out = experiments.launch([sys.executable, "-c", "print('hi')"], tmp_path / "c.log", timeout=30)
    assert (code, timed_out) == (0, False) and "hi" in (tmp_path / "c.log").read_text()


@pytest.mark.timeout(600)
def test_tiny_grid_runs_then_skips_then_reruns_a_failed_run(tmp_path):
    grid = write_grid(tmp_path, TINY.replace('vary.speeds = [[1.0, 0.5], [1.0, 0.25]]', ''))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dbs_mpi.tools.experiments", "--grid", str(grid), "--out", str(out),
           "--mpiexec", mpiexec(), "--only", "one-ssgd-s0,two"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    names = ["one-ssgd-s0", "two-weighted-s3", "two-mean-s3"]
    assert "3 run(s): 3 complete" in first.stdout
    for name in names:
        path = out / f"{name}.h5"
        assert experiments.file_status(path) == "complete"
        assert not (out / f"{name}.h5.ckpt").exists()
        assert (out / "logs" / f"{name}.log").exists()
    with h5py.File(out / "two-mean-s3.h5", "r") as f:
        assert f.attrs["grid_experiment"] == "two" and f.attrs["grid_case"] == "mean"
        assert f.attrs["grid_scale"] == "small" and f.attrs["grid_figures"] == "fig-a,fig-b"
        assert f.attrs["world_size"] == 2 and f.attrs["aggregation"] == "mean"
    t = analysis.load(out)
    assert sorted(t.runs.run) == sorted(names)
    assert set(t.runs.experiment) == {"one", "two"} and (t.runs.seed[t.runs.experiment == "two"] == 3).all()

    # mark one run failed: the second pass skips the others and runs that one again
    with h5py.File(out / "two-mean-s3.h5", "a") as f:
        f.attrs["status"] = "failed"
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "3 run(s): 1 complete, 2 skipped" in second.stdout
    assert "removing the leftover file (status failed)" in second.stdout
    assert experiments.file_status(out / "two-mean-s3.h5") == "complete"


def test_cli_errors_and_list(tmp_path):
    grid = write_grid(tmp_path)
    base = [sys.executable, "-m", "dbs_mpi.tools.experiments", "--grid", str(grid), "--out", str(tmp_path / "o")]
    bad = subprocess.run(base + ["--only", "nothing"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "only: 'nothing' is no experiment, figure or run" in bad.stderr
    listed = subprocess.run(base + ["--list", "--only", "one"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 2 and "one-dbs-s0" in listed.stdout


def test_the_projects_grid_is_valid_at_both_scales():
    small = experiments.load_grid(ROOT / "jobs" / "experiments.toml", "small")
    paper = experiments.load_grid(ROOT / "jobs" / "experiments.toml", "paper")
    assert len(paper) > len(small) >= 20
    assert all(r.ranks in (2, 4, 8) for r in small)         # at most 4 ranks per core on the 2-core machine
    assert all(r.options.get("subset") for r in small) and not any(r.options.get("subset") for r in paper)
    figures = {f for r in small for f in r.figures}
    assert {"loss-time", "accuracy-epoch", "batch-vector", "utilisation", "aggregation", "speedup",
            "async-loss", "async-staleness", "dbs-sgd-study"} <= figures
    assert np.all([r.timeout > 0 for r in small])


def test_adaptive_targets_reads_the_committed_grid(tmp_path):
    """scripts/adaptive-targets.py on results/grid: both adaptive experiments, the three
    figures each, computed from the files (a seed that never reached counts as infinite);
    a folder without such runs is refused in one line."""
    script = [sys.executable, str(ROOT / "scripts" / "adaptive-targets.py")]
    proc = subprocess.run(script + [str(ROOT / "results" / "grid")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("adaptive: lenet5", "adaptive-bn: resnet20"):
        part = proc.stdout[proc.stdout.index(name):]
        assert "auto / 512:" in part and "auto / best (" in part and "points" in part
    empty = subprocess.run(script + [str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert empty.returncode != 0 and len(empty.stderr.strip().splitlines()) == 1, empty.stderr
