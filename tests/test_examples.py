"""The examples in examples/, run as a user runs them: under mpirun at 2 ranks.

* train_api.py: a user's model and Dataset through a DataLoader, AdamW, dbs;
* train_cli.sh: the same through `dbs-mpi train` and its plug-in options;
* train_resumable.py: a user loop stopped by SIGTERM and started again ends with the
  same model, bit for bit, as one never interrupted (ssgd).
Each launch is bounded in time, so a hang fails the test."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, mpiexec, read_line
from dbs_mpi.tools import analysis
from dbs_mpi.training import checkpoint
from dbs_mpi.training.results import read_run

EXAMPLES = ROOT / "examples"


def launch(args, ranks=2, **kw):
    return subprocess.Popen([mpiexec(), "-n", str(ranks), sys.executable, *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_api_example_trains_a_user_model_at_two_ranks(tmp_path):
    out = tmp_path / "api.h5"
    # Rank 1 at a tenth of rank 0's speed. The emulation stretches a rank's CPU time, not its
    # waits for a core, so a busy machine dilutes it: with three test suites on 2 cores, a
    # half-speed rank 1 once came out faster than rank 0 (vector [120, 136]), and a
    # quarter-speed one even at start-up ([126, 130]): the machine, not the example, was slower.
    code, stdout, err = finish(launch([EXAMPLES / "train_api.py", "--epochs", "2", "--speeds", "1,0.1",
                                       "--out", out]))
    assert code == 0, err
    assert stdout.count("epoch 2:") == 1 and f"results: {out}" in stdout          # rank 0 prints, once
    run = read_run(out)
    assert run["attrs"]["status"] == "complete" and run["attrs"]["world_size"] == 2
    assert run["config"]["speeds"] == "1,0.1" and run["config"]["workers"] == 2
    data = run["data"]
    assert data["epoch/test_accuracy"].shape == (2,)
    assert data["epoch/test_accuracy"][-1] > 0.25, "16 classes: chance is 6%, two epochs reach about 55%"
    b = data["epoch/batch_sizes"]
    assert (b.sum(axis=1) == 256).all() and (b[:, 0] > b[:, 1]).all(), "rank 1 is emulated at a tenth of the speed"
    assert data["startup/step_time"].shape == (2, 2)
    assert (data["epoch/data_time"] > 0).all() and (data["epoch/compute_time"] > 0).all()
    assert run["attrs"]["strategy"] == "dbs" and run["attrs"]["global_batch"] == 256
    tables = analysis.load(tmp_path)                   # the notebooks' reader takes a user's run too
    row = tables.runs.iloc[0]
    assert (row["strategy"], row["world_size"], row["epochs_done"]) == ("dbs", 2, 2)
    assert row["final_test_accuracy"] == pytest.approx(data["epoch/test_accuracy"][-1])
    assert len(tables.steps) == data["step/loss"].shape[0] and len(tables.epochs) == 2


def test_ddp_example_trains_with_uneven_local_batches(tmp_path):
    # A tenth of the speed, as in the API example's test: less can be lost in a busy machine's noise
    code, stdout, err = finish(launch([EXAMPLES / "train_ddp.py", "--epochs", "2", "--speeds", "1,0.1"]))
    assert code == 0, err
    lines = [line for line in stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"], stdout     # rank 0 prints, once
    accuracy = float(lines[-1].split("accuracy ")[1].split("%")[0])
    assert accuracy > 25, "16 classes: chance is 6%"
    batches = json.loads(lines[-1].split("local batches ")[1].split(" ->")[0])
    assert sum(batches) == 256 and batches[0] > batches[1], "rank 1 is emulated at a tenth of the speed"


def test_api_example_runs_as_one_process_without_mpirun(tmp_path):
    out = tmp_path / "one.h5"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_api.py"), "--epochs", "1", "--workers", "0",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    assert run["attrs"]["world_size"] == 1 and run["data"]["epoch/batch_sizes"].tolist() == [[256]]


def test_cli_plugin_example_trains_the_same_model(tmp_path):
    out = tmp_path / "cli.h5"
    proc = subprocess.run(["bash", str(EXAMPLES / "train_cli.sh"), str(out), "--epochs", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPIEXEC": mpiexec(), "DBS_MPI": str(ROOT / ".venv/bin/dbs-mpi")})
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    attrs = run["attrs"]
    assert attrs["status"] == "complete"
    assert attrs["model"].endswith("examples/my_project.py:SmallNet") and attrs["model_class"] == "my_project.SmallNet"
    assert attrs["dataset"].endswith("examples/my_project.py:Squares") and attrs["optimizer"] == "adamw"
    assert run["config"]["loader_workers"] == 2
    assert run["data"]["epoch/test_accuracy"][-1] > 0.25


def test_user_loop_stopped_by_sigterm_resumes_bit_for_bit(tmp_path):
    args = [EXAMPLES / "train_resumable.py", "--epochs", "3", "--samples", "4000", "--global-batch", "96",
            "--workers", "1"]
    whole = tmp_path / "whole.ckpt"
    code, _, err = finish(launch([*args, "--checkpoint", whole]))
    assert code == 0, err

    cut = tmp_path / "cut.ckpt"
    proc = launch([*args, "--checkpoint", cut])
    read_line(proc, "epoch 1:")
    time.sleep(0.1)                                   # into epoch 2 (42 steps)
    proc.send_signal(signal.SIGTERM)                  # mpirun forwards it to every rank
    code, out, err = finish(proc)
    assert code == checkpoint.EXIT_STOPPED, err
    assert "stopped at" in out
    stopped = checkpoint.load(cut)["sampler"]
    assert (stopped["epoch"], stopped["step"]) != (3, 0), "the run should have been stopped before its end"

    elsewhere = tmp_path / "elsewhere.ckpt"
    shutil.copy(cut, elsewhere)
    code, _, err = finish(launch([*args, "--checkpoint", cut]))
    assert code == 0, err
    a, b = checkpoint.load(whole), checkpoint.load(cut)
    assert b["sampler"] == a["sampler"] == {"epoch": 3, "step": 0, "seed": 0}
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for rank in range(2):
        assert a["per_rank"][rank]["balancer"]["next_epoch"] == b["per_rank"][rank]["balancer"]["next_epoch"] == 3

    code, _, err = finish(launch([*args, "--checkpoint", elsewhere], ranks=3))     # another allocation
    assert code == 0, err
    c = checkpoint.load(elsewhere)          # the same run on 3 ranks (its parameters: tests/test_api_mpi.py and
    assert c["sampler"] == a["sampler"] and len(c["per_rank"]) == 3     # test_checkpoint.py; at lr 0.05 and
    assert all(part["balancer"]["world_size"] == 3 for part in c["per_rank"])  # momentum 0.9, 2 and 3 ranks
    # uninterrupted already end far apart: 126 steps amplify the rounding of another summation order)


@pytest.mark.parametrize("ranks", [1, 2])
def test_examples_fail_cleanly_on_an_existing_result_file(tmp_path, ranks):
    out = tmp_path / "exists.h5"
    out.write_bytes(b"")
    start = time.monotonic()
    code, _, err = finish(launch([EXAMPLES / "train_api.py", "--epochs", "1", "--out", out], ranks=ranks))
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("dbs-mpi: error:")]
    assert len(errors) == 1 and "exists already" in errors[0], err
    assert "Traceback" not in err
    assert time.monotonic() - start < 60
