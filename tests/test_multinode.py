"""Jobs across nodes, on a real two-node Slurm cluster inside this machine
(scripts/slurm-cluster.sh with DBS_MPI_SLURM_NODES=2): each node is a network, UTS and
mount namespace of its own (hostname node1/node2, an address on a private bridge, its
share of the cores), with its own slurmd; MPI between the nodes goes over TCP through
the bridge. The module starts one such cluster (fresh directory, free ports, its own
bridge and subnet) and tears it down at the end.

What is checked: the job scripts unchanged with `sbatch -N 2` and `qsub -l nodes=2`,
per-node placement (hosts, cores, thread shares, oversubscription) in the result file,
`dbs-mpi info` over both nodes, allocation invariance across nodes (2 nodes x 2 ranks
train the model 1 rank trains), and a node lost in the middle of a run, cut off the
network or killed: the ranks that remain end within the timeout, the job fails, the
result file says `failed` with its finished epochs, and `--resume` continues on the
node that is left. Needs root and network namespaces; skipped with the reason elsewhere.
Every wait is bounded.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from test_jobs import (JOB_MINUTES, ROOT, SCRIPT, TINY, Cluster, _main_toml, _read, _run, _skip_reason, check_result,
                       job_records, qsub_block, report, running_cluster, sbatch_wait, settings, wait_gone)

h5py = pytest.importorskip("h5py")

pytestmark = pytest.mark.timeout(1200)

# --comm-timeout of the runs that lose a node. Until then the ranks left mostly spin, in an
# allreduce that the lost node never finishes (the sleeping wait policy sleeps before the
# allreduce, not in it): 7 CPU-s each at 10 s, measured. The set-up's waits get
# --startup-timeout instead, as long as a launch beside another test suite on 2 cores may need.
COMM_TIMEOUT = 5
STARTUP_TIMEOUT = 60
LOST_NODE_SLACK = 8          # seconds past it within which the job must have ended
HEAL_SECONDS = 5             # `slurm-cluster.sh heal` returns with the node in service within this
# Long enough that a node can be lost in epoch 2 (about 2 s an epoch here), short
# enough that resuming the rest on one node stays quick.
LONG = ("--dataset synthetic --model mlp --synthetic-samples 12000 --global-batch 64 --epochs 3 "
        f"--strategy dbs --speeds 1,1,1,1 --comm-timeout {COMM_TIMEOUT} --startup-timeout {STARTUP_TIMEOUT} "
        "--progress false")


def _namespaces_reason():
    reason = _skip_reason()
    if reason:
        return reason
    for tool in ("ip", "nsenter", "unshare", "taskset"):
        if shutil.which(tool) is None:
            return f"no {tool} (iproute2 / util-linux) to build the nodes"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network/UTS/mount namespaces not allowed here: {probe.stderr.strip()}"
    return None


class Nodes(Cluster):
    def script(self, *args, timeout=120):
        p = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        assert p.returncode == 0, f"slurm-cluster.sh {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"
        return p

    def node_state(self, node):
        env = self.job_env(results="")
        return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], env=env, capture_output=True,
                              text=True, timeout=30).stdout.strip()

    def ranks_on(self, node):
        """PIDs of the `dbs-mpi train` processes running on `node` (in its network namespace):
        its ranks, and any child they have forked."""
        ns = f"dbs{self.env['DBS_MPI_SLURM_PORT']}-{node}"
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"dbs-mpi\x00train\x00" in f.read() and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(int(pid))
            except OSError:
                pass            # gone meanwhile
        return out

    def wait_idle(self, node, timeout=90):
        deadline = time.monotonic() + timeout
        while (state := self.node_state(node)) != "idle":
            assert time.monotonic() < deadline, f"{node} is '{state}', not idle, after {timeout} s"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def nodes(request):
    reason = _namespaces_reason()
    if reason:
        pytest.skip(reason)
    with running_cluster(request, Nodes, "dbs-mpi-slurm-nodes-", 6927, DBS_MPI_SLURM_NODES="2") as cluster:
        status = cluster.script("status", timeout=60)
        assert "slurmd node1: running" in status.stdout and "slurmd node2: running" in status.stdout
        yield cluster
    port = cluster.env["DBS_MPI_SLURM_PORT"]
    left = [n for n in os.listdir("/run/netns") if n.startswith(f"dbs{port}-")] if os.path.isdir("/run/netns") else []
    assert not left, f"stop left a node's namespace behind: {left}"


def _placement(path):
    with h5py.File(path, "r") as f:
        return ([h.decode() if isinstance(h, bytes) else str(h) for h in f.attrs["hostnames"]],
                [str(c.decode() if isinstance(c, bytes) else c) for c in f.attrs["rank_cores"]],
                [int(t) for t in f.attrs["rank_threads"]], bool(f.attrs["oversubscribed"]))


def check_placement(path, per_node):
    """Ranks 0..k-1 on node1, the next on node2; each node's ranks share its cores, the
    nodes' cores differ; threads are the node's cores over its ranks (at most
    OMP_THREAD_LIMIT); oversubscription is judged per node."""
    hosts, cores, threads, over = _placement(path)
    assert hosts == ["node1"] * per_node + ["node2"] * per_node, hosts
    node_cores = {h: {c for c, hh in zip(cores, hosts) if hh == h} for h in ("node1", "node2")}
    assert all(len(s) == 1 for s in node_cores.values()), f"one core set per node: {node_cores}"
    sets = {h: set(next(iter(s)).split(",")) for h, s in node_cores.items()}
    assert not sets["node1"] & sets["node2"], f"the nodes are bound to different cores: {sets}"
    limit = int(os.environ.get("OMP_THREAD_LIMIT") or 0)     # the jobs inherit it (make test sets 1)
    for host, t in zip(hosts, threads):
        assert t == min(max(1, len(sets[host]) // per_node), limit or t), (hosts, cores, threads)
    assert over == any(per_node > len(s) for s in sets.values()), (hosts, cores, over)


def test_slurm_job_across_two_nodes(nodes, tmp_path):
    env = nodes.job_env(tmp_path, EXTRA_ARGS=f"{TINY} --speeds 1,1,0.5,0.5")
    rc, job, out = sbatch_wait(nodes, env, "-N", "2", "--ntasks-per-node=2", "-o", f"{tmp_path}/%x-%j.out",
                               "jobs/slurm/train.sbatch")
    log = _read(tmp_path / f"dbs-mpi-train-{job}.out")
    assert rc == 0, f"sbatch --wait exited {rc}: {out}\njob log:\n{log}"
    assert job_records(nodes, job, 1) == {None: ("COMPLETED", "0:0")}
    assert "4 ranks on node[1-2]" in log, log
    main = _main_toml()
    check_result(tmp_path / f"train-{job}.h5", log, strategy=main["strategy"], seed=main["seed"],
                 speeds=[1, 1, 0.5, 0.5], world_size=4)
    check_placement(tmp_path / f"train-{job}.h5", per_node=2)


def test_any_node_shape_one_task_per_node(nodes, tmp_path):
    """`sbatch -N 2 --ntasks-per-node=1` with jobs/main.toml's 4 speeds: the allocation
    decides (2 ranks), the speeds are cycled to them."""
    env = nodes.job_env(tmp_path, EXTRA_ARGS=TINY)
    rc, job, out = sbatch_wait(nodes, env, "-N", "2", "--ntasks-per-node=1", "-o", f"{tmp_path}/%x-%j.out",
                               "jobs/slurm/train.sbatch")
    log = _read(tmp_path / f"dbs-mpi-train-{job}.out")
    assert rc == 0, f"sbatch --wait exited {rc}: {out}\njob log:\n{log}"
    main = _main_toml()
    check_result(tmp_path / f"train-{job}.h5", log, strategy=main["strategy"], seed=main["seed"],
                 speeds=main["speeds"][:2], world_size=2)
    check_placement(tmp_path / f"train-{job}.h5", per_node=1)
    report("sbatch -N 2 --ntasks-per-node=1", nodes, job, tmp_path / f"dbs-mpi-train-{job}.out",
           tmp_path / f"train-{job}.h5", f"{settings(env)} RESULTS_DIR=$T sbatch --wait -N 2 --ntasks-per-node=1 "
           f"-t {JOB_MINUTES} -o $T/%x-%j.out jobs/slurm/train.sbatch", key="2 ranks on node[1-2]")


def test_pbs_job_across_two_nodes(nodes, tmp_path):
    env = nodes.job_env(tmp_path, EXTRA_ARGS=f"{TINY} --speeds 1,0.5,1,0.5")
    out = tmp_path / "train.out"
    job = qsub_block(nodes, env, "-l", f"nodes=2:ppn=2,walltime=00:{JOB_MINUTES:02d}:00",
                     "-j", "oe", "-o", str(out), "jobs/pbs/train.pbs")
    wait_gone(env, job)
    assert job_records(nodes, job, 1) == {None: ("COMPLETED", "0:0")}, _read(out)
    log = _read(out)
    assert "4 ranks on node1 node2" in log, log          # from $PBS_NODEFILE
    main = _main_toml()
    check_result(tmp_path / f"train-{job}.h5", log, strategy=main["strategy"], seed=main["seed"],
                 speeds=[1, 0.5, 1, 0.5], world_size=4)
    check_placement(tmp_path / f"train-{job}.h5", per_node=2)


# Slurm 22.05's pmi2 server now and then misreads MPICH's business card: slurmstepd logs
# "value not properly terminated in client request", a rank reads a cut card (UCX:
# "failed to unpack address") and fails in MPI_Init, and the ranks that got theirs wait
# there until the start-up limit (600 s for `info`). It came and went on this machine
# (2 of 3 full test runs; 0 of 30 launches by hand): the launcher's fault, not the job's.
# Such a launch is cancelled and tried again; a cluster that misreads every try skips the
# test, saying so. jobs/README.md tells users the same.
PMI2_MISREAD = "mpi/pmi2: value not properly terminated"
SRUN_SECONDS, SRUN_TRIES = 60, 3        # `info` on 4 ranks takes about 4 s


def _srun(env, *args):
    """`srun --mpi=pmi2` of `dbs-mpi ARGS` on both nodes, tried again after a launch that
    Slurm's pmi2 server misread; a launch that runs past SRUN_SECONDS is cancelled."""
    program = ROOT / ".venv" / "bin" / "dbs-mpi"
    srun = ["srun", "--mpi=pmi2", "-J", "dbs-mpi-info", "-N", "2", "--ntasks-per-node=2", "-t", str(JOB_MINUTES),
            str(program) if program.exists() else "dbs-mpi", *args]
    for attempt in range(SRUN_TRIES):
        proc = subprocess.Popen(srun, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=SRUN_SECONDS)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", "-n", "dbs-mpi-info"], env=env, timeout=30)
            out, err = proc.communicate(timeout=60)
            err += f"\n(test: cancelled after {SRUN_SECONDS} s)"
        if PMI2_MISREAD not in err:
            return subprocess.CompletedProcess(srun, proc.returncode, out, err)
        print(f"launch {attempt + 1} misread by Slurm's pmi2 server; stderr: {err[-400:]}")
    pytest.skip(f"Slurm's pmi2 server misread all {SRUN_TRIES} launches ({PMI2_MISREAD!r}): a launcher fault")


