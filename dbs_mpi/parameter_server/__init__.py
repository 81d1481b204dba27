"""Asynchronous strategies on a parameter server over MPI: asgd, nsoftsync, dbs-sgd.

Rank 0 is the server: it holds the parameters and applies every update (cfg.optimizer:
SGD with momentum by default, Adam or AdamW; cfg.lr). Ranks 1..n-1 are the workers (lambda = n - 1 learners): a worker
gets weights and a piece of work, computes the gradient on its local batch, pushes
it and waits for the next weights. docs/method.md, "Asynchronous strategies", has the
rules with their sources: Zhang et al. (IJCAI 2016) for asgd / n-softsync and the
staleness-dependent learning rate, Ji et al. for dbs-sgd.

Strategies (what the server does with arriving gradients)
  asgd       apply every gradient on arrival (c = 1).
  nsoftsync  apply after collecting c = floor(lambda / n) gradients from any workers
             (n = cfg.softsync_n; n = lambda is asgd). By default (Zhang et al.) a worker
             gets the current weights at once after its push, applied or not, so tau is
             about n and 1-softsync is *not* hardsync (tau about 1). With
             cfg.softsync_wait a worker gets new weights only once its gradient has been
             applied: with n = 1 every update averages all workers' gradients computed on
             the same weights (hardsync, tau = 0), the same updates as the synchronous
             ssgd path with global batch = the sum of the local batches.
  dbs-sgd    asgd whose local batches are sized from each worker's measured compute
             speed (start-up benchmark, then re-planned at every epoch from the compute
             times the workers report with their gradients; dynamic.DBSController:
             affine step-time model, dead band), so that every worker's iteration takes
             about the same time and no fast worker floods the server: staleness stays
             about lambda - 1 instead of growing with the speed ratio.
  asgd and nsoftsync split cfg.global_batch equally over the workers.

The files, bottom up:
  groups.py    the gradients per update (c) and rounds (hardsync): the group rule
  protocol.py  the messages (tags, headers, one flat buffer each) and the parameters and
               gradients that live in them
  update.py    the update rule: c gradients per update, their weights, the divisor, the
               server's momentum, the optimizer
  records.py   a row per applied gradient, statistics per epoch, the epoch records
  snapshot.py  the server's state between segments (checkpoints, another number of workers)
  work.py      what the server hands out: the samples (the Cursor), the local batches, the
               budget
  server.py    rank 0's loop: hand out work, take in gradients, apply, reply
  worker.py    ranks 1..n-1: compute the gradient of the work given, push it
  trainer.py   AsyncTrainer: set up, run in segments, evaluate and write epochs,
               checkpoints and stop requests

Not supported here: models with floating-point buffers (BatchNorm statistics: use
norm = "group").
"""
import importlib

from .groups import group_size, in_rounds
from .records import UPDATE_COLUMNS, epoch_record, staleness_stats
from .work import Cursor

# The names whose modules load torch and MPI, imported on first use: the simulator reads
# the Cursor and the group rule (work.py, groups.py) without either.
_LAZY = {
    "HEADER": "protocol", "Message": "protocol", "bind_gradients": "protocol", "bind_parameters": "protocol",
    "Server": "server", "AsyncTrainer": "trainer", "initial_vector": "trainer", "server_momentum": "update",
    "Worker": "worker",
}

__all__ = ["AsyncTrainer", "Cursor", "HEADER", "Message", "Server", "UPDATE_COLUMNS", "Worker", "bind_gradients",
           "bind_parameters", "epoch_record", "group_size", "in_rounds", "initial_vector", "server_momentum",
           "staleness_stats"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
