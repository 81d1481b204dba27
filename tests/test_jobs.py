"""The job scripts in jobs/ on a real one-node Slurm cluster (scripts/slurm-cluster.sh):
`sbatch --wait` for jobs/slurm/*.sbatch, slurm-wlm-torque's `qsub` for jobs/pbs/*.pbs.

Training is tiny (synthetic data, an MLP, 2 ranks, 2 epochs); every result file the jobs
write is read back and checked, and a job whose training fails must be seen as failed.
Each test session starts a cluster of its own (a fresh /tmp/dbs-mpi-slurm-test-* and
free ports, so that neither a developer's /tmp/dbs-mpi-slurm nor another test run is
touched), stops it at the end and removes its directory unless a test failed. It needs
root (it installs Debian's Slurm packages if they are missing and runs munged as the
munge user); elsewhere the cluster tests are skipped.
Every wait is bounded: each submission by a subprocess timeout, each job by a time limit.
"""
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import read_line

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

h5py = pytest.importorskip("h5py")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm-cluster.sh"

EPOCHS = 2
GLOBAL_BATCH = 64
TINY = (f"--dataset synthetic --model mlp --synthetic-samples 512 "
        f"--global-batch {GLOBAL_BATCH} --epochs {EPOCHS}")
SUBMIT_TIMEOUT = 300     # seconds for one submission to finish (all tasks of an array)
JOB_MINUTES = 5          # Slurm's time limit of every test job
# The runs that are stopped and continued: stopped once "epoch 1/2" is printed, in epoch 2
# (313 steps, seconds long: time for the stop to arrive through the scheduler).
STOPPABLE = ("--dataset synthetic --synthetic-samples 20000 --epochs 2 --global-batch 64 --strategy ssgd "
             "--progress false")
STOPPABLE_STEPS = 313    # per epoch

# Installing the packages may take minutes on a fresh machine; the first test pays it.
pytestmark = pytest.mark.timeout(1200)


def _skip_reason():
    if not sys.platform.startswith("linux"):
        return "the test cluster needs Linux"
    if os.geteuid() != 0:
        return ("needs root: scripts/slurm-cluster.sh installs Debian's Slurm packages "
                "and runs munged as the munge user")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    if shutil.which("runuser") is None:
        return "no runuser (util-linux) to start munged as the munge user"
    return None


def _free_port_pair(first=6827, tries=50):
    """P such that 127.0.0.1:P (slurmctld) and P+1 (slurmd) are free."""
    for port in range(first, first + 2 * tries, 2):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    pytest.fail(f"no free port pair in {first}..{first + 2 * tries}")


class Cluster:
    def __init__(self, env, directory):
        self.env = env
        self.dir = Path(directory)

    def job_env(self, results, **settings):
        """The submitting shell's environment: the cluster's SLURM_CONF, no leftover
        job-script settings, results into `results`, plus `settings`."""
        env = {k: v for k, v in self.env.items()
               if not k.startswith(("SLURM_", "PBS_", "GRID_"))
               and k not in ("MPIEXEC", "CONFIG", "EXTRA_ARGS", "OUT", "RESULTS_DIR", "NP", "INDEX")}
        env["SLURM_CONF"] = str(self.dir / "slurm.conf")
        # This interpreter's venv first: `dbs-mpi`/`mpirun` when the project has no .venv.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["RESULTS_DIR"] = str(results)
        env.update(settings)
        return env


