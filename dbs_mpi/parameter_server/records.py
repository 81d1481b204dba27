"""What the parameter server records: a row per applied gradient, statistics per epoch.

Results (rank 0's HDF5 file, besides the usual epoch/* records): one row per applied
gradient in update/staleness, update/worker (rank), update/time (seconds since the
start of training, when applied), update/local_batch, update/loss, update/epoch,
update/version (server version it was applied at) and update/timestamp (version it was
computed on); per epoch staleness_mean/max/p50/p90/p99, updates, samples and
gradients (per rank); root attributes with the whole run's staleness distribution.
The server's row in the per-rank epoch records is: batch 0, compute = aggregation and
optimizer step, comm = receiving and replying, wait = idle polling.
"""
from __future__ import annotations

import numpy as np

# Per-rank, per-epoch statistics gathered at the end: columns of one (epochs, K) array.
C_COMPUTE, C_COMM, C_WAIT, C_DATA, C_SAMPLES, C_GRADIENTS = range(6)   # every rank
S_LOSS, S_DURATION, S_UPDATES, S_STALE_MEAN, S_STALE_MAX, S_P50, S_P90, S_P99 = range(6, 14)  # server only
S_VECTOR = 14                                                          # server only: lambda local batches
PERCENTILES = (50, 90, 99)

UPDATE_COLUMNS = (("staleness", np.int64), ("worker", np.int64), ("time", np.float64), ("local_batch", np.int64),
                  ("loss", np.float64), ("epoch", np.int64), ("version", np.int64), ("timestamp", np.int64),
                  ("weight", np.float64), ("step_norm", np.float64))


def staleness_stats(staleness) -> tuple[float, float, list[float]]:
    """(mean, max, [p50, p90, p99]) of an array of staleness values; zeros if empty."""
    s = np.asarray(staleness, dtype=np.float64)
    if s.size == 0:
        return 0.0, 0.0, [0.0] * len(PERCENTILES)
    return float(s.mean()), float(s.max()), [float(v) for v in np.percentile(s, PERCENTILES)]


