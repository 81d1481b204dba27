"""The start-up watchdog (startup.py) without MPI: its limit from the command line, and a
process that stalls past it is killed with one line naming the phase; done() lets it go."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT
from dbs_mpi.mpi import startup


@pytest.mark.parametrize("argv, toml, expected", [
    ([], None, 0.0),
    (["--comm-timeout", "30"], None, 30.0),
    (["--comm-timeout=30", "--startup-timeout", "7"], None, 7.0),
    (["--config", "{cfg}"], "comm_timeout = 40\n", 40.0),
    (["--config", "{cfg}", "--startup-timeout", "9"], "startup_timeout = 50\n", 9.0),   # the command line wins
    (["--config", "{cfg}"], "startup_timeout = [", 0.0),          # a bad file: the parser says so later
    (["--config", "{cfg}"], "[run]\nstartup-timeout = 3\n", 3.0),  # in a section, as the parser reads it
    (["--comm-timeout", "soon"], None, 0.0),
])
def test_the_limit_is_read_before_anything_is_imported(tmp_path, argv, toml, expected):
    cfg = tmp_path / "run.toml"
    if toml is not None:
        cfg.write_text(toml)
    assert startup.limit_from_argv([a.replace("{cfg}", str(cfg)) for a in argv]) == expected


SCRIPT = textwrap.dedent("""
    import sys, time
    from dbs_mpi.mpi import startup
    startup.arm([], limit=float(sys.argv[1]))
    startup.phase("data")
    if sys.argv[2] == "done":
        startup.done()
    time.sleep(float(sys.argv[3]))
    print("finished", flush=True)
""")


def test_a_phase_past_its_limit_ends_the_process_with_one_line():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "1", "stall", "30"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert time.monotonic() - started < 15
    assert proc.returncode == -9 and "finished" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dbs-mpi")]
    assert len(lines) == 1 and "start-up stalled: 1 s in loading the data and building the model" in lines[0], \
        proc.stderr


def test_done_lets_the_process_run_past_the_limit():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "1", "done", "2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr
    assert "stalled" not in proc.stderr


def test_a_warning_during_the_start_up_is_kept_for_the_first_step():
    """SIGUSR1 (a scheduler's warning before a time limit) that comes while a rank starts
    does not kill it: the stop request takes it over and the run stops at its first step."""
    from mpi4py import MPI

    from dbs_mpi.training.checkpoint import StopRequest
    before = signal.getsignal(signal.SIGUSR1)
    try:
        startup.keep_stop_requests()
        os.kill(os.getpid(), signal.SIGUSR1)
        with StopRequest(MPI.COMM_SELF) as stop:
            assert stop.agreed() == signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, before)
        startup.EARLY_STOP[0] = 0
