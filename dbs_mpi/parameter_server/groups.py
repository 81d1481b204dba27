"""How the parameter server groups gradients into updates: c gradients per update
(group_size), and rounds (in_rounds), where every worker's gradient is in every update
and the server hands out work as the synchronous path's steps (work.py's Cursor).

Plain functions of the configuration, no torch or MPI: the server (update.py, work.py),
the trainer and the simulator (tools/simulator/parameter_server.py) use the same rule.
"""
from __future__ import annotations


def group_size(strategy: str, workers: int, softsync_n: int) -> int:
    """c: gradients per update of the parameter server. asgd and dbs-sgd: 1; nsoftsync:
    floor(lambda / n) (at least 1)."""
    if strategy == "nsoftsync":
        return max(1, workers // softsync_n)
    return 1


def in_rounds(strategy: str, softsync_wait: bool, softsync_n: int, workers: int) -> bool:
    """Rounds (hardsync): nsoftsync waiting for its updates with c = lambda, every worker's
    gradient in every update (the Cursor's rounds mode)."""
    return strategy == "nsoftsync" and bool(softsync_wait) and group_size(strategy, workers, softsync_n) == workers
