"""The MPI test harness (tests/mpi_pytest.py): a test that fails on one rank, while the
other ranks wait for it in a collective, aborts the whole test job at once, with that
rank's failure printed (instead of spinning until the Makefile's timeout)."""
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