@contextlib.contextmanager
def running_cluster(request, cls=None, prefix="dbs-mpi-slurm-test-", first_port=6827, **settings):
    """A test cluster of its own (a fresh /tmp/<prefix>* and free ports; `settings`: more
    DBS_MPI_SLURM_* variables), started, checked up, and stopped at the end; its directory
    is removed unless a test failed. Yields a `cls` (default Cluster)."""
    directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(directory, 0o755)          # munged (user munge) reaches its socket inside
    env = {**os.environ, "DBS_MPI_SLURM_DIR": directory, "DBS_MPI_SLURM_PORT": str(_free_port_pair(first_port)),
           **settings}
    failed_before = request.session.testsfailed
    try:
        t0 = time.monotonic()
        start = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True,
                               text=True, timeout=1000)
        assert start.returncode == 0, f"slurm-cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        print(f"test cluster up in {time.monotonic() - t0:.1f} s: {start.stderr.strip().splitlines()[-1]}")
        status = subprocess.run(["bash", str(SCRIPT), "status"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and "idle" in status.stdout, status.stdout + status.stderr
        yield (cls or Cluster)(env, directory)
    finally:
        stop = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        if request.session.testsfailed == failed_before:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"test cluster's configuration and logs kept in {directory}")


@pytest.fixture(scope="module")
def cluster(request):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with running_cluster(request) as c:
        yield c


# --- talking to Slurm -----------------------------------------------------------------

def _run(cmd, env, timeout=SUBMIT_TIMEOUT):
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        job = re.search(r"\d+", out)
        if job:   # do not leave the job running behind a failed test
            subprocess.run(["scancel", job.group()], env=env, timeout=30)
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s; output so far: {out}")


def sbatch_wait(cluster, env, *args):
    """`sbatch --wait` from the project's root; returns (exit status, job id, output)."""
    p = _run(["sbatch", "--wait", "--parsable", "-t", str(JOB_MINUTES), *args], env)
    m = re.match(r"(\d+)", p.stdout.strip())
    assert m, f"sbatch printed no job id: {p.stdout} {p.stderr}"
    return p.returncode, m.group(1), p.stdout + p.stderr


def qsub_block(cluster, env, *args):
    """slurm-wlm-torque's `qsub -W block=true`; returns the job id. Its exit status says
    only whether the submission worked (0 even for a failed job): see job_records."""
    p = _run(["qsub", "-W", "block=true", *args], env)
    assert p.returncode == 0, f"qsub failed: {p.stdout} {p.stderr}"
    job = p.stdout.strip().splitlines()[-1]
    assert job.isdigit(), p.stdout
    return job


def wait_gone(env, job, timeout=SUBMIT_TIMEOUT):
    """Until no task of `job` is queued or running (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], env=env,
                           capture_output=True, text=True, timeout=30)
        if q.returncode != 0 or not q.stdout.strip():   # unknown (purged) or nothing left
            return
        time.sleep(0.5)
    pytest.fail(f"job {job} still in the queue after {timeout} s")


_FIELD = {k: re.compile(rf"(?:^|\s){k}=(\S+)") for k in ("JobId", "ArrayJobId", "ArrayTaskId", "JobState", "ExitCode")}


def _fields(line):
    return {k: (m.group(1) if (m := r.search(line)) else None) for k, r in _FIELD.items()}


def job_records(cluster, job, expect, timeout=30):
    """{array index (None for a plain job): (JobState, ExitCode)} of the finished `job`,
    from `scontrol show job` and, for records slurmctld has already forgotten
    (MinJobAge), the cluster's job-completion log."""
    env = cluster.job_env(results="")
    deadline = time.monotonic() + timeout
    while True:
        lines = []
        s = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                           text=True, timeout=30)
        if s.returncode == 0:
            lines += s.stdout.splitlines()
        log = cluster.dir / "log" / "jobcomp.log"
        if log.exists():
            lines += log.read_text().splitlines()
        records = {}
        for line in lines:
            f = _fields(line)
            if f["ArrayJobId"] == job or (f["JobId"] == job and f["ArrayJobId"] is None):
                task = int(f["ArrayTaskId"]) if f["ArrayTaskId"] and f["ArrayTaskId"].isdigit() else None
                records.setdefault(task, (f["JobState"], f["ExitCode"]))
        done = {t: r for t, r in records.items() if r[0] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")}
        if len(done) >= expect or time.monotonic() > deadline:
            return done
        time.sleep(0.5)


# --- checking result files --------------------------------------------------------------

def _str(v):
    return v.decode() if isinstance(v, bytes) else str(v)


def check_result(path, log, *, strategy, seed, speeds, world_size=2):
    """The HDF5 result of a finished run: complete, with this run's settings and
    one entry per epoch; `log` (the job's output) is shown when something is off."""
    assert path.exists(), f"no result {path.name}; job log:\n{log}"
    with h5py.File(path, "r") as f:
        a = f.attrs
        assert _str(a["status"]) == "complete", log
        assert int(a["world_size"]) == world_size
        assert _str(a["strategy"]) == strategy
        cfg = json.loads(_str(a["config"]))
        assert cfg["strategy"] == strategy and cfg["seed"] == seed
        assert cfg["dataset"] == "synthetic" and cfg["epochs"] == EPOCHS
        assert [float(s) for s in cfg["speeds"]] == [float(s) for s in speeds]
        loss = f["epoch/train_loss"][()]
        acc = f["epoch/test_accuracy"][()]
        sizes = f["epoch/batch_sizes"][()]
    assert loss.shape == (EPOCHS,) and np.isfinite(loss).all()
    assert acc.shape == (EPOCHS,) and ((acc >= 0) & (acc <= 1)).all()
    assert sizes.shape == (EPOCHS, world_size) and (sizes >= 0).all()
    assert (sizes.sum(axis=1) == GLOBAL_BATCH).all(), sizes
    if strategy == "ssgd":
        assert (sizes == GLOBAL_BATCH // world_size).all(), sizes
    return cfg


def _read(path):
    return path.read_text() if path.exists() else f"(no {path})"


def _main_toml():
    with open(ROOT / "jobs" / "main.toml", "rb") as f:
        return tomllib.load(f)


VENV_MPIRUN = ROOT / ".venv" / "bin" / "mpirun"


# --- figures: what a user sees in each case (off unless DBS_MPI_JOB_REPORT names a file) ---

def report(case, cluster, job, log, result, *commands, key=None):
    """With DBS_MPI_JOB_REPORT=FILE, append one JSON line for `case`: the commands (as a
    user would type them), the first line the job script or dbs-mpi wrote to the job's log
    (`log`: its path, or the text this job wrote), the first line holding `key` (the line the
    case is about), the job's final scheduler state (once it has ended, at most 60 s) and
    the result file's status. Nothing otherwise."""
    if not os.environ.get("DBS_MPI_JOB_REPORT"):
        return
    text = log if isinstance(log, str) else _read(log)
    lines = [line for line in text.splitlines() if line.startswith(("dbs-mpi", "task "))]
    deadline, final = time.monotonic() + 60, {}
    while not final and time.monotonic() < deadline:
        for line in _job_lines(cluster, job):
            f = _fields(line)
            if f["JobState"] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
                restarts = re.search(r"Restarts=(\d+)", line)
                final[f["ArrayTaskId"] or "job"] = " ".join([f"{f['JobState']} {f['ExitCode']}"] + (
                    [f"Restarts={restarts.group(1)}"] if restarts else []))
        time.sleep(0 if final else 0.5)
    with open(os.environ["DBS_MPI_JOB_REPORT"], "a") as f:
        f.write(json.dumps({"case": case, "commands": list(commands), "first_line": lines[0] if lines else None,
                            "key_line": next((line for line in text.splitlines() if key and key in line), None),
                            "state": final, "status": _read_status(result) if result and result.exists() else None})
                + "\n")


def _job_lines(cluster, job):
    """The cluster's records of `job` (each array task's): its job-completion log, in order,
    then what scontrol still knows."""
    log = cluster.dir / "log" / "jobcomp.log"
    lines = [line for line in (log.read_text().splitlines() if log.exists() else [])
             if _fields(line)["JobId"] == job or _fields(line)["ArrayJobId"] == job]
    s = subprocess.run(["scontrol", "-o", "show", "job", job], env=cluster.job_env(results=""), capture_output=True,
                       text=True, timeout=30)
    return lines + (s.stdout.splitlines() if s.returncode == 0 else [])


def settings(env):
    """The job-script settings of `env` as shell assignments, for a reported command."""
    names = ("CONFIG", "EXTRA_ARGS", "OUT", "REQUEUE", "GRID_STRATEGIES", "GRID_SEEDS", "GRID_HETERO", "DBS_MPI_HOME")
    return " ".join(f"{k}={shlex.quote(env[k])}" for k in names if k in env)


# --- the tests -------------------------------------------------------------------------

def test_slurm_train(cluster, tmp_path):
    env = cluster.job_env(tmp_path, EXTRA_ARGS=f"{TINY} --speeds 1,0.5")
    rc, job, out = sbatch_wait(cluster, env, "-n", "2", "-o", f"{tmp_path}/%x-%j.out",
                               "jobs/slurm/train.sbatch")
    log = _read(tmp_path / f"dbs-mpi-train-{job}.out")
    assert rc == 0, f"sbatch --wait exited {rc}: {out}\njob log:\n{log}"
    assert job_records(cluster, job, 1) == {None: ("COMPLETED", "0:0")}
    # The default CONFIG (jobs/main.toml) is read; EXTRA_ARGS override it.
    main = _main_toml()
    cfg = check_result(tmp_path / f"train-{job}.h5", log, strategy=main["strategy"],
                       seed=main["seed"], speeds=[1, 0.5])
    assert cfg["model"] == "mlp" and cfg["lr"] == main["lr"]
    if VENV_MPIRUN.exists():
        assert f"launcher {VENV_MPIRUN}" in log, log
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == [f"train-{job}.h5"]


def test_slurm_grid(cluster, tmp_path):
    """2 strategies x 1 seed x 2 settings: every array index runs its combination
    (test_grid_scripts_enumerate_the_grid checks the whole default grid's indexing)."""
    grid = dict(GRID_STRATEGIES="ssgd dbs", GRID_SEEDS="2", GRID_HETERO="equal:1,1 slow:1,0.25")
    env = cluster.job_env(tmp_path, EXTRA_ARGS=TINY, **grid)
    rc, job, out = sbatch_wait(cluster, env, "--array=0-3", "-o", f"{tmp_path}/%x-%A_%a.out",
                               "jobs/slurm/grid.sbatch")
    logs = "\n".join(_read(p) for p in sorted(tmp_path.glob("*.out")))
    assert rc == 0, f"sbatch --wait exited {rc}: {out}\njob logs:\n{logs}"
    assert job_records(cluster, job, 4) == {i: ("COMPLETED", "0:0") for i in range(4)}
    expected = []
    for i, (strategy, (name, speeds)) in enumerate(
            (st, h) for st in ("ssgd", "dbs") for h in (("equal", [1, 1]), ("slow", [1, 0.25]))):
        path = tmp_path / f"grid-{job}_{i}-{strategy}-s2-{name}.h5"
        expected.append(path.name)
        check_result(path, _read(tmp_path / f"dbs-mpi-grid-{job}_{i}.out"),
                     strategy=strategy, seed=2, speeds=speeds)
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == sorted(expected)


def test_slurm_failed_training_fails_the_job(cluster, tmp_path):
    env = cluster.job_env(tmp_path, EXTRA_ARGS=f"{TINY} --speeds 1,0.5 --strategy no-such-strategy")
    rc, job, out = sbatch_wait(cluster, env, "-n", "2", "-o", f"{tmp_path}/%x-%j.out",
                               "jobs/slurm/train.sbatch")
    log = _read(tmp_path / f"dbs-mpi-train-{job}.out")
    assert rc == 2, f"sbatch --wait exited {rc}, expected dbs-mpi's 2: {out}\n{log}"
    assert job_records(cluster, job, 1) == {None: ("FAILED", "2:0")}
    assert "dbs-mpi: error: strategy" in log, log
    assert not list(tmp_path.glob("*.h5"))


def test_slurm_grid_task_fails_alone(cluster, tmp_path):
    """In an array, the task whose training fails (a speed that is not a number) is
    FAILED, its neighbour COMPLETED, and sbatch --wait reports the failure."""
    grid = dict(GRID_STRATEGIES="ssgd", GRID_SEEDS="0", GRID_HETERO="ok:1,1 bad:1,fast")
    env = cluster.job_env(tmp_path, EXTRA_ARGS=TINY, **grid)
    rc, job, out = sbatch_wait(cluster, env, "--array=0-1", "-o", f"{tmp_path}/%x-%A_%a.out",
                               "jobs/slurm/grid.sbatch")
    assert rc == 2, out
    assert job_records(cluster, job, 2) == {0: ("COMPLETED", "0:0"), 1: ("FAILED", "2:0")}
    check_result(tmp_path / f"grid-{job}_0-ssgd-s0-ok.h5", _read(tmp_path / f"dbs-mpi-grid-{job}_0.out"),
                 strategy="ssgd", seed=0, speeds=[1, 1])
    assert "dbs-mpi: error: speeds" in _read(tmp_path / f"dbs-mpi-grid-{job}_1.out")
    assert [p.name for p in tmp_path.glob("*.h5")] == [f"grid-{job}_0-ssgd-s0-ok.h5"]


def test_pbs_train(cluster, tmp_path):
    env = cluster.job_env(tmp_path, EXTRA_ARGS=f"{TINY} --speeds 1,0.5")
    out = tmp_path / "train.out"
    job = qsub_block(cluster, env, "-l", f"nodes=1:ppn=2,walltime=00:{JOB_MINUTES:02d}:00",
                     "-j", "oe", "-o", str(out), "jobs/pbs/train.pbs")
    wait_gone(env, job)
    assert job_records(cluster, job, 1) == {None: ("COMPLETED", "0:0")}, _read(out)
    main = _main_toml()
    log = _read(out)
    check_result(tmp_path / f"train-{job}.h5", log, strategy=main["strategy"],
                 seed=main["seed"], speeds=[1, 0.5])
    assert "2 ranks on localhost" in log, log      # from $PBS_NODEFILE


def test_pbs_resubmitted_with_another_node_count_continues_a_stopped_run(cluster, tmp_path):
    """A run stopped on 2 ranks, resubmitted with `qsub -l nodes=1:ppn=1` and OUT=its
    result file: train.pbs resumes it on 1 rank to `complete`."""
    result = tmp_path / "stopped.h5"
    args = STOPPABLE.split()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mpirun"), "-n", "2", sys.executable, "-m", "dbs_mpi",
                             "train", *args, "--out", str(result)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    read_line(proc, "epoch 1/2")
    proc.send_signal(signal.SIGUSR1)                # a stop in epoch 2
    assert proc.wait(timeout=120) == 3, proc.communicate()
    env = cluster.job_env(tmp_path, CONFIG="", OUT=str(result), EXTRA_ARGS=" ".join(args))
    out = tmp_path / "resumed.out"
    job = qsub_block(cluster, env, "-l", f"nodes=1:ppn=1,walltime=00:{JOB_MINUTES:02d}:00",
                     "-j", "oe", "-o", str(out), "jobs/pbs/train.pbs")
    wait_gone(env, job)
    assert job_records(cluster, job, 1) == {None: ("COMPLETED", "0:0")}, _read(out)
    assert f"resuming {result}" in _read(out)
    with h5py.File(result, "r") as run:
        assert run.attrs["status"] == "complete"
        assert [s["world_size"] for s in json.loads(run.attrs["segments"])] == [2, 1]


def test_pbs_grid(cluster, tmp_path):
    """qsub -t: $PBS_ARRAYID picks the combination, PBS_JOBID 'N[i].host' names it."""
    grid = dict(GRID_STRATEGIES="ssgd static", GRID_SEEDS="3", GRID_HETERO="slow:1,0.25")
    env = cluster.job_env(tmp_path, EXTRA_ARGS=TINY, **grid)
    job = qsub_block(cluster, env, "-t", "0-1", "-l", f"walltime=00:{JOB_MINUTES:02d}:00",
                     "-j", "oe", "-o", f"{tmp_path}/grid-%A_%a.out", "jobs/pbs/grid.pbs")
    wait_gone(env, job)
    logs = "\n".join(_read(p) for p in sorted(tmp_path.glob("*.out")))
    assert job_records(cluster, job, 2) == {i: ("COMPLETED", "0:0") for i in range(2)}, logs
    expected = []
    for i, (strategy, seed) in enumerate((st, se) for st in ("ssgd", "static") for se in (3,)):
        path = tmp_path / f"grid-{job}_{i}-{strategy}-s{seed}-slow.h5"
        expected.append(path.name)
        check_result(path, _read(tmp_path / f"grid-{job}_{i}.out"), strategy=strategy,
                     seed=seed, speeds=[1, 0.25])
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == sorted(expected)


def test_pbs_failed_training_fails_the_job(cluster, tmp_path):
    env = cluster.job_env(tmp_path, EXTRA_ARGS=f"{TINY} --speeds 1,0.5,0.25")
    out = tmp_path / "train.out"
    job = qsub_block(cluster, env, "-l", f"nodes=1:ppn=2,walltime=00:{JOB_MINUTES:02d}:00",
                     "-j", "oe", "-o", str(out), "jobs/pbs/train.pbs")
    wait_gone(env, job)
    assert job_records(cluster, job, 1) == {None: ("FAILED", "2:0")}, _read(out)
    assert "dbs-mpi: error: speeds" in _read(out)
    assert not list(tmp_path.glob("*.h5"))


@pytest.mark.parametrize("script, directive", [("jobs/slurm/grid.sbatch", r"#SBATCH --array=(\d+)-(\d+)"),
                                               ("jobs/pbs/grid.pbs", r"#PBS -t (\d+)-(\d+)")])
def test_grid_scripts_enumerate_the_grid(script, directive, tmp_path):
    """No cluster needed: run the script by hand with MPIEXEC="echo LAUNCH" (it prints the
    launch line instead of training) for every index. The default array range is exactly the
    default grid, every index gets a different combination, named after it, and an index
    past the end fails with status 2 naming the grid's size."""
    first, last = map(int, re.search(directive, (ROOT / script).read_text()).groups())
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PBS_", "GRID_"))
           and k not in ("CONFIG", "EXTRA_ARGS", "OUT", "NP")}
    env.update(RESULTS_DIR=str(tmp_path), MPIEXEC="echo LAUNCH")

    def run(index):
        return subprocess.run(["bash", script], cwd=ROOT, env={**env, "INDEX": str(index)},
                              capture_output=True, text=True, timeout=60)

    p = run(last + 1)
    assert p.returncode == 2, p.stdout + p.stderr
    m = re.search(r"not in the grid 0-(\d+) \((\d+) strategies x (\d+) seeds x (\d+) settings\)", p.stderr)
    assert m, p.stderr
    assert first == 0 and last == int(m.group(1))
    assert last + 1 == int(m.group(2)) * int(m.group(3)) * int(m.group(4))
    combos = set()
    for i in range(last + 1):
        p = run(i)
        assert p.returncode == 0, p.stdout + p.stderr
        line = next((l for l in p.stdout.splitlines() if l.startswith("LAUNCH ")), "")
        args = dict(re.findall(r"--(strategy|seed|speeds|out) (\S+)", line))
        assert set(args) == {"strategy", "seed", "speeds", "out"}, line
        ranks = len(args["speeds"].split(","))
        assert line.startswith(f"LAUNCH -n {ranks} "), line   # ranks = entries of speeds
        out = Path(args["out"])
        assert out.parent == tmp_path
        assert re.fullmatch(rf"grid-local-\d+_{i}-{args['strategy']}-s{args['seed']}-\w+\.h5", out.name), out.name
        combos.add((args["strategy"], args["seed"], args["speeds"]))
    assert len(combos) == last + 1


def _job_state(env, job):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else None, out


def _submit_and_signal(env, tmp_path, result=None):
    """Submit train.sbatch on 2 tasks, wait for its first epoch in the job's log, then send
    the batch shell USR1 as Slurm does before a time limit (a stop in epoch 2). Returns
    (job id, result file: default the script's train-JOB.h5)."""
    p = _run(["sbatch", "--parsable", "-n", "2", "-t", str(JOB_MINUTES), "-o", f"{tmp_path}/%x-%j.out",
              "jobs/slurm/train.sbatch"], env)
    job = p.stdout.strip().split(";")[0]
    assert job.isdigit(), p.stdout + p.stderr
    result = result or tmp_path / f"train-{job}.h5"
    log = tmp_path / f"dbs-mpi-train-{job}.out"
    deadline = time.monotonic() + 120
    while "epoch 1/2" not in _read(log):
        assert time.monotonic() < deadline and "exited with status" not in _read(log), _read(log)
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
    return job, result


def test_slurm_time_limit_signal_checkpoints_requeues_and_resumes(cluster, tmp_path):
    """What Slurm does before a time limit (--signal=B:USR1@120), done now: the batch
    shell gets USR1, the ranks checkpoint and exit 3, the job requeues itself, and the
    second start continues the same result file from the checkpoint."""
    env = cluster.job_env(tmp_path, CONFIG="", EXTRA_ARGS=STOPPABLE)
    job, result = _submit_and_signal(env, tmp_path)
    deadline = time.monotonic() + 180
    while True:
        state, text = _job_state(env, job)
        if "Restarts=1" in text:
            break            # requeued; it starts again once its credential expired (cred_expire=10 here)
        assert state not in ("COMPLETED", "FAILED", "CANCELLED"), text
        assert time.monotonic() < deadline, f"job {job} was not requeued: {text}"
        time.sleep(0.5)
    deadline = time.monotonic() + 240
    while (state := _job_state(env, job)[0]) != "COMPLETED":
        assert state in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"), state
        assert time.monotonic() < deadline, f"job {job} did not complete after the requeue"
        time.sleep(0.5)
    log = _read(tmp_path / f"dbs-mpi-train-{job}.out")
    assert "checkpoint written; requeueing" in log and f"resuming {result}" in log, log
    assert "the lines above belong to an earlier job" not in log, log     # its own lines, appended
    assert _job_state(env, job)[1].count("Restarts=1") == 1
    run = h5py.File(result, "r")
    try:
        assert run.attrs["status"] == "complete" and len(run.attrs["resumed"]) == 1
        assert run["epoch/train_loss"].shape == (2,)
    finally:
        run.close()
    report("the warning (USR1) before the time limit", cluster, job, tmp_path / f"dbs-mpi-train-{job}.out", result,
           f"{settings(env)} RESULTS_DIR=$T sbatch -n 2 -t {JOB_MINUTES} -o $T/%x-%j.out jobs/slurm/train.sbatch",
           f"scancel --signal=USR1 --batch {job}    # once the log says epoch 1/2", key="the time limit is near")


def test_slurm_stopped_job_resubmitted_with_another_ntasks_continues_the_run(cluster, tmp_path):
    """A job stopped by its signal (not requeued) and submitted again with another
    --ntasks and the same OUT continues the same result file to `complete`: the run is
    the same, its second segment has the new world."""
    result = tmp_path / "moved.h5"
    env = cluster.job_env(tmp_path, CONFIG="", OUT=str(result), REQUEUE="0",
                          EXTRA_ARGS=STOPPABLE)
    job, _ = _submit_and_signal(env, tmp_path, result)
    deadline = time.monotonic() + 180
    while _job_state(env, job)[0] in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
        assert time.monotonic() < deadline, f"job {job} did not stop"
        time.sleep(0.5)
    assert "exited with status 3" in _read(tmp_path / f"dbs-mpi-train-{job}.out")
    p = _run(["sbatch", "--parsable", "--wait", "-n", "1", "-t", str(JOB_MINUTES), "-o", f"{tmp_path}/%x-%j.out",
              "jobs/slurm/train.sbatch"], env)
    second = p.stdout.strip().split(";")[0]
    assert p.returncode == 0, p.stdout + p.stderr + _read(tmp_path / f"dbs-mpi-train-{second}.out")
    assert f"resuming {result}" in _read(tmp_path / f"dbs-mpi-train-{second}.out")
    run = h5py.File(result, "r")
    try:
        assert run.attrs["status"] == "complete" and len(run.attrs["resumed"]) == 1
        assert [s["world_size"] for s in json.loads(run.attrs["segments"])] == [2, 1]
        assert run["epoch/train_loss"].shape == (2,) and run["step/loss"].shape == (2 * STOPPABLE_STEPS,)
    finally:
        run.close()


# --- cluster semantics: cancel, run identity, grids, live files, paths ------------------

def _wait_log(log, text, seconds=120):
    deadline = time.monotonic() + seconds
    while text not in _read(log):
        assert time.monotonic() < deadline, f"no {text!r} in the job's log:\n{_read(log)}"
        time.sleep(0.1)


def _wait_state(env, job, states=("COMPLETED", "CANCELLED", "FAILED"), seconds=240):
    deadline = time.monotonic() + seconds
    while (state := _job_state(env, job))[0] not in states:
        assert time.monotonic() < deadline, f"job {job} is {state[0]} after {seconds} s"
        time.sleep(0.5)
    return state


def _submit(env, tmp_path, *args, script="jobs/slurm/train.sbatch", name="%x-%j.out"):
    p = _run(["sbatch", "--parsable", "-t", str(JOB_MINUTES), "-o", f"{tmp_path}/{name}", *args, script], env)
    job = p.stdout.strip().split(";")[0]
    assert job.isdigit(), p.stdout + p.stderr
    return job


def test_slurm_scancel_checkpoints_and_ends_the_job_for_good(cluster, tmp_path):
    """scancel while it trains: the ranks checkpoint, the file says cancelled, the job is
    CANCELLED and not requeued (Restarts=0); the run can still be continued by hand."""
    env = cluster.job_env(tmp_path, CONFIG="", EXTRA_ARGS=STOPPABLE)
    job = _submit(env, tmp_path, "-n", "2")
    log = tmp_path / f"dbs-mpi-train-{job}.out"
    _wait_log(log, "epoch 1/2")
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    _wait_log(log, "exited with status 3", 60)
    time.sleep(3)                                    # (a requeue, if any, would show by now)
    state, text = _job_state(env, job)
    assert state in ("CANCELLED", None) and "Restarts=0" in (text or "Restarts=0"), text
    assert "TERM (a cancel, a preemption or the scheduler's requeue): checkpointing; this script does not " \
           "requeue it" in _read(log) and "requeueing" not in _read(log)
    result = tmp_path / f"train-{job}.h5"
    assert _read_status(result) == "cancelled" and Path(f"{result}.ckpt").exists()
    report("scancel during a run", cluster, job, log, result,
           f"{settings(env)} RESULTS_DIR=$T sbatch -n 2 -t {JOB_MINUTES} -o $T/%x-%j.out jobs/slurm/train.sbatch",
           f"scancel {job}    # once the log says epoch 1/2", key="TERM")


def _wait_result(path, log, seconds=120):
    """Until the job's ranks have created their result file: from then on they take a stop
    signal (checkpoint, exit 3) instead of dying of it."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline and "exited with status" not in _read(log), _read(log)
        time.sleep(0.1)


def test_slurm_scancel_of_a_grid_task_ends_it_for_good(cluster, tmp_path):
    """grid.sbatch shares job.sh: scancel of a running array task checkpoints it, its file
    says cancelled, the task is CANCELLED and not requeued (nothing of it left in the queue)."""
    grid = dict(GRID_STRATEGIES="ssgd", GRID_SEEDS="0", GRID_HETERO="equal:1,1")
    env = cluster.job_env(tmp_path, CONFIG="", EXTRA_ARGS=STOPPABLE.replace("--strategy ssgd ", ""), **grid)
    array = _submit(env, tmp_path, "-n", "2", "--array=0-0", script="jobs/slurm/grid.sbatch", name="%x-%A_%a.out")
    log, result = tmp_path / f"dbs-mpi-grid-{array}_0.out", tmp_path / f"grid-{array}_0-ssgd-s0-equal.h5"
    _wait_result(result, log)
    subprocess.run(["scancel", f"{array}_0"], env=env, check=True, timeout=30)
    _wait_log(log, "exited with status 3", 60)
    time.sleep(3)                                    # (a requeue, if any, would show by now: cred_expire=10)
    queued = subprocess.run(["squeue", "-h", "-j", array], env=env, capture_output=True, text=True, timeout=30)
    assert not queued.stdout.strip(), queued.stdout
    assert job_records(cluster, array, 1)[0][0] == "CANCELLED", _read(log)
    assert "requeueing" not in _read(log)
    assert _read_status(result) == "cancelled" and Path(f"{result}.ckpt").exists(), _read(log)
    report("scancel of a running grid array task", cluster, array, log, result,
           f"{settings(env)} RESULTS_DIR=$T sbatch -n 2 --array=0-0 -t {JOB_MINUTES} -o $T/%x-%A_%a.out "
           "jobs/slurm/grid.sbatch", f"scancel {array}_0    # once the ranks have created the result file", key="TERM")


def _read_status(path):
    from dbs_mpi.training.results import read_run
    return read_run(path, datasets=False)["attrs"]["status"]


def test_slurm_a_reused_job_id_never_resumes_another_run(cluster, tmp_path):
    """A fresh controller state numbers jobs from 1 again: a job whose result name is
    taken by another run (complete, with its checkpoint) writes a new file beside it,
    trains, and leaves the old one untouched; the log the old job left (appended to, as
    requeues need) says where the new job's lines begin, naming both runs."""
    env = cluster.job_env(tmp_path, EXTRA_ARGS=f"{TINY} --speeds 1,0.5")
    job = _submit(env, tmp_path, "-n", "2", "--hold")
    old = tmp_path / f"train-{job}.h5"
    earlier = (f"dbs-mpi job {job}: 2 ranks on localhost; launcher mpirun; config none; extra: none; result {old}; "
               f"run ID slurm-dbsmpi-{job}-1-1\ndbs-mpi job {job}: dbs-mpi train exited with status 0\n")
    (tmp_path / f"dbs-mpi-train-{job}.out").write_text(earlier)
    proc = subprocess.run([sys.executable, "-m", "dbs_mpi", "train", *TINY.split(), "--out", str(old)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and Path(f"{old}.ckpt").exists(), proc.stderr
    before = old.read_bytes()
    subprocess.run(["scontrol", "release", job], env=env, check=True, timeout=30)
    assert _wait_state(env, job)[0] == "COMPLETED"
    log = _read(tmp_path / f"dbs-mpi-train-{job}.out")
    new = tmp_path / f"train-{job}.2.h5"
    assert f"{old} belongs to another run" in log and f"writing {new}" in log, log
    assert log.startswith(earlier), log
    marker = log[len(earlier):].splitlines()[0]
    assert re.fullmatch(rf"dbs-mpi job {job}: the lines above belong to an earlier job with the same ID \(run ID "
                        rf"slurm-dbsmpi-{job}-1-1\); this job, run ID slurm-dbsmpi-{job}-\d+-\d+, starts here",
                        marker), log
    assert old.read_bytes() == before
    assert _read_status(new) == "complete"
    report("a job ID used again beside an old run's files", cluster, job, log[len(earlier):], new,
           f"{settings(env)} RESULTS_DIR=$T sbatch -n 2 -t {JOB_MINUTES} --hold -o $T/%x-%j.out "
           "jobs/slurm/train.sbatch",
           f"dbs-mpi train {TINY} --out $T/train-{job}.h5    # the old run, and an old log", f"scontrol release {job}",
           key="belongs to another run")


def test_slurm_grid_task_requeued_resumes_its_checkpoint_and_appends_its_log(cluster, tmp_path):
    grid = dict(GRID_STRATEGIES="ssgd", GRID_SEEDS="0", GRID_HETERO="equal:1,1")
    env = cluster.job_env(tmp_path, CONFIG="", EXTRA_ARGS=STOPPABLE.replace("--strategy ssgd ", ""), **grid)
    array = _submit(env, tmp_path, "-n", "2", "--array=0-0", script="jobs/slurm/grid.sbatch", name="%x-%A_%a.out")
    log = tmp_path / f"dbs-mpi-grid-{array}_0.out"
    _wait_log(log, "epoch 1/2")
    subprocess.run(["scontrol", "requeue", f"{array}_0"], env=env, check=True, timeout=30)
    _wait_log(log, "exited with status 0", 240)
    text = _read(log)
    result = tmp_path / f"grid-{array}_0-ssgd-s0-equal.h5"
    assert text.count("task ") >= 2 and f"resuming {result}" in text, text        # both attempts, appended
    assert "the lines above belong to an earlier job" not in text, text
    run = h5py.File(result, "r")
    try:
        assert run.attrs["status"] == "complete" and len(run.attrs["resumed"]) == 1
        assert run["step/loss"].shape == (2 * STOPPABLE_STEPS,)
    finally:
        run.close()
    report("a grid task requeued mid-run", cluster, array, log, result,
           f"{settings(env)} RESULTS_DIR=$T sbatch -n 2 --array=0-0 -t {JOB_MINUTES} -o $T/%x-%A_%a.out "
           "jobs/slurm/grid.sbatch", f"scontrol requeue {array}_0    # once the log says epoch 1/2", key="resuming")


def test_a_live_result_file_is_read_while_the_job_writes_it(cluster, tmp_path):
    """A reader in a loop beside a training job: every read works, its tables are
    consistent (one row per epoch in every epoch column), and the last read is complete."""
    from dbs_mpi.training.results import read_run
    env = cluster.job_env(tmp_path, CONFIG="", EXTRA_ARGS=STOPPABLE.replace("--epochs 2", "--epochs 3"))
    job = _submit(env, tmp_path, "-n", "2")
    result = tmp_path / f"train-{job}.h5"
    deadline, reads, statuses = time.monotonic() + 240, 0, set()
    while not result.exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    while True:
        run = read_run(result)
        reads += 1
        statuses.add(run["attrs"]["status"])
        epochs = {len(v) for k, v in run["data"].items() if k.startswith("epoch/") and len(v)}
        assert len(epochs) <= 1, epochs
        if run["attrs"]["status"] != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert run["attrs"]["status"] == "complete" and "running" in statuses and reads > 10, (reads, statuses)
    assert len(run["data"]["epoch/train_loss"]) == 3
    report(f"a reader polling a live file ({reads} reads, all consistent)", cluster, job,
           tmp_path / f"dbs-mpi-train-{job}.out", result,
           f"{settings(env)} RESULTS_DIR=$T sbatch -n 2 -t {JOB_MINUTES} -o $T/%x-%j.out jobs/slurm/train.sbatch",
           f"python -c 'import dbs_mpi; print(dbs_mpi.read_run(\"$T/train-{job}.h5\")[\"attrs\"][\"status\"])'    "
           "# in a loop, every 0.05 s, until the status is not running")


def test_submitted_from_another_folder(cluster, tmp_path):
    """From elsewhere the script says in its log (in the submit folder) how to point it at
    the project, and fails; with DBS_MPI_HOME it runs."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = cluster.job_env(tmp_path, EXTRA_ARGS=f"{TINY} --speeds 1,0.5")
    p = subprocess.run(["sbatch", "--wait", "--parsable", "-n", "2", "-t", str(JOB_MINUTES),
                        str(ROOT / "jobs" / "slurm" / "train.sbatch")], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=SUBMIT_TIMEOUT)
    job = p.stdout.strip().split(";")[0]
    log = _read(elsewhere / f"dbs-mpi-train-{job}.out")
    assert p.returncode == 2 and f"error: no dbs-mpi project in {elsewhere}" in log and "DBS_MPI_HOME" in log, log
    report("submitted from another folder", cluster, job, elsewhere / f"dbs-mpi-train-{job}.out", None,
           f"cd $T/elsewhere && {settings(env)} sbatch --wait -n 2 -t {JOB_MINUTES} {ROOT}/jobs/slurm/train.sbatch")
    p = subprocess.run(["sbatch", "--wait", "--parsable", "-n", "2", "-t", str(JOB_MINUTES),
                        str(ROOT / "jobs" / "slurm" / "train.sbatch")], cwd=elsewhere,
                       env={**env, "DBS_MPI_HOME": str(ROOT)}, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT)
    job = p.stdout.strip().split(";")[0]
    assert p.returncode == 0, _read(elsewhere / f"dbs-mpi-train-{job}.out")
    assert _read_status(tmp_path / f"train-{job}.h5") == "complete"
    report("submitted from another folder, with DBS_MPI_HOME", cluster, job, elsewhere / f"dbs-mpi-train-{job}.out",
           tmp_path / f"train-{job}.h5", f"cd $T/elsewhere && DBS_MPI_HOME={ROOT} {settings(env)} RESULTS_DIR=$T "
           f"sbatch --wait -n 2 -t {JOB_MINUTES} {ROOT}/jobs/slurm/train.sbatch")


def test_pbs_warning_before_the_walltime_reruns_the_job_and_resumes(cluster, tmp_path):
    """USR1 to train.pbs (what its timer sends before the walltime, or `qsig -s USR1`):
    checkpoint, qrerun, and the rerun continues its own file to `complete`; its log is
    appended across reruns."""
    env = cluster.job_env(tmp_path, CONFIG="", EXTRA_ARGS=STOPPABLE)
    p = _run(["qsub", "-l", f"nodes=1:ppn=2,walltime=00:{JOB_MINUTES:02d}:00", "-j", "oe", "-o",
              str(tmp_path / "pbs.out"), "jobs/pbs/train.pbs"], env)
    job = p.stdout.strip().splitlines()[-1]
    assert job.isdigit(), p.stdout + p.stderr
    log = tmp_path / f"dbs-mpi-train-{job}.log"       # beside the results, appended across reruns
    _wait_log(log, "epoch 1/2")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
    _wait_log(log, "exited with status 0", 240)
    text = _read(log)
    result = tmp_path / f"train-{job}.h5"
    assert "the time limit is near" in text and "requeueing to continue" in text and f"resuming {result}" in text, \
        text
    assert _read_status(result) == "complete"
    report("the warning (USR1) to a PBS job", cluster, job, log, result,
           f"{settings(env)} RESULTS_DIR=$T qsub -l nodes=1:ppn=2,walltime=00:{JOB_MINUTES:02d}:00 -j oe -o $T/pbs.out "
           "jobs/pbs/train.pbs", f"scancel --signal=USR1 --batch {job}    # (qsig -s USR1) once the log says epoch 1/2",
           key="the time limit is near")


def test_pbs_qdel_checkpoints_and_ends_the_job_for_good(cluster, tmp_path):
    """qdel of a running train.pbs job (slurm-wlm-torque's qdel: TERM to every process of
    the job, the script's tee included): the ranks checkpoint, the file says cancelled, the
    log goes on to the script's last line, and the job is CANCELLED, not rerun."""
    env = cluster.job_env(tmp_path, CONFIG="", EXTRA_ARGS=STOPPABLE)
    p = _run(["qsub", "-l", f"nodes=1:ppn=2,walltime=00:{JOB_MINUTES:02d}:00", "-j", "oe", "-o",
              str(tmp_path / "pbs.out"), "jobs/pbs/train.pbs"], env)
    job = p.stdout.strip().splitlines()[-1]
    assert job.isdigit(), p.stdout + p.stderr
    log, result = tmp_path / f"dbs-mpi-train-{job}.log", tmp_path / f"train-{job}.h5"
    _wait_result(result, log)
    subprocess.run(["qdel", job], env=env, check=True, timeout=30)
    _wait_log(log, "exited with status 3", 60)
    wait_gone(env, job, 30)
    assert job_records(cluster, job, 1)[None][0] == "CANCELLED", _read(log)
    assert "checkpointing; this script does not requeue it" in _read(log) and "requeueing" not in _read(log)
    assert _read_status(result) == "cancelled" and Path(f"{result}.ckpt").exists(), _read(log)
    report("qdel during a PBS run", cluster, job, log, result,
           f"{settings(env)} RESULTS_DIR=$T qsub -l nodes=1:ppn=2,walltime=00:{JOB_MINUTES:02d}:00 -j oe -o $T/pbs.out "
           "jobs/pbs/train.pbs", f"qdel {job}    # once the ranks have created the result file", key="TERM")


def test_the_pbs_scripts_own_timer_warns_before_the_walltime(tmp_path):
    """No cluster: train.pbs by hand with WALLTIME=3 and WARN_BEFORE=1, and a launcher
    that only waits: the timer sends the script USR1 after 2 s, the script passes it on
    (the launcher exits 3, as checkpointed ranks do) and, with no PBS job to rerun, says
    how to continue."""
    env = _waiting_launcher(tmp_path, WALLTIME="3", WARN_BEFORE="1")
    started = time.monotonic()
    p = subprocess.run(["bash", "jobs/pbs/train.pbs"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 3 and time.monotonic() - started < 20, out
    assert "the time limit is near; checkpointing to continue" in out and "launcher got USR1" in out, out
    assert "the requeue failed; continue by hand with OUT=" in out, out


def _waiting_launcher(tmp_path, **settings):
    """The environment of a job script run by hand with a launcher that only waits: it says
    it started, writes the result file of its --out (as ranks do once they take signals),
    and exits 3 on USR1 or TERM, as checkpointed ranks do."""
    launcher = tmp_path / "launcher.sh"
    launcher.write_text("#!/bin/bash\necho launcher started\nsleep 30 & pid=$!\n"
                        "trap 'echo launcher got USR1; kill $pid; exit 3' USR1\n"
                        "trap 'echo launcher got TERM; kill $pid; exit 3' TERM\n"
                        "while [[ $1 != --out ]]; do shift; done; touch \"$2\"\nwait\n")
    launcher.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    env.update(MPIEXEC=str(launcher), RESULTS_DIR=str(tmp_path), CONFIG="", EXTRA_ARGS="--epochs 1", NP="2",
               **settings)
    return env


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_a_signal_before_the_launch_is_kept(tmp_path, sig):
    """No cluster: a signal that reaches train.sbatch while it plans (its `dbs-mpi job plan`
    runs) does not kill it. The warning is passed on once the launcher's ranks have written
    the result file (the launcher exits 3, as checkpointed ranks do, and with no Slurm job
    to requeue the script says how to continue); a cancel ends the job without launching."""
    script = subprocess.Popen(["bash", "jobs/slurm/train.sbatch"], cwd=ROOT, env=_waiting_launcher(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not any(f"--base\0{tmp_path}/".encode() in _cmdline(pid) for pid in os.listdir("/proc") if pid.isdigit()):
        assert script.poll() is None and time.monotonic() < deadline, "the script's `dbs-mpi job plan` was not seen"
        time.sleep(0.01)
    script.send_signal(getattr(signal, f"SIG{sig}"))
    out = script.communicate(timeout=60)[0]
    assert script.returncode == 3, out
    if sig == "USR1":
        assert out.index("the time limit is near") < out.index("launcher started") < out.index("launcher got USR1"), out
        assert "the requeue failed; continue by hand with OUT=" in out, out
    else:
        assert "TERM (a cancel, a preemption or the scheduler's requeue) before the launch: not launching" in out, out
        assert "not launched" in out and "launcher started" not in out, out


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# --- dbs-mpi job, without a cluster -------------------------------------------------------

def _result(path, status, run_id=None, job_id="7", checkpoint=True, hosts=("n1", "n1", "n2", "n2")):
    from dbs_mpi.training.results import RunWriter
    attrs = dict(hostnames=list(hosts), job_id=job_id, **({"run_id": run_id} if run_id else {}))
    RunWriter(path, attrs, len(hosts)).close(status)
    if checkpoint:
        Path(f"{path}.ckpt").write_bytes(b"")
    return path


def test_a_job_plans_a_new_file_or_continues_only_its_own_run(tmp_path):
    from dbs_mpi.tools.job import plan
    base = str(tmp_path / "train-7")
    assert (plan(base, "r1", False).action, plan(base, "r1", False).out.name) == ("new", "train-7.h5")
    _result(tmp_path / "train-7.h5", "complete", "old")               # another run (a reused job ID)
    first = plan(base, "r1", False)
    assert (first.action, first.out.name) == ("new", "train-7.2.h5") and "belongs to another run" in first.note
    assert plan(base, "r1", True).action == "new"                      # requeued, but no file of r1: start
    _result(tmp_path / "train-7.2.h5", "interrupted", "r1")
    again = plan(base, "r1", True)
    assert (again.action, again.out.name) == ("resume", "train-7.2.h5")
    assert plan(base, "r1", False).out.name == "train-7.3.h5"          # a first start never resumes
    _result(tmp_path / "train-7.3.h5", "complete", "r2")
    assert plan(base, "r2", True).action == "done"
    _result(tmp_path / "train-7.4.h5", "failed", "r3", checkpoint=False)   # its own, but nothing to resume
    assert plan(base, "r3", True).out.name == "train-7.5.h5"
    given = plan(base, "r9", False, out=str(tmp_path / "train-7.h5"))  # OUT= on purpose
    assert given.action == "done"
    assert plan(base, "r9", False, out=str(tmp_path / "train-7.2.h5")).action == "resume"
    Path(tmp_path / "train-7.5.h5.ckpt").write_bytes(b"")           # its result moved away: a new run would refuse it
    assert plan(base, "r3", True).out.name == "train-7.6.h5" and plan(base, "r4", False).out.name == "train-7.6.h5"


def test_speeds_are_cycled_to_the_jobs_ranks_and_lost_nodes_named(tmp_path):
    from dbs_mpi.tools.job import cycled_speeds, lost_ranks
    main = str(ROOT / "jobs" / "main.toml")
    assert cycled_speeds(main, 2, "") == "1.0,0.5"
    assert cycled_speeds(main, 6, "--epochs 2") == "1.0,0.5,0.25,0.25,1.0,0.5"
    assert cycled_speeds(main, 4, "") == "" and cycled_speeds(main, 2, "--speeds 1,1") == "" and \
        cycled_speeds("", 2, "") == ""
    written = tmp_path / "speeds.toml"
    written.write_text('speeds = "1,0.5"\n')                 # (train reads a string too: it was cycled by character)
    assert cycled_speeds(str(written), 3, "") == "1.0,0.5,1.0"
    written.write_text('speeds = [1.0, 0.5]\nsoftsync_n = 2\n')     # (valid with EXTRA_ARGS' strategy: not checked here)
    assert cycled_speeds(str(written), 3, "--strategy nsoftsync") == "1.0,0.5,1.0"
    path = _result(tmp_path / "lost.h5", "running")
    assert lost_ranks(str(path), ["n2"]).endswith("lost rank(s) [2, 3] of 4 (" + str(path) + ")")
    assert "no rank" in lost_ranks(str(path), ["n3"])