class ServerRecords:
    """Rank 0's records: the update rows, the per-epoch statistics (stats: columns C_* and
    S_*), the samples applied and the local batches per epoch, and the weights at the end
    of every closed epoch until they are evaluated and written."""

    def __init__(self, epochs: int, workers: int):
        self.rows = {k: [] for k, _ in UPDATE_COLUMNS}
        self.applied = np.zeros(epochs, dtype=np.int64)       # samples applied, per epoch of the samples
        self.vectors = np.zeros((epochs, workers), dtype=np.int64)
        self.stats = np.zeros((epochs, S_VECTOR + workers))
        self.closed = 0                              # epochs whose samples have all been applied
        self.written = 0                             # closed epochs evaluated and in the result file
        self.rows_written = 0                        # update rows in the result file
        self.snapshots: dict[int, np.ndarray] = {}  # weights at the end of closed, unwritten epochs
        self.ends: list[float] = []                 # seconds since the start at which each epoch closed
        self.updates_at_close = 0

    def charge(self, column: int, seconds: float) -> None:
        """Seconds of the server's compute, comm or wait, to the epoch being applied."""
        self.stats[min(self.closed, len(self.stats) - 1), column] += seconds

    def add_group(self, group, divisor: float, step_norm: float, version: int, at: float) -> None:
        """The rows of an update applied at server version `version`, `at` seconds into training."""
        rows = self.rows
        for w, timestamp, count, loss, epoch, weight in group:
            rows["weight"].append(weight / divisor)
            rows["step_norm"].append(step_norm)
            rows["staleness"].append(version - timestamp)
            rows["worker"].append(w + 1)
            rows["time"].append(at)
            rows["local_batch"].append(count)
            rows["loss"].append(loss)
            rows["epoch"].append(epoch)
            rows["version"].append(version)
            rows["timestamp"].append(timestamp)
            self.applied[epoch] += count

    def close_epochs(self, per_epoch: int, version: int, clock, weights, log, final: bool = False) -> None:
        """Epoch e ends when all its samples (per_epoch), and all of the epochs before, are
        applied; with a time budget the last epoch may end short (final=True, at the end).
        clock(): seconds since the start; weights: the server's, copied for evaluation."""
        epochs = len(self.applied)
        while self.closed < epochs:
            e = self.closed
            if not (self.applied[e] >= per_epoch or (final and self.applied[e] > 0)):
                break
            end = clock()
            s = self._epoch_statistics(e, version, end)
            self.ends.append(end)
            self.updates_at_close = version
            self.snapshots[e] = weights.numpy().copy()
            self.closed += 1
            log(f"epoch {e + 1}/{epochs} trained: train loss {s[S_LOSS]:.4f}, {int(s[S_UPDATES])} updates, "
                f"staleness mean {s[S_STALE_MEAN]:.2f} max {int(s[S_STALE_MAX])}, time {s[S_DURATION]:.2f} s, "
                f"local batches {self.vectors[e].tolist()}")

    def write_rows(self, writer) -> None:
        """Append the update rows applied since the last call to the result file."""
        for name, dtype in UPDATE_COLUMNS:
            writer.append_rows(f"update/{name}", np.asarray(self.rows[name][self.rows_written:], dtype=dtype),
                               dtype=dtype)
        self.rows_written = len(self.rows["staleness"])

    def write_staleness(self, writer, **attrs) -> str:
        """The whole run's staleness distribution and `attrs` as root attributes; returns
        a line that says it."""
        staleness = self.rows["staleness"]
        mean, high, pct = staleness_stats(staleness)
        writer.set_attrs(staleness_mean=mean, staleness_max=high, staleness_percentiles=np.asarray(pct),
                         staleness_percentile_levels=np.asarray(PERCENTILES), gradients=len(staleness),
                         training_time=float(self.ends[-1]) if self.ends else 0.0, **attrs)
        return (f"staleness over {len(staleness)} gradients in {attrs.get('updates', '?')} updates: mean {mean:.2f}, "
                f"p50 {pct[0]:g}, p90 {pct[1]:g}, p99 {pct[2]:g}, max {int(high)}")

    def _epoch_statistics(self, e: int, version: int, end: float) -> np.ndarray:
        rows = np.asarray(self.rows["epoch"]) == e
        staleness = np.asarray(self.rows["staleness"])[rows]
        counts = np.asarray(self.rows["local_batch"], dtype=np.float64)[rows]
        losses = np.asarray(self.rows["loss"])[rows]
        mean, high, pct = staleness_stats(staleness)
        s = self.stats[e]
        s[S_LOSS] = float((losses * counts).sum() / max(counts.sum(), 1))
        s[S_DURATION] = end - (self.ends[-1] if self.ends else 0.0)
        s[S_UPDATES] = version - self.updates_at_close
        s[S_STALE_MEAN], s[S_STALE_MAX] = mean, high
        s[S_P50], s[S_P90], s[S_P99] = pct
        s[S_VECTOR:] = self.vectors[e]
        s[C_SAMPLES] = self.applied[e]
        s[C_GRADIENTS] = rows.sum()
        return s


def epoch_record(gathered, e: int, workers: int, test_loss: float, test_acc: float, eval_time: float) -> dict:
    """Epoch e's record from every rank's statistics (gathered: (world, epochs, K))."""
    s = gathered[0, e]
    compute, samples = gathered[:, e, C_COMPUTE], gathered[:, e, C_SAMPLES]
    speed = np.where(compute > 0, samples / np.maximum(compute, 1e-12), 0.0)
    speed[0] = 0.0
    return dict(
        train_loss=float(s[S_LOSS]), test_loss=test_loss, test_accuracy=test_acc,
        duration=float(s[S_DURATION]), eval_time=eval_time,
        batch_sizes=np.concatenate([[0], s[S_VECTOR:S_VECTOR + workers]]).astype(np.int64),
        compute_time=gathered[:, e, C_COMPUTE], comm_time=gathered[:, e, C_COMM],
        wait_time=gathered[:, e, C_WAIT], data_time=gathered[:, e, C_DATA], speed=speed,
        samples=np.int64(s[C_SAMPLES]), updates=np.int64(s[S_UPDATES]),
        gradients=np.concatenate([[s[C_GRADIENTS]], gathered[1:, e, C_GRADIENTS]]).astype(np.int64),
        staleness_mean=float(s[S_STALE_MEAN]), staleness_max=float(s[S_STALE_MAX]),
        **{f"staleness_p{q}": float(s[S_P50 + i]) for i, q in enumerate(PERCENTILES)})
