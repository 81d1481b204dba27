"""A rank that sits out measures itself on its own time.

A rank with local batch 0 (planning/participation.py) computes nothing, so its steps
say nothing about its speed; the planner must measure it now and then to know when it
is worth taking back. Giving it samples in the step (planning/dynamic/probe.py, the
rule where nothing else can measure it) makes every rank wait for its slow forward:
at 1:0.02 such a probe cost 9 times its budget. Here the rank measures itself beside
the steps instead: between two steps, a thread runs a forward and a backward pass on a
copy of the model, on a few samples of a batch this rank computed before (or of the
start-up calibration's, or its dataset's first ones), and times it as a step is timed (the device synchronised, the
emulated speed's stretch applied). The rank's main thread meanwhile takes the steps
(free: no samples) and waits for the others without spinning, so the probe has the
rank's core; the measured (samples, seconds) rides the next step's telemetry
(dynamic.Replanner), where every planner reads it as the rank's step.

How often: while it sits out, a rank starts a probe at a step boundary when none runs
and its probes have used at most PROBE_DUTY of the time since it began sitting out (CPU
time of the thread on a CPU rank: what the cores shared with other ranks lose; wall
time on a GPU), one at a time. Most probes are at `small` samples (the level, cheap);
at most every LARGE_EVERY-th, and the one after a small probe twice as fast as the one
before, at `large` (the slope, so that a rank taken back gets its whole share at once),
cut to what the last small one says it takes (dynamic.own_probe_size). Every
timed pass follows an untimed one at the same size, as a step follows the step before it:
between probes the rank's core idles, and its first pass after a spell idle runs cold
(64 samples of LeNet-5 on a rank whose steps wait 100 ms took 11-12 ms of CPU time, and
7-8 ms after a pass; at 2 samples 2.3-2.8 ms against 1.6-1.9). Read cold, a rank that
sits out looked 1.3-1.5x slower than it computes once taken back.

Where it does not run (the planner then probes in the step, as before): a transport
other than MPI on host memory or SyncBatchNorm (participants.py keeps every rank in the
exchange there), rank 0 where waits spin (it stays in the group's gradient sum, and its
spinning would take the probe's core), a compiled model (a copy would compile again in
the thread), and a rank with no samples to probe with: it has computed no batch, made
no calibration, and its sampler's dataset is not one of (input, target) pairs. A probe
that fails (the model does not take a slice of its batch, say) ends the
rank's probing, with a warning.
"""
from __future__ import annotations

import atexit
import copy
import threading
import time
import warnings
import weakref

import torch

from ..mpi.devices import autocast_dtype, in_format, memory_format, synchronize
from ..planning.dynamic.probe import LARGE_EVERY, after_own_probe, own_probe_bounds, own_probe_size
from .batches import first_samples
from .sync_batchnorm import make_local

PROBE_DUTY = 0.1      # the share of its time a rank that sits out spends probing (CPU time on a CPU rank)


_LIVE = weakref.WeakSet()     # the probers of this process: their threads end before the interpreter does


@atexit.register
def _stop_all() -> None:
    for prober in list(_LIVE):
        prober.stop()


def _slice(value, n: int, k: int):
    """`value` (a forward's argument) with every tensor of batch length n cut to k samples."""
    if isinstance(value, torch.Tensor):
        return value[:k].detach().clone() if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, (list, tuple)):
        return type(value)(_slice(v, n, k) for v in value)
    if isinstance(value, dict):
        return {key: _slice(v, n, k) for key, v in value.items()}
    return value


