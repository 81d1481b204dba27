"""What a machine file was measured on, and which machine file is this machine's.

A machine file (tools/machine.py) holds one machine's constants: its core's seconds for
every model, its messages, its residuals. Replayed with another machine's constants, a
run is off by as much as the machines differ (20% on a 2-core machine new to the
simulator, issue 55), so `simulate calibrate` records the host it measured (`describe`:
CPU model, logical CPUs, threads per core, memory, the torch and MPI versions, the date),
and writes by default to results/machine/<fingerprint>.json, the file replays on that
hardware then read by default (`machine_file`; results/machine/dev-2core.json, the
development machine's, where none was measured). A replay on a file measured on other
hardware, or on a file that does not say, says so in one line (`elsewhere_note`).

The fingerprint is the hardware only (CPU model, CPUs, threads per core, GiB of memory):
software versions are recorded beside it, not part of it. Nothing here imports torch or
MPI: the simulator reads it.
"""
from __future__ import annotations

import os
import platform
import re
import time
from importlib import metadata
from pathlib import Path

MACHINES = Path(__file__).resolve().parents[2] / "results" / "machine"    # the machine files of the repository
FALLBACK = MACHINES / "dev-2core.json"                                     # the development machine's
CALIBRATE = "mpirun -n 2 dbs-mpi simulate calibrate"                       # what measures this machine's file


def _proc_field(path: str, key: str) -> str:
    """The value of the first `key: value` line of a /proc file ("" if there is none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.split(":")[0].strip() == key:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def threads_per_core(cpu: int = 0) -> int:
    """Hardware threads of a core (2 with SMT): the siblings of CPU `cpu` (1 if Linux does not say)."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return 1
    count = 0
    for part in text.split(","):
        low, _, high = part.partition("-")
        count += int(high) - int(low) + 1 if high else 1
    return max(1, count)


def describe(mpi: str = "") -> dict:
    """This host as a machine file records it: the hardware, the versions, the date."""
    memory = _proc_field("/proc/meminfo", "MemTotal")
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = ""
    return {"cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
            "cpus": os.cpu_count() or 1, "threads_per_core": threads_per_core(),
            "memory_gib": round(int(memory.split()[0]) / 2 ** 20, 1) if memory else 0.0,
            "torch": torch, "mpi": mpi, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M")}


def fingerprint(host: dict) -> str:
    """A file name for the hardware of `host` (describe()), e.g.
    'intel-xeon-processor-2-50ghz-2cpu-1tpc-23gib'; "" for a record without it."""
    if not host.get("cpu"):
        return ""
    cpu = re.sub(r"\((r|tm)\)|\bcpu\b|@", " ", host["cpu"].lower())
    cpu = re.sub(r"[^a-z0-9]+", "-", cpu).strip("-")
    return f"{cpu}-{host['cpus']}cpu-{host['threads_per_core']}tpc-{round(host['memory_gib'])}gib"


def machine_file(folder: Path = MACHINES, host: dict | None = None) -> Path:
    """This machine's file (folder/<fingerprint>.json) if it was calibrated, else the fallback."""
    own = Path(folder) / f"{fingerprint(host or describe())}.json"
    return own if own.is_file() else Path(folder) / FALLBACK.name


def summary(host: dict) -> str:
    return (f"{host['cpu']}, {host['cpus']} CPUs, {host['threads_per_core']} thread(s) a core, "
            f"{host['memory_gib']:.0f} GiB")


def elsewhere_note(recorded: dict, path, here: dict | None = None) -> str:
    """One line when the machine file at `path`, which recorded `recorded` (its `host`),
    was measured on other hardware than `here` (this host) or does not say; else ""."""
    here = here or describe()
    if recorded and fingerprint(recorded) == fingerprint(here):
        return ""
    where = f"on another machine ({summary(recorded)}; this one: {summary(here)})" if recorded.get("cpu") else \
        f"on a machine it does not record (this one: {summary(here)})"
    try:
        path = Path(path).resolve().relative_to(Path.cwd())
    except ValueError:                 # outside the working directory: as given
        pass
    return (f"machine: {path} was measured {where}; for replays of this machine's runs, calibrate it once: "
            f"`{CALIBRATE}` (about 10 minutes; writes results/machine/{fingerprint(here)}.json, which replays "
            f"here then read)")
