"""Fail loudly, lose nothing: stop requests, checkpoints, resume, crashes.
Each launch under mpirun is bounded in time, so a hang fails the test."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import ROOT, dbs_mpi_cmd, mpiexec, run_cli
from dbs_mpi import checkpoint
from dbs_mpi.results import read_run

RUN = ["--dataset", "synthetic", "--synthetic-samples", "12000", "--test-subset", "200", "--epochs", "2",
       "--global-batch", "64", "--strategy", "ssgd", "--benchmark-steps", "1", "--benchmark-warmup", "0"]


def launch(args, ranks):
    cmd = [mpiexec(), "-n", str(ranks)] + dbs_mpi_cmd() + ["train", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def wait_for(path, proc, seconds=60):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def model_of(ckpt):
    return checkpoint.load(ckpt)["model"]


@pytest.mark.parametrize("ranks, sig", [(2, signal.SIGUSR1), (4, signal.SIGTERM)])
def test_stop_checkpoint_resume_is_bit_identical(tmp_path, ranks, sig):
    whole = tmp_path / "whole.h5"
    proc = run_cli(["train", *RUN, "--out", str(whole)], ranks=ranks, timeout=240)
    assert proc.returncode == 0, proc.stderr

    cut = tmp_path / "cut.h5"
    proc = launch([*RUN, "--out", str(cut)], ranks)
    wait_for(cut, proc)
    time.sleep(1.0)
    proc.send_signal(sig)                      # mpirun forwards it to every rank
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == checkpoint.EXIT_STOPPED, err
    assert "stop requested" in out
    state = checkpoint.load(str(cut) + ".ckpt")
    assert (state["epoch"], state["step"]) != (2, 0)
    assert read_run(cut)["attrs"]["status"] == "interrupted"

    proc = run_cli(["train", "--resume", str(cut)], ranks=ranks, timeout=240)
    assert proc.returncode == 0, proc.stderr
    a, b = read_run(whole), read_run(cut)
    assert b["attrs"]["status"] == "complete" and len(b["attrs"]["resumed"]) == 1
    assert b["data"]["epoch/train_loss"].shape == (2,)                   # no epoch missing or twice
    assert b["data"]["checkpoint/position"][-1].tolist() == [2, 0]
    assert (b["data"]["checkpoint/seconds"] > 0).all()
    np.testing.assert_array_equal(a["data"]["step/loss"], b["data"]["step/loss"])
    np.testing.assert_array_equal(a["data"]["step/epoch"], b["data"]["step/epoch"])
    np.testing.assert_array_equal(a["data"]["epoch/test_loss"], b["data"]["epoch/test_loss"])
    ma, mb = model_of(str(whole) + ".ckpt"), model_of(str(cut) + ".ckpt")
    for name in ma:
        assert torch.equal(ma[name], mb[name]), name                     # bit for bit


def test_resume_refuses_other_rank_counts_and_changed_config(tmp_path):
    out = tmp_path / "run.h5"
    proc = run_cli(["train", *RUN, "--epochs", "1", "--synthetic-samples", "640", "--out", str(out)], ranks=2,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(["train", "--resume", str(out), "--epochs", "2"], ranks=3, timeout=60)
    assert proc.returncode == 2 and "written by 2 ranks; resume with mpirun -n 2" in proc.stderr
    proc = run_cli(["train", "--resume", str(out), "--epochs", "2", "--lr", "0.5"], ranks=2, timeout=60)
    assert proc.returncode == 2 and "lr: 0.5 differs from the checkpoint's 0.05" in proc.stderr
    proc = run_cli(["train", "--resume", str(out), "--epochs", "2"], ranks=2, timeout=120)   # extend a run
    assert proc.returncode == 0, proc.stderr
    assert read_run(out)["data"]["epoch/train_loss"].shape == (2,)


def test_corrupt_or_missing_checkpoint_names_the_file(tmp_path):
    out = tmp_path / "run.h5"
    proc = run_cli(["train", "--resume", str(out)], ranks=2, timeout=60)
    assert proc.returncode == 2 and f"resume: no checkpoint {out}.ckpt" in proc.stderr
    proc = run_cli(["train", *RUN, "--epochs", "1", "--synthetic-samples", "640", "--out", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    ckpt = tmp_path / "run.h5.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    proc = run_cli(["train", "--resume", str(out), "--epochs", "2"], ranks=2, timeout=60)
    assert proc.returncode == 2 and f"{ckpt} is not a readable checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


def _rank_pids(mpirun_pid):
    """PIDs of the python ranks below an mpirun (mpiexec -> hydra_pmi_proxy -> python)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,comm="], capture_output=True, text=True).stdout
    children = {}
    for line in out.splitlines():
        pid, ppid, comm = line.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), comm))
    found, todo = [], [mpirun_pid]
    while todo:
        for pid, comm in children.get(todo.pop(), []):
            todo.append(pid)
            if comm.startswith("python"):
                found.append(pid)
    return found


@pytest.mark.parametrize("ranks", [2, 4])
def test_sigkill_of_one_rank_ends_the_job_and_keeps_finished_epochs(tmp_path, ranks):
    out = tmp_path / "killed.h5"
    proc = launch([*RUN, "--epochs", "50", "--synthetic-samples", "3000", "--out", str(out)], ranks)
    deadline = time.monotonic() + 120
    while "epoch 2/50" not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
    pids = _rank_pids(proc.pid)
    assert len(pids) == ranks
    os.kill(pids[-1], signal.SIGKILL)
    killed = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - killed < 10, "the job outlived the killed rank by more than 10 s"
    run = read_run(out)                                   # still readable
    assert run["attrs"]["status"] != "complete"
    assert run["data"]["epoch/train_loss"].shape[0] >= 2   # every finished epoch is there
