"""Random configurations, run: every one either is refused with a clear one-line error
before training starts, or trains to a complete result file (issue: "random and
malformed values always give a clear error or a valid run, never a traceback or a
hang"). One rank, in this process (COMM_SELF), synthetic data; each run is small.
tests/test_config.py covers parsing alone (many more examples, no training)."""
import math

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from dbs_mpi.tools import config
from dbs_mpi.tools.config import UserError
from dbs_mpi.mpi.agreement import AgreedError
from dbs_mpi.training.results import read_run
from dbs_mpi.tools.train import train

_fields = {   # values a user may well give; some combinations are still impossible
    "strategy": st.sampled_from(["ssgd", "static", "dbs"]),
    "aggregation": st.sampled_from(["weighted", "mean"]),
    "model": st.sampled_from(["mlp", "lenet5", "resnet20", "cifar-cnn"]),
    "synthetic_shape": st.sampled_from([(1, 28, 28), (3, 32, 32), (1, 8, 8)]),
    "synthetic_samples": st.integers(1, 128),
    "synthetic_classes": st.integers(1, 12),
    "epochs": st.integers(1, 2),
    "global_batch": st.integers(1, 128),
    "min_local_batch": st.integers(0, 8),
    "max_local_batch": st.integers(0, 128),
    "subset": st.integers(0, 128),
    "test_subset": st.integers(0, 100),
    "drop_last": st.booleans(),
    "lr": st.floats(0, 1.0),
    "momentum": st.floats(0, 0.99),
    "dbs_model": st.sampled_from(["affine", "proportional"]),
    "dbs_smoothing": st.floats(0.01, 1),
    "dbs_min_gain": st.floats(0, 0.5),
    "benchmark_steps": st.integers(1, 2),
    "benchmark_warmup": st.integers(0, 1),
    "checkpoint_every": st.integers(0, 2),
    "bucket_mb": st.floats(0, 2),
    "speeds": st.floats(0.01, 1).map(lambda v: (v,)),
}
_bad = {     # malformed values: each must be refused
    "strategy": st.sampled_from(["bogus", "", "SSGD"]),
    "aggregation": st.just("median"),
    "epochs": st.integers(-3, 0),
    "global_batch": st.integers(-3, 0) | st.just(1.5),
    "min_local_batch": st.integers(-3, -1),
    "lr": st.sampled_from([math.nan, math.inf, -0.1, "fast"]),
    "momentum": st.floats(-1, -0.01),
    "dbs_smoothing": st.floats(-1, 0) | st.floats(1.01, 5),
    "benchmark_steps": st.integers(-2, 0),
    "synthetic_shape": st.sampled_from([(3, 32), (0, 28, 28), "3x32", "3xAx32"]),    # ("3x32x32" is valid: C x H x W)
    "speeds": st.sampled_from([(1.0, 0.5), (0.0,), (-1.0,), (math.nan,), (math.inf,)]),
}


@given(st.fixed_dictionaries({}, optional=_fields),
       st.none() | st.sampled_from(sorted(_bad)).flatmap(lambda k: st.tuples(st.just(k), _bad[k])),
       st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_configs_are_refused_clearly_or_train_to_a_complete_file(tmp_path, capsys, values, bad, seed):
    values = {"dataset": "synthetic", "synthetic_samples": 96, "epochs": 1, "progress": False,
              "benchmark_steps": 1, "benchmark_warmup": 0, "seed": seed, "threads": 1, **values}
    if bad is not None:
        values[bad[0]] = bad[1]
    out = tmp_path / f"run-{seed}-{len(list(tmp_path.iterdir()))}.h5"
    try:
        cfg = config.from_dict(values)
        config.check_world(cfg, 1)
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc)
        assert not out.exists()
        event(f"refused: {str(exc).split(':')[0]}")
        assert str(exc).split(":")[0] in config.FIELDS, f"the error names no field: {exc}"
        return
    capsys.readouterr()
    try:
        summary = train(MPI.COMM_SELF, cfg, out=str(out), log=lambda msg: None)
    except AgreedError as exc:     # refused in set-up (e.g. a model that does not fit the samples)
        line = exc.report()
        assert exc.local and exc.details is None, line      # a user's mistake: one line, no traceback
        assert line.count("\n") == 1 and line.startswith("dbs-mpi: error: "), line
        assert not out.exists()
        event(f"refused in set-up: {str(exc).split(':')[0]}")
        assert str(exc).split(":")[0] in config.FIELDS, f"the error names no field: {exc}"
        return
    assert bad is None, f"{bad} was not refused"
    event(f"trained {cfg.strategy}")
    run = read_run(out)
    assert run["attrs"]["status"] == "complete"
    assert run["data"]["epoch/train_loss"].shape == (cfg.epochs,)
    assert summary.path == str(out)
    assert np.all(run["data"]["epoch/batch_sizes"].sum(axis=1) == cfg.global_batch)
