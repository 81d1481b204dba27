"""The HDF5 result file: round trip, flushing, status. No MPI."""
import h5py
import numpy as np
import pytest

from dbs_mpi.config import Config, UserError
from dbs_mpi.results import STATUS_COMPLETE, STATUS_FAILED, RunWriter, read_run


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
