"""The parameter server's state between segments, for checkpoints: what it saves and how
it continues from it, also with another number of workers (docs/method.md, section 8).

A snapshot is taken only between segments, when nothing is in flight (trainer.py,
"Checkpoints"): the weights, the optimizer, the data cursor, the version, the records,
the local batches and dbs-sgd's controller. Another number of workers keeps the server's
state and derives again what depends on lambda: the local batches and the controller
(this server's, made for the new workers), the per-worker columns of the per-epoch
arrays (cut or padded with zeros), the server momentum; rounds continue only into rounds.
"""
from __future__ import annotations

import numpy as np

from ..planning import dynamic
from .records import UPDATE_COLUMNS

RECORDS = ("rows", "applied", "vectors", "stats", "closed", "written", "rows_written", "snapshots", "ends",
           "updates_at_close")                     # ServerRecords' fields
PLAN = ("vector", "controller", "measure")        # the WorkPlan's
OWN = ("messages", "clock")                        # the Server's
PER_WORKER = ("vector", "controller", "measure")   # what another number of workers re-derives
PER_EPOCH = ("applied", "vectors", "stats")        # arrays with a row per epoch


def server_state(server) -> dict:
    """Everything needed to continue, as arrays and plain types (checkpoint.to_safe
    stores the arrays as tensors)."""
    state = {k: getattr(_owner(server, k), k) for k in RECORDS + PLAN + OWN}
    state["version"] = server.rule.version
    controller = server.plan.controller
    state["controller"] = controller.state_dict() if controller is not None else None
    return {"weights": server.weights.clone(), "optimizer": server.rule.optimizer.state_dict(),
            "cursor": {k: v for k, v in vars(server.plan.cursor).items()}, **state}


def load_server_state(server, state: dict, moved: bool = False) -> None:
    """Continue from server_state(); cfg.epochs may have grown (a run extended on resume).
    moved: saved with another number of workers. The optimizer's state carries over with
    this world's server momentum (another lambda / c)."""
    server.weights.copy_(state["weights"])
    rule = server.rule
    rule.optimizer.load_state_dict(state["optimizer"])
    for group in rule.optimizer.param_groups:       # load_state_dict brings the saved hyperparameters
        if "momentum" in group:
            group["momentum"] = rule.momentum
    rule.version = state["version"]
    for k in RECORDS + PLAN + OWN:
        if moved and k in PER_WORKER:
            continue
        owner = _owner(server, k)
        setattr(owner, k, _restored(k, state[k], getattr(owner, k)))
    _restore_cursor(server.plan.cursor, state["cursor"], moved, server.plan.vector)


def _owner(server, k: str):
    return server.records if k in RECORDS else server.plan if k in PLAN else server


def _restored(k: str, value, mine):
    """A saved field as this server keeps it; `mine`: its current value (the shapes)."""
    if k in PER_EPOCH:       # pad to this run's epochs; keep the workers' columns there are
        value = np.asarray(value)
        padded = np.zeros((len(mine), *mine.shape[1:]), dtype=value.dtype)
        if value.ndim == 2:
            columns = min(value.shape[1], mine.shape[1])
            padded[:len(value), :columns] = value[:len(mine), :columns]
        else:
            padded[:len(value)] = value[:len(mine)]
        return padded
    if k == "vector":
        return np.asarray(value, dtype=np.int64).copy()
    if k == "controller":
        return None if value is None else dynamic.DBSController.from_state(value)
    if k == "snapshots":
        return {int(e): np.asarray(w).copy() for e, w in value.items()}
    if k == "measure":
        return [[(int(c), float(t)) for c, t in m] for m in value]
    if k == "rows":          # a checkpoint of an older version lacks the newer columns
        return {name: list(value.get(name, [float("nan")] * len(value["staleness"]))) for name, _ in UPDATE_COLUMNS}
    return value


def _restore_cursor(cursor, saved: dict, moved: bool, vector) -> None:
    saved = {k: v for k, v in saved.items() if k != "epochs"}
    for k in ("vector", "table"):
        if saved.get(k) is not None:
            saved[k] = np.asarray(saved[k], dtype=np.int64).copy()
    if moved:       # the position in the data carries over; the split is the new workers'
        saved = {k: v for k, v in saved.items() if k not in ("workers", "vector", "table", "next_worker")}
    cursor.__dict__.update(saved)
    if moved and cursor.started == cursor.epoch:
        cursor.begin_epoch(vector)    # the epoch's rest (rounds: its remaining steps) for them
