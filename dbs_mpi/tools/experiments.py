"""The experiment grid: jobs/experiments.toml -> one `dbs-mpi train` launch per run.

    python -m dbs_mpi.tools.experiments [--scale small|paper] [--only NAME ...] [--out results/grid]
                                  [--dry-run] [--list] [--mpiexec CMD] [--data-dir DIR]

Each run is `MPIEXEC -n RANKS dbs-mpi train <options> --out OUT/<name>.h5` (one rank:
no launcher), its output in OUT/logs/<name>.log. The grid resumes: a run whose result
file is `complete` is skipped; an `interrupted` one (or a crashed `running` one whose
checkpoint exists) is continued with `--resume`; any other leftover is removed and run
again. Every launch is bounded by the run's `timeout`: past it the job gets SIGUSR1 (it
checkpoints and stops, status `interrupted`: the next invocation continues it), and
SIGKILL if still there `KILL_GRACE` seconds later. A complete run's checkpoint is
deleted and its file gets the root attributes grid_experiment, grid_case, grid_scale,
grid_figures, so that a result file says which grid run it is, and grid_loadavg (the
machine's 1-minute load average before and after the launch: other jobs on the same
cores slow a run down) and grid_elapsed (seconds of the launch, start-up included).

The file format is described at the top of jobs/experiments.toml. This module imports
no MPI: it only starts mpirun.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..options import UserError
from . import config as config_mod

DEFAULT_GRID = "jobs/experiments.toml"
DEFAULT_OUT = "results/grid"
SCALES = ("small", "paper")
RUNNER_KEYS = ("name", "seeds", "ranks", "timeout", "figures", "description", "vary")
KILL_GRACE = 120.0           # seconds between SIGUSR1 (checkpoint and stop) and SIGKILL


@dataclass(frozen=True)
class Run:
    name: str                # file stem: <experiment>-<case>-s<seed>
    experiment: str
    case: str                # the varied values, joined ("" if nothing varies)
    seed: int
    ranks: int
    timeout: float           # seconds this launch may take
    options: dict = field(default_factory=dict)   # dbs-mpi train options (config field -> value)
    figures: tuple = ()

    def matches(self, names) -> bool:
        return not names or any(n in (self.experiment, self.name, *self.figures) for n in names)


def _label(value) -> str:
    if isinstance(value, (list, tuple)):
        return "_".join(_label(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _split(table: dict) -> tuple[dict, dict]:
    """(runner and train keys, per-scale sub-tables) of one TOML table."""
    plain = {k: v for k, v in table.items() if k not in SCALES}
    scaled = {k: v for k, v in table.items() if k in SCALES}
    return plain, scaled


def load_grid(path=DEFAULT_GRID, scale: str = "small") -> list[Run]:
    """Every run of the grid at `scale`, each one's options validated as a Config. An
    experiment's runs come seed by seed, each seed's runs in the order of its cases: the
    cases are then run side by side, so the machine's drift over a long experiment (15% within
    one here) falls on every case alike, not on the cases run last."""
    if scale not in SCALES:
        raise UserError(f"scale: must be one of {', '.join(SCALES)}; got {scale!r}")
    try:
        with open(path, "rb") as f:
            grid = config_mod.tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"grid: no such file {str(path)!r}") from None
    except (OSError, config_mod.tomllib.TOMLDecodeError) as exc:
        raise UserError(f"grid: cannot read {str(path)!r}: {exc}") from None
    unknown = sorted(set(grid) - {"defaults", "scale", "experiment"})
    if unknown:
        raise UserError(f"grid: unknown top-level key {unknown[0]!r} (known: defaults, scale, experiment)")
    base = dict(grid.get("defaults", {}))
    base.update(grid.get("scale", {}).get(scale, {}))
    runs, names = [], set()
    for i, exp in enumerate(grid.get("experiment", [])):
        plain, scaled = _split(exp)
        name = plain.get("name")
        if not name or not isinstance(name, str):
            raise UserError(f"grid: experiment {i + 1} has no name")
        values = {**base, **plain, **scaled.get(scale, {})}
        vary = values.pop("vary", {}) or {}
        if not isinstance(vary, dict) or any(not isinstance(v, list) or not v for v in vary.values()):
            raise UserError(f"grid: {name}: vary must map option names to non-empty lists")
        seeds = values.get("seeds", [0])
        if not isinstance(seeds, list) or not seeds:
            raise UserError(f"grid: {name}: seeds must be a non-empty list")
        cases = [_case(name, list(vary), combo) for combo in itertools.product(*vary.values())]
        for seed in seeds:        # seed-major: every case of a seed runs before the next seed (see below)
            for case_values, labels in cases:
                run = _make_run(name, "-".join(labels), int(seed), {**values, **case_values})
                if run.name in names:
                    raise UserError(f"grid: two runs are named {run.name!r}")
                names.add(run.name)
                runs.append(run)
    return runs


def _case(experiment: str, keys, combo) -> tuple[dict, list]:
    """(options, labels) of one combination of `vary`: a plain value sets its key; a table
    is a bundle of options labelled by its `name` (e.g. {name = "dbs-epoch", strategy =
    "dbs", dbs_interval = "epoch"} among strategies)."""
    options, labels = {}, []
    for key, value in zip(keys, combo):
        if isinstance(value, dict):
            if not isinstance(value.get("name"), str) or not value["name"]:
                raise UserError(f"grid: {experiment}: a table in vary.{key} needs a name (its case's label)")
            options.update({k: v for k, v in value.items() if k != "name"})
            labels.append(value["name"])
        else:
            options[key] = value
            labels.append(_label(value))
    return options, labels


def _make_run(experiment: str, case: str, seed: int, values: dict) -> Run:
    options = {k: v for k, v in values.items() if k not in RUNNER_KEYS}
    options["seed"] = seed
    where = f"grid: {experiment}" + (f" ({case})" if case else "")
    bad = sorted(k for k in options if k not in config_mod.FIELDS or k in ("out", "checkpoint"))
    if bad:
        raise UserError(f"{where}: {bad[0]!r} is not a dbs-mpi train option the grid may set")
    try:
        cfg = config_mod.from_dict(options)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    ranks = int(values.get("ranks", len(cfg.speeds) or 1))
    try:
        config_mod.check_world(cfg, ranks)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    name = "-".join(p for p in (experiment, case, f"s{seed}") if p)
    return Run(name=name, experiment=experiment, case=case, seed=seed, ranks=ranks,
               timeout=float(values.get("timeout", 3600)), options=options,
               figures=tuple(values.get("figures", ())))


def _option_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_option_value(v) for v in value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def default_mpiexec() -> str:
    env = os.environ.get("DBS_MPI_MPIEXEC")
    if env:
        return env
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else (shutil.which("mpirun") or "mpirun")


def dbs_mpi_command() -> list[str]:
    script = Path(sys.executable).parent / "dbs-mpi"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dbs_mpi"]


def launcher(run: Run, mpiexec: str) -> list[str]:
    return (mpiexec.split() + ["-n", str(run.ranks)] if run.ranks > 1 else []) + dbs_mpi_command()


def train_command(run: Run, path: Path, mpiexec: str, data_dir: str | None = None) -> list[str]:
    cmd = launcher(run, mpiexec) + ["train"]
    for key, value in run.options.items():
        cmd += ["--" + key.replace("_", "-"), _option_value(value)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    return cmd + ["--out", str(path)]


def resume_command(run: Run, path: Path, mpiexec: str, data_dir: str | None = None) -> list[str]:
    return launcher(run, mpiexec) + ["train", "--resume", str(path)] + (["--data-dir", data_dir] if data_dir else [])


def file_status(path: Path) -> str | None:
    """The result file's status attribute; None if there is no file, "unreadable" if broken."""
    if not path.exists():
        return None
    import h5py
    try:
        try:   # no HDF5 file lock: the file may be held open by a running job
            f = h5py.File(path, "r", locking=False)
        except OSError as exc:
            if "locking" not in str(exc):
                raise
            f = h5py.File(path, "r")     # this process has it open already; the flags must match
        with f:
            value = f.attrs.get("status", "unreadable")
    except OSError:
        return "unreadable"
    return value.decode() if isinstance(value, bytes) else str(value)