def _first_tensor(output):
    """The first tensor of a model's output (a tensor, or a tuple, list or dict of them)."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


class Prober:
    """The probes of one rank (see the module docstring). The optimizer calls remember()
    at each training forward, between_steps() once the next step is planned, take() for
    the step's telemetry, and stop() at the epoch's end and at close()."""

    def __init__(self, model, balancer, device, timeout: float):
        self.model, self.balancer, self.device, self.timeout = model, balancer, torch.device(device), timeout
        self.small, self.large = own_probe_bounds(balancer.min_local, balancer.global_batch, balancer.world_size,
                                                  balancer.max_local)
        self.inputs, self.samples = None, 0     # (args, kwargs) of up to `large` samples this rank computed
        self.autocast = None                    # the dtype training's forwards ran under autocast in (None: off)
        self.forwarded = False                  # ... known: a training forward was seen (else the calibration's)
        self.copy = None                        # the model the probes run on (made at the first probe)
        self.thread: threading.Thread | None = None
        self.result = None                      # (samples, seconds) of the last probe, not reported yet
        self.since, self.used = None, 0.0        # when it began sitting out; its probes' time since
        self.step_time, self.last_step = 0.0, 0.0    # the steps' mean interval on this rank; the last one's end
        self.last_small, self.since_large = None, LARGE_EVERY   # the last small probe's seconds; probes since a large
        self.sped_up = False                    # the last small probe ran twice as fast as the one before
        self.failed: BaseException | None = None
        self.warned = False
        _LIVE.add(self)

    def remember(self, args, kwargs, samples) -> None:
        """A training forward of `samples` samples: keep up to `large` of them (once enough),
        and, at the first, the autocast training runs under (the probe's thread does not
        inherit it; read once, not on every step)."""
        if not self.forwarded:
            self.autocast, self.forwarded = autocast_dtype(self.device), True
        if samples is None or samples <= self.samples or self.samples >= self.large or self.thread is not None:
            return
        keep = min(samples, self.large)
        self.inputs, self.samples = (_slice(args, samples, keep), _slice(kwargs, samples, keep)), keep

    def between_steps(self, local: int | None) -> None:
        """The next step's local batch is `local`: start a probe if it sits out and one is due
        (the last one's result may still wait for take()); a rank taken back first ends the
        probe under way (its core is the step's again) and forgets its last small probe (its
        next spell out may run at another speed). None: the epoch ended and no step is
        planned; the probe under way ends, and the duty starts again with the next epoch, but
        the last small probe is kept (a slow-down that ends with the epoch is found by the
        probes on either side of it)."""
        if local is None or local > 0:
            self.stop()
            self.since = None
            if local:
                self.last_small, self.sped_up = None, False
            return
        now = time.perf_counter()
        if self.since is None:
            self.since, self.used, self.last_step = now, 0.0, now
        self.step_time, self.last_step = 0.8 * self.step_time + 0.2 * (now - self.last_step), now
        self._finished()
        if self.thread is not None or self.failed is not None or self.used > PROBE_DUTY * (now - self.since):
            return
        inputs = self._inputs()
        if inputs is not None:
            size = self._next_size()
            self.thread = threading.Thread(target=self._probe, args=(inputs, self.samples, size), daemon=True,
                                           name="dbs-mpi probe")
            self.thread.start()

    def _next_size(self) -> int:
        """The next probe's samples (dynamic.own_probe_size)."""
        self.since_large += 1
        size = own_probe_size(min(self.small, self.samples), min(self.large, self.samples),
                              self.since_large >= LARGE_EVERY or self.sped_up, self.last_small, self.step_time)
        if size > min(self.small, self.samples):
            self.since_large = 0
        return size

    def _finished(self) -> None:
        if self.thread is not None and not self.thread.is_alive():
            self.thread.join()
            self.thread = None

    def take(self):
        """The (samples, seconds) of the last probe finished since the last call, or None."""
        self._finished()
        if self.failed is not None and not self.warned:
            self.warned = True
            warnings.warn(f"dbs: rank {self.balancer.rank} cannot probe itself on its own time ({self.failed!r}); "
                          f"the planner probes it in the steps instead", RuntimeWarning, stacklevel=3)
        result, self.result = self.result, None
        return result

    def stop(self) -> None:
        """Wait for the probe under way (bounded by the timeout) and drop its result."""
        if self.thread is not None:
            self.thread.join(self.timeout)
            self.thread = None if not self.thread.is_alive() else self.thread
        self.result = None

    def _inputs(self):
        """A batch to probe with: the larger of one this rank computed and the calibration's
        (or, where neither is, the first samples of the sampler's dataset)."""
        x = getattr(self.balancer, "sample_inputs", None)
        source = getattr(self.balancer, "sample_source", None)
        if x is None and self.inputs is None and source is not None:
            x = self.balancer.sample_inputs = first_samples(source, self.large)[0]
        if x is not None and min(len(x), self.large) > self.samples:
            x = in_format(x[:self.large].detach().clone().to(self.device), memory_format(self.model))
            self.inputs, self.samples = ((x,), {}), min(len(x), self.large)
        return self.inputs

    def _probe(self, inputs, samples: int, size: int) -> None:
        """The thread: a warm-up pass, then the timed one at the same size."""
        try:
            if self.copy is None:
                self.copy = make_local(copy.deepcopy(self.model))
                for p in self.copy.parameters():
                    p.grad = None
            args, kwargs = _slice(inputs[0], samples, size), _slice(inputs[1], samples, size)
            used = self._pass(args, kwargs)[1]
            start, cpu = time.perf_counter(), time.thread_time()
            self._pass(args, kwargs)
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            self.balancer.stretch(wall, cpu)        # the emulated speed (coupled: others compute)
            self.used += used + (wall if self.device.type == "cuda" else cpu)
            self.result = (size, time.perf_counter() - start)
            self.last_small, self.sped_up = after_own_probe(size, min(self.small, samples), self.result[1],
                                                            self.last_small, self.sped_up)
        except Exception as error:      # noqa: BLE001 (reported by take(): probing stops, the planner probes in steps)
            self.failed = error

    def _pass(self, args, kwargs) -> tuple[float, float]:
        """One forward and backward on the copy, under training's autocast (that of its
        forwards, else of the calibration); (wall, CPU) seconds of this thread."""
        start, cpu = time.perf_counter(), time.thread_time()
        self.copy.train()
        dtype = self.autocast if self.forwarded else getattr(self.balancer, "sample_autocast", None)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            out = _first_tensor(self.copy(*args, **kwargs))
        if out is not None and out.requires_grad:
            out.float().sum().backward()
        synchronize(self.device)
        for p in self.copy.parameters():
            p.grad = None
        return time.perf_counter() - start, (time.perf_counter() - start if self.device.type == "cuda"
                                             else time.thread_time() - cpu)
