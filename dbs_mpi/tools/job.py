"""What the job scripts in jobs/ ask before and after `dbs-mpi train` (`dbs-mpi job`).

A batch job must continue only a run it owns. Job IDs are not unique for ever: they
start again at 1 on a fresh scheduler state, and a complete run keeps its checkpoint.
So every run records a run ID (`run_id`, from DBS_MPI_RUN_ID) beside the scheduler's
job ID and array index (`job_id`, `array_index`), and a job script decides with `plan`:

* first start of a job: always a new result file, `<base>.h5`, or `<base>.2.h5`, ...
  when that name is taken by another run (whose file is never touched);
* a start after a requeue (the scheduler says so): the file whose `run_id` is this
  job's: resumed from its checkpoint, or nothing to do if it is complete;
* `OUT=` given by hand: that file, resumed if it has a checkpoint (on purpose, any run).

The job scripts keep the run ID where a requeue finds it again (Slurm: the job's
comment; PBS: a file the script writes before it requeues). `lost` names the ranks a
vanished node took with it (the result file's `hostnames`).

No MPI and no torch here: a login node answers at once.
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..options import UserError
from ..training.results import STATUS_COMPLETE, checkpoint_path, read_run
from .config import field_value, load_toml


def scheduler_job(environ) -> dict:
    """The scheduler's job ID and array index of this process ("" outside a job), and
    the run ID the job script gave it."""
    job = environ.get("SLURM_JOB_ID") or environ.get("PBS_JOBID", "")
    index = environ.get("SLURM_ARRAY_TASK_ID") or environ.get("PBS_ARRAYID", "")
    return {"job_id": job, "array_index": index, "run_id": environ.get("DBS_MPI_RUN_ID", "")}


@dataclass
class Plan:
    action: str          # new | resume | done
    out: Path
    note: str = ""       # what the job's log should say about the choice

    def shell(self) -> str:
        return f"ACTION={self.action} OUT={shlex.quote(str(self.out))} NOTE={shlex.quote(self.note)}"


def _attrs(path: Path) -> dict:
    try:
        return read_run(path, datasets=False)["attrs"]
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(f"job: {path} exists but is not a readable result file ({exc}); move it away") from None


def _checkpoint(path: Path) -> bool:
    return checkpoint_path(path).is_file()


def _continue(path: Path, attrs: dict, why: str) -> Plan:
    status = attrs.get("status", "")
    if status == STATUS_COMPLETE:
        return Plan("done", path, f"{path} is complete ({why}): nothing to do")
    if _checkpoint(path):
        return Plan("resume", path, f"resuming {path} ({why}, status {status})")
    return Plan("new", path, "")


def plan(base: str, run_id: str, restart: bool, out: str = "") -> Plan:
    """Where this job's run goes (see the module docstring). base: the result path
    without `.h5`; out: a path given by hand (OUT=)."""
    if out:
        path = Path(out)
        return _continue(path, _attrs(path), "given as OUT") if path.exists() else Plan("new", path)
    candidates = [Path(f"{base}.h5")] + [Path(f"{base}.{n}.h5") for n in range(2, 1000)]
    taken = []
    for path in candidates:
        if not path.exists() and _checkpoint(path):     # (a result moved away, its checkpoint left: not new)
            taken = taken or [path, "a checkpoint without its result file"]
            continue
        if not path.exists():
            if restart:        # requeued, but no file of ours: start it (nothing of another run is touched)
                return Plan("new", path, f"requeued, but no result file of run {run_id} under {base}*: starting")
            note = f"{taken[0]} belongs to another run ({taken[1]}): writing {path}" if taken else ""
            return Plan("new", path, note)
        attrs = _attrs(path)
        if restart and run_id and attrs.get("run_id") == run_id:
            plan_ = _continue(path, attrs, f"requeued run {run_id}")
            if plan_.action != "new":
                return plan_
        if not taken:
            who = f"job {attrs['job_id']}, run {attrs.get('run_id') or '?'}" if attrs.get("job_id") else "not a job's"
            taken = [path, f"{who}, status {attrs.get('status', '?')}"]
    raise UserError(f"job: every result name {base}.h5 .. {base}.999.h5 is taken; set OUT or RESULTS_DIR")


def cycled_speeds(config: str, ntasks: int, extra: str) -> str:
    """The config's `speeds` cycled to the job's ranks (rank i takes speed i mod len), or
    "" where nothing needs it: no config, no speeds, already as many, or EXTRA_ARGS set
    --speeds (the rule of `make run NP=N`)."""
    if not config or "--speeds" in extra.split():
        return ""
    speeds = field_value("speeds", load_toml(config).get("speeds") or [])    # (train reads "1,0.5" too)
    if not speeds or len(speeds) == ntasks:
        return ""
    return ",".join(str(speeds[i % len(speeds)]) for i in range(ntasks))


def lost_ranks(path: str, nodes: list[str]) -> str:
    """One line naming the ranks of the run in `path` that ran on `nodes` (gone)."""
    hostnames = [h.decode() if isinstance(h, bytes) else str(h) for h in _attrs(Path(path)).get("hostnames", [])]
    ranks = [r for r, host in enumerate(hostnames) if str(host) in nodes]
    where = ", ".join(nodes)
    if not ranks:
        return f"node(s) {where} did not respond; no rank of {path} ran there"
    return f"node(s) {where} did not respond: lost rank(s) {ranks} of {len(hostnames)} ({path})"


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="dbs-mpi job", description="What jobs/*.sbatch and jobs/*.pbs ask: where a "
                                "job's run goes (plan), and which ranks a lost node took (lost). No MPI.")
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("plan", help="print ACTION=new|resume|done OUT=... NOTE=... SPEEDS=... for the job script")
    a.add_argument("--base", required=True, help="the result path without .h5 (results/train-<job id>)")
    a.add_argument("--run-id", default="", help="this job's run ID")
    a.add_argument("--restart", action="store_true", help="the scheduler restarted (requeued) this job")
    a.add_argument("--out", default="", help="OUT given by hand: that file, resumed if it can be")
    a.add_argument("--config", default="", help="CONFIG, whose speeds are cycled to --ntasks")
    a.add_argument("--ntasks", type=int, default=0)
    a.add_argument("--extra", default="", help="EXTRA_ARGS (a --speeds there wins)")
    b = sub.add_parser("lost", help="name the ranks of RESULT.h5 that ran on the given nodes")
    b.add_argument("result")
    b.add_argument("nodes", nargs="+")
    args = p.parse_args(argv)
    if args.what == "plan":
        chosen = plan(args.base, args.run_id, args.restart, args.out)
        speeds = cycled_speeds(args.config, args.ntasks, args.extra) if args.ntasks else ""
        print(f"{chosen.shell()} SPEEDS={shlex.quote(speeds)}")
    else:
        print(lost_ranks(args.result, args.nodes))
    return 0
