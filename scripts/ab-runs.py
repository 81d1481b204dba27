"""Time `dbs-mpi train` runs side by side: two code revisions, or two sets of options.

    .venv/bin/python scripts/ab-runs.py --variant before=371e310 --variant after=. --repeats 3
    .venv/bin/python scripts/ab-runs.py --variant fast=. --variant dataloader=.:--loader,dataloader

A variant is NAME=REV[:ARG,ARG,...]: REV is a git revision (exported with `git archive`
into a temporary folder and run from there with this venv's Python) or `.` for the
working tree; the ARGs are added to the training command. Every repeat runs each
variant once, in alternating order (the machine's drift hits all variants alike), the
same job (default: the main job, jobs/main.toml, NP ranks). Reported per variant: the
median over repeats of the run's median epoch time (epoch 1 excluded when there are
more: it includes start-up effects), and the ratio of every variant to the first, per
repeat and as the median of those ratios. Runs with more ranks than cores are marked.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent


def export(rev: str, folder: Path) -> Path:
    """The code of `rev` in folder/rev (the working tree for '.')."""
    if rev == ".":
        return ROOT
    dest = folder / rev.replace("/", "_")
    if not dest.exists():
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def epoch_time(path: Path) -> tuple[float, bool]:
    with h5py.File(path, "r") as f:
        durations = list(f["epoch/duration"][()])
        oversubscribed = bool(f.attrs.get("oversubscribed", False))
    return statistics.median(durations[1:] if len(durations) > 1 else durations), oversubscribed


def run(code: Path, args: list[str], out: Path, ranks: int, mpiexec: str, timeout: float) -> float:
    """One training run of the code in `code`; returns its median epoch time."""
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "dbs_mpi", "train", *args, "--out", str(out),
           "--progress", "false"]
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {code}:\n{proc.stderr[-3000:]}")
    return epoch_time(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, help="NAME=REV[:ARG,ARG,...] (twice or more)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--np", type=int, default=4, help="ranks per run")
    p.add_argument("--job", default=f"--config,{ROOT / 'jobs/main.toml'},--data-dir,{ROOT / 'data'}",
                   help="the training options every variant gets (comma-separated)")
    p.add_argument("--mpiexec", default=str(VENV / "mpirun"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    a = p.parse_args()
    variants = []
    for spec in a.variant:
        name, _, rest = spec.partition("=")
        rev, _, extra = rest.partition(":")
        variants.append((name, rev, [x for x in extra.split(",") if x]))
    job = [x for x in a.job.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="ab-runs-") as tmp:
        folder = Path(tmp)
        codes = {name: export(rev, folder / "code") for name, rev, _ in variants}
        times = {name: [] for name, _, _ in variants}
        marked = False
        for rep in range(a.repeats):
            order = variants if rep % 2 == 0 else variants[::-1]
            for name, _, extra in order:
                t, over = run(codes[name], job + extra, folder / f"{name}-{rep}.h5", a.np, a.mpiexec, a.timeout)
                times[name].append(t)
                marked |= over
                print(f"repeat {rep + 1}/{a.repeats}  {name:<12} median epoch {t:.3f} s", flush=True)
    base = variants[0][0]
    print(f"\n{a.np} rank(s){' [oversubscribed: more ranks than cores]' if marked else ''}; job: {' '.join(job)}")
    print(f"{'variant':<12} {'median epoch s':>15}  repeats")
    for name, _, extra in variants:
        print(f"{name:<12} {statistics.median(times[name]):>15.3f}  "
              + " ".join(f"{t:.3f}" for t in times[name]) + (f"   ({' '.join(extra)})" if extra else ""))
    for name, _, _ in variants[1:]:
        ratios = [t / b for t, b in zip(times[name], times[base])]
        print(f"{name}/{base} epoch-time ratio: median {statistics.median(ratios):.3f} "
              f"(repeats {' '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
