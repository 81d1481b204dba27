"""The MPI test harness (tests/mpi_pytest.py): a test that fails on one rank, while the
other ranks wait for it in a collective, aborts the whole test job at once, with that
rank's failure printed (instead of spinning until the Makefile's timeout); a launch whose
processes the MPI library does not connect ends before any test, naming both."""
import os
import subprocess
import sys
import textwrap
import time

from conftest import ROOT, mpiexec

FAILS_ON_RANK_1 = textwrap.dedent("""
    import pytest

    @pytest.mark.mpi(min_size=2)
    def test_fails_on_rank_1_while_the_others_wait(comm):
        if comm.Get_rank() == 1:
            assert 1 + 1 == 3, "injected failure on rank 1"
        comm.Barrier()          # the other ranks wait here for rank 1, which never comes

    @pytest.mark.mpi(min_size=2)
    def test_never_reached(comm):
        pass
""")


def test_a_failure_on_one_rank_aborts_the_test_job_with_its_report(tmp_path):
    (tmp_path / "test_injected.py").write_text(FAILS_ON_RANK_1)
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    start = time.monotonic()
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(ROOT / "tests" / "mpi_pytest.py"), "-q",
                           "-p", "no:cacheprovider", "--with-mpi", "-m", "mpi", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, f"the test job took {elapsed:.0f} s to end"
    assert "rank 1 of 2: test_injected.py::test_fails_on_rank_1_while_the_others_wait failed" in proc.stderr, \
        proc.stderr
    assert "injected failure on rank 1" in proc.stderr


ONE_WORLD = textwrap.dedent("""
    import pytest

    @pytest.mark.mpi
    def test_sees_its_world(comm):
        assert comm.Get_size() == 1          # started alone, on purpose
""")
LAUNCHER_VARIABLES = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS", "WORLD_SIZE")


def run_harness(folder, **environ):
    """tests/mpi_pytest.py on folder in one process, without mpirun, with only `environ`'s launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES} | environ
    (folder / "test_one_world.py").write_text(ONE_WORLD)
    (folder / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    return subprocess.run([sys.executable, str(ROOT / "tests" / "mpi_pytest.py"), "-q", "-p", "no:cacheprovider",
                           "--with-mpi", "-m", "mpi", str(folder)], capture_output=True, text=True, timeout=120,
                          cwd=folder, env=env)


def test_a_launch_that_the_mpi_library_does_not_see_fails_at_once_naming_both(tmp_path):
    """A launcher's 2 processes that mpi4py's MPI library sees as worlds of one (another
    library's mpirun: PMI_SIZE=2 here, with no launcher behind it) would run every
    "2-rank" test as two 1-rank jobs, and pass: the harness stops before any test."""
    from mpi4py import MPI
    start = time.monotonic()
    proc = run_harness(tmp_path, PMI_SIZE="2", PMI_RANK="0")
    assert proc.returncode == 2 and time.monotonic() - start < 30, proc.stdout + proc.stderr
    library = MPI.Get_library_version().splitlines()[0].strip()
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(
        f"mpi_pytest: error: an mpirun started 2 processes, but the MPI library mpi4py loaded ({library}) sees 1, "
        "not the launcher's PMI_SIZE=2"), proc.stderr
    assert "passed" not in proc.stdout, proc.stdout


def test_a_single_process_started_on_purpose_runs_its_tests(tmp_path):
    proc = run_harness(tmp_path)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "mpi_pytest: 1 ranks, pytest exit codes by rank: [0]" in proc.stdout
