"""The project in a cluster user's environment: HPC variables set (OMP_NUM_THREADS=1 and
friends), ranks pinned to cores by the launcher. Each launch is bounded in time."""
import os
import shutil
import subprocess

import pytest

from conftest import ROOT, dbs_mpi_cmd, mpiexec
from dbs_mpi.training.results import read_run

HPC_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2",
           "SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": "node001"}
TINY = ["train", "--dataset", "synthetic", "--synthetic-samples", "512", "--test-subset", "64", "--epochs", "1",
        "--global-batch", "64", "--benchmark-steps", "1", "--benchmark-warmup", "0", "--progress", "false"]
CORES = len(os.sched_getaffinity(0))


def test_the_test_cluster_counts_cores_not_omp_threads():
    """nproc honours OMP_NUM_THREADS: the test cluster's node had 1 CPU in such a shell, and
    every 2- or 4-task job was refused ("More processors requested than permitted")."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "slurm-cluster.sh"), "cpus"], capture_output=True,
                         text=True, timeout=30, env={**os.environ, **HPC_ENV})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == CORES


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("limit", [None, 1])
def test_training_in_a_cluster_users_shell(tmp_path, ranks, limit):
    """OMP_NUM_THREADS=1 does not decide the threads (the cores do); OMP_PROC_BIND pinning
    the main thread when torch loads does not hide the other cores; OMP_THREAD_LIMIT is
    respected (torch hangs when asked for more threads than it allows)."""
    if limit and CORES // ranks <= limit:
        pytest.skip(f"{CORES} cores for {ranks} ranks: {CORES // ranks} thread(s) with or without the limit")
    out = tmp_path / f"hpc-{ranks}.h5"
    env = {k: v for k, v in os.environ.items() if k != "OMP_THREAD_LIMIT"}    # (make test sets 1)
    env.update(HPC_ENV, **({"OMP_THREAD_LIMIT": str(limit)} if limit else {}))
    cmd = ([mpiexec(), "-n", str(ranks)] if ranks > 1 else []) + dbs_mpi_cmd() + [*TINY, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    attrs = read_run(out)["attrs"]
    assert attrs["status"] == "complete"
    assert attrs["torch_threads"] == min(max(1, CORES // ranks), limit or CORES)


def test_more_threads_than_omp_thread_limit_are_refused(tmp_path):
    proc = subprocess.run(dbs_mpi_cmd() + [*TINY, "--threads", "2", "--out", str(tmp_path / "t.h5")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "OMP_THREAD_LIMIT": "1"})
    assert proc.returncode == 2
    assert "dbs-mpi: error: threads: 2 is more than OMP_THREAD_LIMIT=1 in the environment allows" in proc.stderr


@pytest.mark.skipif(CORES < 2 or shutil.which("taskset") is None, reason="needs 2 cores and taskset (util-linux)")
@pytest.mark.parametrize("cores, oversubscribed", [("$PMI_RANK", False), ("0", True)])
def test_pinned_ranks_are_judged_by_the_cores_they_have_together(tmp_path, cores, oversubscribed):
    """Two ranks pinned to a core each (as cluster launchers bind them) share 2 cores: not
    oversubscribed; two ranks pinned to the same core are."""
    out = tmp_path / "pinned.h5"
    command = f"exec taskset -c {cores} {' '.join(dbs_mpi_cmd())} {' '.join(TINY)} --out {out}"
    proc = subprocess.run([mpiexec(), "-n", "2", "bash", "-c", command], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    attrs = read_run(out)["attrs"]
    assert attrs["oversubscribed"] == oversubscribed and attrs["sleep_while_waiting"] == oversubscribed
    assert ("[oversubscribed" in proc.stdout) == oversubscribed
