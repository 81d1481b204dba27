"""Clipping the global gradient, and a warning where a loop changed its local one.

Clipping is not linear: the norm of one rank's part is not the norm of the whole, so
clipping each rank's gradient before the exchange trains another model than one process
would (a 2-rank run with torch.nn.utils.clip_grad_norm_ between backward and step
differed from 1 rank by 4.9e-3 in relative L2; dbs_mpi.clip_grad_norm_ by 4.8e-7).
`clip_grad_norm_` exchanges the gradient first and clips the sum, the same on every rank.

`LocalEdits` notices the mistake: every in-place change of a tensor moves its version
counter on, and a .grad that views the exchange's flat buffer (exchange.py) shares the
buffer's. The counters of the .grad tensors (views, or ones a set_to_none zero_grad let
backward make anew) are summed when each backward of the step ends
(a callback queued from a pre-hook on the output's autograd node, set by a forward
hook: one Python call per forward and per backward, none per parameter); where it has
moved by the time the exchange starts, something changed the local gradient in place,
and the rank warns once, at the user's line. GradScaler's unscale_ moves no counter (its
kernel bypasses them), and it is exact anyway: every rank divides by the same factor.
A compiled model runs no forward hook: no reading, no warning.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from ..options import user_stacklevel

LOCAL_EDIT = ("the gradients were changed in place between backward() and the exchange (torch.nn.utils."
              "clip_grad_norm_ on the local gradients?): each rank changed its own part, so the update is not the one "
              "a single process makes on the global batch. Clip the global gradient with dbs_mpi.clip_grad_norm_("
              "optimizer, max_norm) between backward() and step() instead (docs/api.md)")


def clip_grad_norm_(optimizer, max_norm: float, norm_type: float = 2.0, loss=None):
    """Clip the global gradient: exchange it first (optimizer.synchronize(loss), unless done
    in this step), then torch.nn.utils.clip_grad_norm_ on it, the same on every rank; then
    optimizer.step() applies it. Returns the global gradient's norm before clipping."""
    if not optimizer._synced:
        optimizer.synchronize(loss)
    norm = torch.nn.utils.clip_grad_norm_(optimizer.exchange.params, max_norm, norm_type)
    return optimizer._part.same_everywhere(norm)     # ranks out of the step's sum hold no gradient


class LocalEdits:
    """Watches the .grad tensors of `params` for in-place changes between the end of a
    step's last backward and its exchange."""

    def __init__(self, model: torch.nn.Module, params: list):
        self.params, self.model = params, weakref.ref(model)
        self.after_backward = None        # the counters' sum when the step's last backward ended (None: unknown)
        self.warned = False
        self._handle = model.register_forward_hook(_OutputHook(self))

    def versions(self) -> int:
        return sum(p.grad._version for p in self.params if p.grad is not None)

    def backward_ended(self) -> None:
        self.after_backward = self.versions()

    def check(self) -> None:
        """At the exchange: warn once if the gradients changed since backward ended."""
        changed = self.after_backward is not None and self.versions() != self.after_backward
        self.after_backward = None
        if changed and not self.warned:
            self.warned = True
            warnings.warn(LOCAL_EDIT, UserWarning, stacklevel=user_stacklevel())

    def close(self) -> None:
        self._handle.remove()


class _OutputHook:
    """The model's forward hook, holding the watcher weakly (a deepcopy of the model shares
    it and is ignored by it, a pickled model drops it): a training forward's output gets an
    autograd pre-hook that, when backward reaches it, queues the reading for the end of
    that backward."""

    def __init__(self, edits: LocalEdits):
        self.edits = weakref.ref(edits)

    def __call__(self, module, args, output):
        if torch.compiler.is_compiling() or not module.training or not torch.is_grad_enabled():
            return None
        edits = self.edits()
        if edits is None or module is not edits.model():     # a copy's forward (a probe's): not the watched grads
            return None
        node = getattr(_first_graph_tensor(output), "grad_fn", None)
        if node is not None:
            node.register_prehook(_QueueReading(self.edits))
        return None

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_NoOutputHook, ())


class _QueueReading:
    def __init__(self, edits):
        self.edits = edits

    def __call__(self, grad_outputs):
        edits = self.edits()
        if edits is not None:
            torch.autograd.Variable._execution_engine.queue_callback(edits.backward_ended)
        return None


class _NoOutputHook:
    """What a pickled model's output hook becomes: nothing."""

    def __call__(self, module, args, output):
        return None


def _first_graph_tensor(output):
    """The first tensor in a forward's output that autograd can reach (None if none)."""
    if isinstance(output, torch.Tensor):
        return output if output.grad_fn is not None else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for value in values:
        found = _first_graph_tensor(value)
        if found is not None:
            return found
    return None
