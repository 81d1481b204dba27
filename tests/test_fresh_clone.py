"""On a fresh clone, the README's commands each set up what they need: `make run` alone
creates the venv, installs, fetches Fashion-MNIST and runs the main job; the install is
recorded by a stamp, so a second `make install` (which `make test` runs first) does
nothing. Slow (a venv with torch: about a minute), bounded in time. The job's epochs are
the same code whatever their number: one epoch on 6,000 images (`ARGS`) shows it runs;
and it runs at 1, 2 and 3 ranks too (`make run NP=N`)."""
import os
import subprocess

import pytest

from conftest import ROOT
from dbs_mpi.training.results import read_run

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)      # the install and four launches: over 300 s on CI's busy cores
def test_make_run_alone_works_on_a_fresh_clone(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    proc = subprocess.run(["make", "run", "ARGS=--epochs 1 --subset 6000"], cwd=clone, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (clone / ".venv" / ".installed-mpich").exists()
    assert "final: train loss" in proc.stdout and "epoch 1/1" in proc.stdout
    results = sorted((clone / "results").glob("dbs-*.h5"))
    assert len(results) == 1 and read_run(results[0])["attrs"]["status"] == "complete"
    again = subprocess.run(["make", "install"], cwd=clone, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr
    assert "pip" not in again.stdout and "fashion-mnist: present" in again.stdout, again.stdout
    for np_ in (1, 2, 3):              # any number of ranks: rank i takes the file's speed i mod 4
        out = tmp_path / f"np{np_}.h5"
        args = f"ARGS=--epochs 1 --subset 2000 --test-subset 1000 --out {out}"
        proc = subprocess.run(["make", "run", f"NP={np_}", args], cwd=clone, capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert list(read_run(out)["config"]["speeds"]) == [1.0, 0.5, 0.25][:np_]