def test_info_lists_both_nodes_and_names_the_node_of_a_missing_device(nodes):
    """srun --mpi=pmi2 (Slurm starts the ranks itself) across the nodes: `dbs-mpi info`
    has a line per rank with its node; a device that does not exist on rank 3 is named
    with its node, on every rank, exit 2."""
    env = nodes.job_env(results="")
    p = _srun(env, "info")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = re.findall(r"^\s+(\d+)\s+(node\d)\s+\d+\s+(\d+)\s+(\d+)\s+cpu\b", p.stdout, re.M)
    assert [(r, h) for r, h, _, _ in rows] == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")], p.stdout
    p = _srun(env, "info", "--devices", "cpu,cpu,cpu,cuda")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "dbs-mpi: error: device: cuda requested for rank 3 on node2" in p.stderr, p.stderr
    assert re.search(r"node1: tasks 0-1: Exited with exit code 2", p.stderr), p.stderr
    assert re.search(r"node2: tasks 2-3: Exited with exit code 2", p.stderr), p.stderr


def _final_model(path):
    state = torch.load(f"{path}.ckpt", map_location="cpu", weights_only=True)
    return torch.cat([v.flatten().double() for v in state["model"].values()])


def test_two_nodes_train_the_model_one_rank_trains(nodes, tmp_path):
    """Allocation invariance across nodes: static batch sizes (uneven: emulated speeds),
    2 nodes x 2 ranks, against the same run on 1 rank without MPI."""
    args = f"{TINY} --strategy static --speeds 1,0.5,1,0.25 --seed 5"
    env = nodes.job_env(tmp_path, CONFIG="", EXTRA_ARGS=args, OUT=str(tmp_path / "nodes.h5"))
    rc, job, out = sbatch_wait(nodes, env, "-N", "2", "--ntasks-per-node=2", "-o", f"{tmp_path}/%x-%j.out",
                               "jobs/slurm/train.sbatch")
    assert rc == 0, out + _read(tmp_path / f"dbs-mpi-train-{job}.out")
    one = subprocess.run([sys.executable, "-m", "dbs_mpi", "train", *args.replace("--speeds 1,0.5,1,0.25", "").split(),
                          "--out", str(tmp_path / "one.h5")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout + one.stderr
    with h5py.File(tmp_path / "nodes.h5", "r") as f:
        sizes = f["epoch/batch_sizes"][()]
        assert _placement(tmp_path / "nodes.h5")[0] == ["node1", "node1", "node2", "node2"]
    assert len(set(sizes[0].tolist())) > 1, f"the batch sizes should be uneven: {sizes}"
    torch.testing.assert_close(_final_model(tmp_path / "nodes.h5"), _final_model(tmp_path / "one.h5"),
                               rtol=1e-4, atol=2e-5)


def _start_long_run(nodes, tmp_path):
    """A 2 x 2 run of LONG that does not requeue itself; returns (job, result, log) once
    its first epoch is over and its checkpoint written (the log's epoch line comes first:
    a node cut off while the ranks gathered the checkpoint's parts left none to resume)."""
    result = tmp_path / "lost.h5"
    env = nodes.job_env(tmp_path, CONFIG="", EXTRA_ARGS=LONG, OUT=str(result), REQUEUE="0")
    p = _run(["sbatch", "--parsable", "--no-requeue", "-N", "2", "--ntasks-per-node=2", "-t", str(JOB_MINUTES),
              "-o", f"{tmp_path}/%x-%j.out", "jobs/slurm/train.sbatch"], env)
    job = p.stdout.strip().split(";")[0]
    assert job.isdigit(), p.stdout + p.stderr
    log = tmp_path / f"dbs-mpi-train-{job}.out"
    deadline = time.monotonic() + 120
    while "epoch 1/3" not in _read(log) or not os.path.exists(f"{result}.ckpt"):
        assert time.monotonic() < deadline and "exited with status" not in _read(log), _read(log)
        time.sleep(0.2)
    return job, result, log


def _time_to_end(log, since):
    deadline = since + COMM_TIMEOUT + 60
    while not (m := re.search(r"dbs-mpi train exited with status (\d+)", _read(log))):
        assert time.monotonic() < deadline, f"the job did not end within {deadline - since:.0f} s:\n{_read(log)}"
        time.sleep(0.1)
    return time.monotonic() - since, int(m.group(1))


def _check_failed_with_epochs(result, log):
    with h5py.File(result, "r") as f:
        assert f.attrs["status"] == "failed", _read(log)
        assert len(f["epoch/train_loss"][()]) >= 1
        assert np.isfinite(f["epoch/train_loss"][()]).all()


def test_a_node_cut_off_the_network_ends_the_job_and_the_run_resumes_on_the_other(nodes, tmp_path):
    job, result, log = _start_long_run(nodes, tmp_path)
    try:
        nodes.script("cut", "node2")
        took, status = _time_to_end(log, time.monotonic())
    finally:
        healed = time.monotonic()
        nodes.script("heal", "node2")
        healed = time.monotonic() - healed
    print(f"node2 cut off: the job ended {took:.1f} s later (comm_timeout {COMM_TIMEOUT} s); healed in {healed:.1f} s")
    # heal brings it back to service within seconds (measured 0.02-0.6 s, from down* too; its
    # job may still hold it while its script ends)
    assert nodes.node_state("node2") in ("idle", "alloc", "mix", "comp") and healed < HEAL_SECONDS, \
        (nodes.node_state("node2"), healed)
    assert status != 0, _read(log)
    assert took < COMM_TIMEOUT + LOST_NODE_SLACK, _read(log)
    assert "rank(s) [2, 3] did not arrive" in _read(log), _read(log)
    _check_failed_with_epochs(result, log)
    report(f"node2 cut off the network in epoch 2 (job ended {took:.1f} s later), then healed", nodes, job, log,
           result, f"{settings(nodes.job_env(tmp_path, CONFIG='', EXTRA_ARGS=LONG, OUT='$T/lost.h5', REQUEUE='0'))} "
           f"sbatch --no-requeue -N 2 --ntasks-per-node=2 -t {JOB_MINUTES} -o $T/%x-%j.out jobs/slurm/train.sbatch",
           "scripts/slurm-cluster.sh cut node2    # once the log says epoch 1/3",
           "scripts/slurm-cluster.sh heal node2    # once the job has ended", key="did not arrive")
    # The run goes on where node1 alone can take it: 2 ranks, the same result file.
    nodes.wait_idle("node2")
    env = nodes.job_env(tmp_path, CONFIG="", EXTRA_ARGS=LONG.replace("--speeds 1,1,1,1", "--speeds 1,1"),
                        OUT=str(result))
    rc, job, out = sbatch_wait(nodes, env, "-N", "1", "-n", "2", "-w", "node1", "-o", f"{tmp_path}/%x-%j.out",
                               "jobs/slurm/train.sbatch")
    resumed = _read(tmp_path / f"dbs-mpi-train-{job}.out")
    assert rc == 0, out + resumed
    assert f"resuming {result}" in resumed, resumed
    with h5py.File(result, "r") as f:
        assert f.attrs["status"] == "complete"
        assert len(f["epoch/train_loss"][()]) == 3
        segments = json.loads(f.attrs["segments"])
    assert [(s["world_size"], s["hostnames"]) for s in segments] == [
        (4, ["node1", "node1", "node2", "node2"]), (2, ["node1", "node1"])]
    report("the cut run resumed on node1's 2 ranks", nodes, job, tmp_path / f"dbs-mpi-train-{job}.out", result,
           f"{settings(env).replace(str(result), '$T/lost.h5')} sbatch --wait -N 1 -n 2 -w node1 -t {JOB_MINUTES} "
           "-o $T/%x-%j.out jobs/slurm/train.sbatch", key="resuming")


def test_a_node_killed_ends_the_job(nodes, tmp_path):
    """MPI (Hydra) sees node2's proxy vanish and tears the whole job down at once, rank 0
    included, before it can mark the file: the job script marks it (dbs-mpi close)."""
    job, result, log = _start_long_run(nodes, tmp_path)
    try:
        nodes.script("kill", "node2")
        took, status = _time_to_end(log, time.monotonic())
        deadline = time.monotonic() + 60             # the script's `dbs-mpi close` after the launcher,
        while "dbs-mpi close:" not in _read(log):    # once it has asked which nodes still answer
            assert time.monotonic() < deadline, _read(log)
            time.sleep(0.2)
    finally:
        nodes.script("start", timeout=300)          # node2's slurmd again (idempotent for the rest)
    print(f"node2 killed: the job ended {took:.1f} s later (comm_timeout {COMM_TIMEOUT} s)")
    assert status != 0, _read(log)
    assert took < COMM_TIMEOUT + LOST_NODE_SLACK, _read(log)
    assert "node(s) node2 did not respond: lost rank(s) [2, 3] of 4" in _read(log), _read(log)
    _check_failed_with_epochs(result, log)
    report(f"node2 killed in epoch 2 (job ended {took:.1f} s later)", nodes, job, log, result,
           f"{settings(nodes.job_env(tmp_path, CONFIG='', EXTRA_ARGS=LONG, OUT='$T/lost.h5', REQUEUE='0'))} "
           f"sbatch --no-requeue -N 2 --ntasks-per-node=2 -t {JOB_MINUTES} -o $T/%x-%j.out jobs/slurm/train.sbatch",
           "scripts/slurm-cluster.sh kill node2    # once the log says epoch 1/3", key="did not respond")
    nodes.wait_idle("node2")


def test_rank_0s_node_killed_ends_the_ranks_elsewhere_and_keeps_the_file(nodes, tmp_path):
    """node1 (rank 0, the launcher, the batch script) killed: node2's ranks end within the
    timeout; the file, which nobody is left to mark, stays readable with epoch 1."""
    job, result, log = _start_long_run(nodes, tmp_path)
    assert nodes.ranks_on("node2"), "ranks 2 and 3 run on node2"
    try:
        nodes.script("kill", "node1")
        killed = time.monotonic()
        while nodes.ranks_on("node2"):
            left = nodes.ranks_on("node2")
            assert time.monotonic() < killed + COMM_TIMEOUT + LOST_NODE_SLACK, \
                f"node2's ranks still run {COMM_TIMEOUT + LOST_NODE_SLACK} s after node1 died:\n" + \
                subprocess.run(["ps", "-o", "pid,ppid,stat,etime,wchan:30,args", "-p", ",".join(map(str, left or [1]))],
                               capture_output=True, text=True).stdout
            time.sleep(0.1)
        took = time.monotonic() - killed
    finally:
        nodes.script("start", timeout=300)
    # Its batch script died with node1's slurmd: Slurm would notice only much later.
    subprocess.run(["scancel", job], env=nodes.job_env(results=""), timeout=30)
    print(f"node1 killed: node2's ranks ended {took:.1f} s later (comm_timeout {COMM_TIMEOUT} s)")
    with h5py.File(result, "r") as f:               # readable: no rank holds it any more
        assert f.attrs["status"] == "running"
        assert len(f["epoch/train_loss"][()]) >= 1
    nodes.wait_idle("node1")
    nodes.wait_idle("node2")
