"""scripts/step-profile.py: its exclusive timers, and a whole run on the CPU (the parts it
times must still be in the package)."""
import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "step-profile.py"


@pytest.fixture(scope="module")
def profile():
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_part_counts_its_own_time_less_that_of_the_timed_parts_it_calls(profile, monkeypatch):
    clock = itertools.count()                      # every reading of the clock one second later
    monkeypatch.setattr(profile.time, "perf_counter", lambda: float(next(clock)))
    timers = profile.Timers()
    inner = timers.wrap(lambda: None, "inner")
    outer = timers.wrap(lambda: [inner(), inner()], "outer")
    outer()                                        # outside the epoch: not counted
    assert not timers.own
    timers.inside = True
    outer()
    # outer: read at 0, inner at 1-2 and 3-4, outer ends at 5: 5 s, of which 2 in inner
    assert timers.own == {"outer": 3.0, "inner": 2.0}
    assert timers.calls == {"outer": 1, "inner": 2}


def test_every_part_it_times_is_in_the_package(profile):
    for module, path, whose in profile.PARTS + [(*profile.LOOP, ""), (*profile.LOADER, ""), (*profile.LOSS, "")]:
        owner, name = profile._owner(module, path)
        assert callable(getattr(getattr(owner, name), "__func__", getattr(owner, name))), (module, path)
    with pytest.raises(SystemExit, match="dbs_mpi.training.optimizer.DistributedOptimizer.gone"):
        profile._owner("dbs_mpi.training.optimizer", "DistributedOptimizer.gone")


def test_a_run_on_the_cpu_prints_the_step_and_its_parts(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--model", "mlp", "--local-batch", "4", "--steps", "30", "--repeats", "2", "--torch-profiler"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("the step, median of 2: dbs-mpi") and "the plain loop" in line for line in lines)
    rows = {" ".join(line.split()[:2]): line.split() for line in lines if line.startswith("  dbs-mpi: ")
            or line.startswith("  torch: ")}
    for part in ("torch: Tensor.backward", "dbs-mpi: DistributedOptimizer.step", "dbs-mpi: Participants.reduce"):
        assert float(rows[part][-1]) == 1.0, part          # once a step, in the epoch timed
    assert float(rows["dbs-mpi: DistributedOptimizer.synchronize"][-2]) > 0
    assert any("all dbs-mpi parts" in line for line in lines)
    assert "Self CPU" in proc.stdout                      # torch.profiler's table
