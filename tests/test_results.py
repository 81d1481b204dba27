"""The HDF5 result file: round trip, flushing, status. No MPI."""
import h5py
import numpy as np
import pytest

from dbs_mpi.tools.config import Config, UserError
from dbs_mpi.training.results import STATUS_COMPLETE, STATUS_FAILED, RunWriter, read_run


def _writer(path):
    return RunWriter(path, dict(config=Config().to_json(), strategy="dbs", world_size=2, hostnames=["a", "b"]), 2)


def test_round_trip_and_status(tmp_path):
    path = tmp_path / "run.h5"
    w = _writer(path)
    w.write("startup/local_batch", [128, 512])
    for e in range(3):
        w.append_epoch(dict(train_loss=1.0 / (e + 1), batch_sizes=np.array([300, 212]), compute_time=np.array([1.0, 2.0])),
                       dict(loss=np.full(4, float(e)), epoch=np.full(4, e, dtype=np.int64)))
        # readable by another reader after every epoch, still "running"
        with h5py.File(path, "r") as f:
            assert f.attrs["status"] == "running" and f["epoch/train_loss"].shape == (e + 1,)
    w.close(STATUS_COMPLETE)
    run = read_run(path)
    assert run["attrs"]["status"] == "complete"
    assert run["config"]["strategy"] == "dbs"
    assert list(run["attrs"]["hostnames"]) == ["a", "b"]
    np.testing.assert_allclose(run["data"]["epoch/train_loss"], [1, 0.5, 1 / 3])
    assert run["data"]["epoch/batch_sizes"].dtype.kind == "i"
    assert run["data"]["epoch/batch_sizes"].shape == (3, 2)
    assert run["data"]["step/loss"].shape == (12,) and run["data"]["step/epoch"][-1] == 2
    assert run["attrs"]["git_revision"]


def test_failed_run_is_marked_failed_and_keeps_epochs(tmp_path):
    path = tmp_path / "failed.h5"
    w = _writer(path)
    w.append_epoch(dict(train_loss=0.5), {})
    w.close(STATUS_FAILED)
    run = read_run(path)
    assert run["attrs"]["status"] == "failed" and run["data"]["epoch/train_loss"].tolist() == [0.5]


def test_never_overwrites(tmp_path):
    path = tmp_path / "exists.h5"
    path.write_bytes(b"x")
    with pytest.raises(UserError, match="exists already"):
        _writer(path)
    assert path.read_bytes() == b"x"


# --- closing a crashed run (dbs-mpi close) -------------------------------------------

def test_close_marks_a_running_file_failed_and_leaves_others(tmp_path):
    from dbs_mpi.training.results import close_crashed
    crashed = tmp_path / "crashed.h5"
    w = _writer(crashed)
    w.append_epoch(dict(train_loss=0.5, batch_sizes=np.array([3, 1])), {})
    w.file.close()                                  # as a SIGKILL leaves it: `running`, epoch 1 kept
    assert close_crashed(crashed, 255) == ("running", STATUS_FAILED)
    run = read_run(crashed)
    assert run["attrs"]["status"] == STATUS_FAILED and "exit status 255" in run["attrs"]["crashed"]
    assert run["data"]["epoch/train_loss"].tolist() == [0.5]
    assert close_crashed(crashed, 1) == (STATUS_FAILED, STATUS_FAILED)        # again: nothing changes
    done = tmp_path / "done.h5"
    _writer(done).close(STATUS_COMPLETE)
    assert close_crashed(done, 1) == (STATUS_COMPLETE, STATUS_COMPLETE)
    assert "crashed" not in read_run(done)["attrs"]


def test_close_refuses_a_missing_file_and_one_a_live_run_holds(tmp_path):
    import subprocess
    import sys
    from dbs_mpi.training.results import close_crashed
    with pytest.raises(UserError, match="no result file"):
        close_crashed(tmp_path / "none.h5")
    live = tmp_path / "live.h5"
    _writer(live).file.close()
    holder = subprocess.Popen([sys.executable, "-c", "import h5py, sys, time; f = h5py.File(sys.argv[1], 'r+'); "
                               "print('open', flush=True); time.sleep(60)", str(live)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(UserError, match="still open for writing"):
            close_crashed(live, 1, timeout=0.5)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert read_run(live)["attrs"]["status"] == "running"


def test_close_command(tmp_path):
    from conftest import run_cli
    path = tmp_path / "crashed.h5"
    _writer(path).file.close()
    p = run_cli(["close", str(path), "--exit-status", "137"])
    assert p.returncode == 0 and "running -> failed" in p.stdout, p.stdout + p.stderr
    p = run_cli(["close", str(tmp_path / "none.h5")])
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("dbs-mpi: error: close: no result file")
