"""What a case reports: its checks (a measured ratio against its target), the final table
of every case's checks, and the result file (HDF5: a group per case).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np


def check(name: str, value: float, target: float | None, op: str = "<=") -> dict:
    """One line of the final table: a measured ratio against its target (None = report only)."""
    met = None if target is None else bool(value <= target if op == "<=" else value >= target)
    return {"name": name, "value": float(value), "target": target, "op": op, "met": met}


def format_table(reports: list[dict]) -> str:
    lines = [f"{'case':<9} {'measure':<56} {'median':>8} {'target':>9}  verdict"]
    for r in reports:
        for c in r["checks"]:
            target = "-" if c["target"] is None else f"{c['op']} {c['target']:.2f}"
            verdict = "info" if c["met"] is None else ("met" if c["met"] else "MISSED")
            lines.append(f"{r['case']:<9} {c['name']:<56} {c['value']:>8.3f} {target:>9}  {verdict}")
    return "\n".join(lines)


def _flag(report: dict) -> str:
    return "  [OVERSUBSCRIBED: more ranks than cores]" if report.get("oversubscribed") else ""


def _med(xs) -> float:
    return float(statistics.median(xs))


def _reps(xs, fmt="{:.3f}") -> str:
    return " ".join(fmt.format(x) for x in xs)


def _write_arrays(group, prefix: str, value) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _write_arrays(group, f"{prefix}/{k}" if prefix else str(k), v)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        group[prefix] = np.asarray(value, dtype=float)


def write_report(reports: list[dict], path: Path, attrs: dict) -> None:
    """One HDF5 file: per case a group with the report (JSON attribute) and its number
    lists as datasets; the run's versions and hosts as root attributes."""
    import h5py
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        for r in reports:
            g = f.create_group(r["case"])
            g.attrs["report"] = json.dumps(r)
            _write_arrays(g, "", {k: v for k, v in r.items() if k != "checks"})
            g["check_value"] = np.asarray([c["value"] for c in r["checks"]], dtype=float)
            g.attrs["check_names"] = json.dumps([c["name"] for c in r["checks"]])
