"""Time from a rank that stops answering (SIGSTOP) to the end of the whole job.

    .venv/bin/python scripts/stuck-exit-time.py --timeout 5 --repeats 3

For each case (the spin and the sleep wait policy of ssgd at 2 ranks, asgd at 3 ranks)
a training job runs with --comm-timeout TIMEOUT; once its first epoch is logged the last
rank gets SIGSTOP (alive, silent), and the job must end by itself: its ranks time out,
rank 0 records the failure and aborts. Reported per case: the seconds from the SIGSTOP
to mpirun's exit (median and all repeats), that time less the timeout, mpirun's exit
status and the result file's status.

    .venv/bin/python scripts/stuck-exit-time.py --timeout 5 --repeats 3 --startup

--startup: the same during the start-up instead, one case per phase (--phases): rank 1
of 2 stops itself as it enters the phase (DBS_MPI_STALL_AT, startup.py), and the time
runs from that moment (the stalling rank prints it) to mpirun's exit.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import rank_pids  # noqa: E402  (finds the rank PIDs below mpirun)

CASES = {"spin (ssgd, 2 ranks)": (2, ["--strategy", "ssgd", "--wait-policy", "spin"]),
         "sleep (ssgd, 2 ranks)": (2, ["--strategy", "ssgd", "--wait-policy", "sleep"]),
         "asgd (3 ranks)": (3, ["--strategy", "asgd", "--checkpoint-every", "0"])}


def one(ranks: int, args: list[str], timeout: float, out: Path, mpiexec: str) -> tuple[float, int, str]:
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "dbs_mpi", "train", "--dataset", "synthetic",
           "--synthetic-samples", "3000", "--test-subset", "100", "--epochs", "500", "--global-batch", "60",
           "--benchmark-steps", "1", "--benchmark-warmup", "0", "--comm-timeout", str(timeout), "--progress",
           "false", "--out", str(out), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pids = {}
    try:
        deadline = time.monotonic() + 120
        while "epoch 1/500" not in proc.stdout.readline():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{' '.join(cmd)}: no first epoch")
        pids = rank_pids(proc.pid)
        os.kill(pids[ranks - 1], signal.SIGSTOP)
        stopped = time.monotonic()
        proc.wait(timeout=timeout + 120)
        elapsed = time.monotonic() - stopped
    finally:
        proc.kill()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for _ in range(200):                       # the file lock goes with the last rank
        try:
            with h5py.File(out, "r") as f:
                return elapsed, proc.returncode, str(f.attrs["status"])
        except BlockingIOError:
            time.sleep(0.05)
    return elapsed, proc.returncode, "locked"


def one_startup(phase: str, timeout: float, out: Path, mpiexec: str) -> tuple[float, int, str]:
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "dbs_mpi", "train", "--dataset", "synthetic",
           "--synthetic-samples", "600", "--test-subset", "50", "--epochs", "1", "--global-batch", "60",
           "--benchmark-steps", "1", "--benchmark-warmup", "0", "--comm-timeout", str(timeout), "--progress",
           "false", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DBS_MPI_STALL_AT": f"1:{phase}"})
    try:
        _, err = proc.communicate(timeout=timeout + 120)
        ended = time.time()
    finally:
        left = rank_pids(proc.pid) if proc.poll() is None else {}
        proc.kill()
        for pid in left.values():
            os.kill(pid, signal.SIGKILL)
    stalled = [float(line.rsplit(" at ", 1)[1]) for line in err.splitlines() if "(DBS_MPI_STALL_AT) at" in line]
    if not stalled:
        raise SystemExit(f"{phase}: the rank did not stall:\n{err}")
    status = "none"
    if out.exists():
        with h5py.File(out, "r") as f:
            status = str(f.attrs["status"])
    return ended - stalled[0], proc.returncode, status


def startup_cases(a) -> None:
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        for phase in a.phases.split(","):
            runs = [one_startup(phase, a.timeout, Path(tmp) / f"{phase}-{r}.h5", a.mpiexec) for r in range(a.repeats)]
            times = [t for t, _, _ in runs]
            print(f"{phase:<12} stall -> end {statistics.median(times):6.2f} s (median; repeats "
                  f"{' '.join(f'{t:.2f}' for t in times)}), beyond the timeout {statistics.median(times) - a.timeout:5.2f} s, "
                  f"exit {sorted({c for _, c, _ in runs})}, result file {sorted({s for _, _, s in runs})}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=5.0, help="--comm-timeout of the runs, seconds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mpiexec", default=str(Path(sys.executable).parent / "mpirun"))
    p.add_argument("--startup", action="store_true", help="stall a rank during the start-up instead, per phase")
    p.add_argument("--phases", default="mpi,imports,init,config,data,devices,results,calibration")
    a = p.parse_args()
    if a.startup:
        startup_cases(a)
        return 0
    with tempfile.TemporaryDirectory(prefix="stuck-") as tmp:
        rows = []
        for name, (ranks, args) in CASES.items():
            runs = [one(ranks, args, a.timeout, Path(tmp) / f"{len(rows)}-{r}.h5", a.mpiexec)
                    for r in range(a.repeats)]
            rows.append((name, runs))
            times = [t for t, _, _ in runs]
            print(f"{name:<22} stop -> end {statistics.median(times):6.2f} s (median; repeats "
                  f"{' '.join(f'{t:.2f}' for t in times)}), beyond the timeout {statistics.median(times) - a.timeout:5.2f} s, "
                  f"exit {sorted({c for _, c, _ in runs})}, result file {sorted({s for _, _, s in runs})}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