def tag(path: Path, run: Run, scale: str, **extra) -> None:
    """Say in the result file which grid run it is (and extra attributes, e.g. the load)."""
    import h5py
    with h5py.File(path, "a") as f:
        f.attrs["grid_experiment"] = run.experiment
        f.attrs["grid_case"] = run.case
        f.attrs["grid_scale"] = scale
        f.attrs["grid_figures"] = ",".join(run.figures)
        for key, value in extra.items():
            f.attrs[key] = value


def is_tagged(path: Path) -> bool:
    import h5py
    with h5py.File(path, "r") as f:
        return "grid_experiment" in f.attrs


def launch(cmd: list[str], log_path: Path, timeout: float, grace: float = KILL_GRACE) -> tuple[int, bool]:
    """Run cmd in its own process group, output appended to log_path. Returns
    (exit status, timed out). Past `timeout` the launcher gets SIGUSR1 (mpirun forwards it:
    the ranks checkpoint and stop), past `timeout + grace` the whole group gets SIGKILL."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)      # mpirun forwards it to every rank (or it is the one rank)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        log.write(f"[experiments] stopped after the timeout of {timeout:g} s\n")
        return proc.returncode, True


@contextlib.contextmanager
def _lock(out: Path):
    """One runner per output folder at a time."""
    import fcntl
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".experiments.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"out: another experiments runner is using {out}") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_grid(runs: list[Run], out, scale: str, mpiexec: str | None = None, data_dir: str | None = None,
             dry_run: bool = False, log=print) -> dict:
    """Launch every run not complete yet, in order. Returns {name: outcome}, outcome one of
    complete, skipped, failed, timeout (dry_run: would-run, would-resume, skipped)."""
    from ..training.results import checkpoint_path      # (here: listing a grid imports no numpy)
    out = Path(out)
    mpiexec = mpiexec or default_mpiexec()
    outcomes = {}
    with contextlib.nullcontext() if dry_run else _lock(out):
        for i, run in enumerate(runs):
            path = out / f"{run.name}.h5"
            ckpt = checkpoint_path(path)
            status = file_status(path)
            prefix = f"[{i + 1}/{len(runs)}] {run.name}"
            if status == "complete":
                if not dry_run and not is_tagged(path):
                    tag(path, run, scale)
                outcomes[run.name] = "skipped"
                log(f"{prefix}: complete, skipped")
                continue
            resume = status in ("interrupted", "cancelled", "running") and ckpt.exists()
            cmd = resume_command(run, path, mpiexec, data_dir) if resume else train_command(run, path, mpiexec,
                                                                                             data_dir)
            if dry_run:
                outcomes[run.name] = "would-resume" if resume else "would-run"
                log(f"{prefix}: {' '.join(cmd)}")
                continue
            if status is not None and not resume:
                log(f"{prefix}: removing the leftover file (status {status}) and running again")
                path.unlink()
                ckpt.unlink(missing_ok=True)
            elif not resume and ckpt.exists():          # (a new run never overwrites a checkpoint)
                log(f"{prefix}: removing the leftover checkpoint {ckpt} (no result file to resume) and running")
                ckpt.unlink()
            log(f"{prefix}: {'resuming' if resume else 'running'} on {run.ranks} rank(s) "
                f"(timeout {run.timeout:g} s)")
            start, load_start = time.monotonic(), os.getloadavg()[0]
            code, timed_out = launch(cmd, out / "logs" / f"{run.name}.log", run.timeout)
            elapsed = time.monotonic() - start
            status = file_status(path)
            if code == 0 and status == "complete":
                # The machine's 1-minute load average before and after: other jobs share the cores.
                tag(path, run, scale, grid_loadavg=[load_start, os.getloadavg()[0]], grid_elapsed=elapsed)
                ckpt.unlink(missing_ok=True)
                outcomes[run.name] = "complete"
                log(f"{prefix}: complete in {elapsed:.0f} s")
            else:
                outcomes[run.name] = "timeout" if timed_out else "failed"
                log(f"{prefix}: {'timed out' if timed_out else 'failed'} after {elapsed:.0f} s (exit {code}, "
                    f"file status {status}); log: {out / 'logs' / (run.name + '.log')}")
    return outcomes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dbs_mpi.tools.experiments", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default=DEFAULT_GRID, help="the grid file (default: %(default)s)")
    p.add_argument("--scale", default="small", choices=SCALES, help="small: this 2-core machine; paper: a cluster")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="only runs of this experiment, figure or run name (repeatable, or comma-separated)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder of the result files (default: %(default)s)")
    p.add_argument("--mpiexec", default=None, help="MPI launcher (default: $DBS_MPI_MPIEXEC, the venv's mpirun, "
                                                    "mpirun on PATH)")
    p.add_argument("--data-dir", default=None, help="passed to dbs-mpi train")
    p.add_argument("--timeout", type=float, default=None, help="seconds per launch, overriding the grid's")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--list", action="store_true", help="list the runs and their status")
    args = p.parse_args(argv)
    try:
        runs = load_grid(args.grid, args.scale)
        only = [n for item in args.only for n in item.split(",") if n]
        known = {n for r in runs for n in (r.experiment, r.name, *r.figures)}
        missing = [n for n in only if n not in known]
        if missing:
            raise UserError(f"only: {missing[0]!r} is no experiment, figure or run of {args.grid}")
        runs = [r for r in runs if r.matches(only)]
        if args.timeout:
            runs = [dataclasses.replace(r, timeout=args.timeout) for r in runs]
        if args.list:
            for r in runs:
                print(f"{r.name:40s} {r.ranks} ranks  {file_status(Path(args.out) / (r.name + '.h5')) or '-'}")
            return 0
        started = time.monotonic()
        outcomes = run_grid(runs, args.out, args.scale, args.mpiexec, args.data_dir, args.dry_run)
    except UserError as exc:
        print(f"experiments: error: {exc}", file=sys.stderr)
        return 2
    counts = {k: list(outcomes.values()).count(k) for k in sorted(set(outcomes.values()))}
    print(f"{len(outcomes)} run(s): " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + ("" if args.dry_run else f"; {time.monotonic() - started:.0f} s"))
    return 1 if any(v in ("failed", "timeout") for v in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
