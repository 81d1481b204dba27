"""`dbs-mpi bench hetero`: epoch time of ssgd, static and dbs under emulated speeds; the
ssgd/dbs ratio against mean(v)/min(v), and static/dbs against the ideal N / sum_i v_i +
measured communication (target: within 10%).
"""
from __future__ import annotations

import numpy as np

from ...planning import sharding
from .harness import _config, _on_first, _oversubscribed, _train_epoch, train_samples
from .report import _flag, _med, _reps, check


def case_hetero(comm, args, folder) -> dict:
    if args.speeds == "none":
        return _on_first(comm, comm.Get_size(), _hetero, args, folder)
    speeds = [float(s) for s in args.speeds.split(",") if s]
    return _on_first(comm, len(speeds), _hetero, args, folder)


def ideal_epoch_time(record: dict, samples: int, global_batch: int) -> dict:
    """N / sum_i v_i plus what no allocation can divide: the measured communication,
    optimiser update and data time (means over ranks). v_i is rank i's measured speed
    in this epoch (samples per second of pre-collective compute)."""
    if "rank_samples" in record:                  # dbs may have changed the vector within the epoch
        per_rank = np.asarray(record["rank_samples"])
    else:
        per_rank = sharding.step_batch_sizes(samples, global_batch, np.asarray(record["batch_sizes"])).sum(axis=0)
    speed = np.asarray(record["speed"], dtype=float)
    update = np.asarray(record["compute_time"], dtype=float) - per_rank / np.maximum(speed, 1e-12)
    compute = samples / float(speed.sum())
    comm_t = float(np.mean(record["comm_time"]))
    rest = float(np.mean(update + np.asarray(record["data_time"], dtype=float)))
    return {"compute": compute, "comm": comm_t, "update_data": rest, "ideal": compute + comm_t + rest}


def _hetero(comm, args, folder) -> dict:
    strategies = [s for s in args.strategies.split(",") if s]
    repeats = args.repeats or 3
    base = _config(args, global_batch=args.global_batch, speeds="" if args.speeds == "none" else args.speeds,
                   subset=args.subset, test_subset=1000, threads=0)
    samples = train_samples(base)
    times = {s: [] for s in strategies}
    ideal = {s: [] for s in strategies}
    parts = {s: [] for s in strategies}
    accuracy = {s: [] for s in strategies}
    vectors, measured = {}, {}
    for rep in range(repeats):
        for strategy in (strategies if rep % 2 == 0 else strategies[::-1]):
            rec = _train_epoch(comm, base.replace(strategy=strategy, seed=rep), folder / f"{strategy}-{rep}.h5")
            measured[strategy] = np.asarray(rec["speed"], dtype=float).tolist()
            part = ideal_epoch_time(rec, samples, base.global_batch)
            times[strategy].append(float(rec["duration"]))
            accuracy[strategy].append(float(rec["test_accuracy"]))
            ideal[strategy].append(part["ideal"])
            parts[strategy].append(part)
            vectors[strategy] = np.asarray(rec["batch_sizes"]).tolist()
    # mean(v)/min(v): the emulated speeds, or (real heterogeneity) the speeds ssgd measured
    speeds = np.array(base.speeds) if base.speeds else np.asarray(measured[strategies[0]], dtype=float)
    ideal_ratio = float(speeds.mean() / speeds.min())
    baseline = strategies[0]
    ratios = {s: [b / t for b, t in zip(times[baseline], times[s])] for s in strategies[1:]}
    to_ideal = {s: [t / i for t, i in zip(times[s], ideal[s])] for s in strategies}
    checks = [check(f"{baseline}/{s} epoch time / ideal mean(v)/min(v)={ideal_ratio:.2f}",
                    _med(ratios[s]) / ideal_ratio, 0.90, ">=") for s in strategies[1:]]
    checks += [check(f"{s} epoch time / (N/sum v_i + comm)", _med(to_ideal[s]), 1.10, "<=")
               for s in strategies if s != "ssgd"]
    return {"case": "hetero", "speeds": list(base.speeds) or "measured", "measured_speeds": measured,
            "devices": list(base.devices) or base.device, "global_batch": base.global_batch, "samples": samples,
            "ideal": ideal_ratio, "world_size": comm.Get_size(), "repeats": repeats, "times": times,
            "test_accuracy": accuracy, "batch_sizes": vectors, "ideal_time": ideal, "ideal_parts": parts,
            "oversubscribed": _oversubscribed(comm), "folder": str(folder), "ratios": ratios,
            "median_ratio": {s: _med(r) for s, r in ratios.items()}, "to_ideal": to_ideal, "checks": checks}


def format_hetero(report: dict) -> str:
    measured = {k: [round(v) for v in vs] for k, vs in report.get("measured_speeds", {}).items()}
    lines = [f"bench hetero: {report['world_size']} ranks, devices {report.get('devices', 'cpu')}, speeds "
             f"{report['speeds']}, global batch {report['global_batch']}, {report['repeats']} repeats" + _flag(report),
             f"measured speeds (samples/s of compute, last repeat): {measured}",
             f"{'strategy':<10} {'batch sizes':<22} {'epoch s (median)':>16} {'ideal s':>8} {'test acc':>8} "
             f"{'all repeats':<28}"]
    for s, ts in report["times"].items():
        accuracy = report.get("test_accuracy", {}).get(s, [float("nan")])
        lines.append(f"{s:<10} {str(report['batch_sizes'][s]):<22} {_med(ts):>16.3f} "
                     f"{_med(report['ideal_time'][s]):>8.3f} {_med(accuracy):>8.3f} {_reps(ts):<28}")
    ideal = report["ideal"]
    base = next(iter(report["times"]))
    for s, ratio in report["median_ratio"].items():
        verdict = "meets" if ratio >= 0.9 * ideal else "misses"
        lines.append(f"{base}/{s} epoch-time ratio: median {ratio:.3f} (repeats {_reps(report['ratios'][s])}); "
                     f"ideal mean(v)/min(v) = {ideal:.3f}; {ratio / ideal:.2f} of ideal, target >= 0.90: {verdict}")
    for s, r in report["to_ideal"].items():
        part = report["ideal_parts"][s][0]
        lines.append(f"{s} epoch time / ideal (N/sum v_i {part['compute']:.3f} s + comm {part['comm']:.3f} s + "
                     f"update and data {part['update_data']:.3f} s, first repeat): median {_med(r):.3f} "
                     f"(repeats {_reps(r)})")
    return "\n".join(lines)
