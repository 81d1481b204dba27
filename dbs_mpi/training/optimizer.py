"""DistributedOptimizer: any torch optimizer, with the sample-weighted gradient exchange.

    optimizer = dbs_mpi.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model, balancer)
    for x, y in loader:                    # DataLoader(dataset, batch_sampler=HeteroSampler(...))
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()                    # full gradient buckets start reducing already
        optimizer.step(loss=loss)          # exchange, then the wrapped optimizer's update

All communication lives behind this one object (as in Horovod's DistributedOptimizer):
the model's .grad tensors are views of exchange.GradientExchange's flat buffer, cut into
DDP-style buckets that start reducing from autograd hooks during backward. step()
completes the exchange, so that every .grad holds

    g = sum_i (b_i / B) g_i            (aggregation "weighted": the gradient of the mean
                                        loss over the whole global batch)
    g = (1 / n') sum_i g_i             ("mean": plain averaging over the n' ranks with samples)

and then runs the wrapped optimizer, identically on every rank. b_i is this rank's local
batch in this step, read from the balancer's table of the epoch (so the last, partial
step is weighted right, and a rank with no samples contributes 0). The loss given to
step() travels in the same buffer and comes back as the global mean loss.

It also keeps the clocks (profiling.py): a forward pre-hook on the model marks the
start of a step's compute (the time before it is data loading), step() marks its end;
emulated slow-downs are applied there, before the collective. The balancer records them.
Under dbs with a step interval, every rank's compute time of the step (and what the
balancer needs to switch vectors safely: balancer.telemetry()) rides in extra slots of
the same allreduce, so the balancer can re-plan within the epoch at no extra collective.

What users expect, and what fails loudly:
* zero_grad() in any form works: this object's (gradients zeroed, views kept), the
  wrapped optimizer's or the model's with set_to_none=True (the fresh .grad tensors are
  taken over by the exchange), or none at all: after step() the gradients have been
  applied and are zero.
* The forward pre-hook counts the samples the model sees in training mode; if they are
  not this rank's local batch of the step (a plain sampler, a second step per batch), the
  gradient would be weighted wrongly, so step() raises, saying what to do.
  check_batch=False turns the count off (models whose first input is not batch-first).
* To read or clip the global gradient: synchronize(), then step() (no second exchange).
* Parameters must be float32 and equal on every rank at construction (checked).
"""
from __future__ import annotations

import functools
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..mpi import startup, transport
from ..mpi.agreement import AgreedError, agree_settings
from ..mpi.collectives import allgather_array, broadcast_tensors
from ..mpi.placement import oversubscribed, placement, sleep_while_waiting
from ..options import user_stacklevel
from . import sync_batchnorm
from .accumulation import MicroBatches
from .checkpoint import StopRequest, riding
from .clipping import LocalEdits, clip_grad_norm_  # noqa: F401 (clip_grad_norm_: documented here too)
from .event_clock import LateSteps
from .step_clock import StepClock
from .exchange import GradientExchange
from .global_batch import scaled_step
from .loss_scaling import skip_update
from .named_optimizers import in_default_order
from .participants import Participants
from .prober import Prober

AGGREGATIONS = ("weighted", "mean")
MIB = 2 ** 20

# GradScaler.step(optimizer) passes itself to step() of an optimizer that handles the
# scaling (loss_scaling.py), which it announces as going away; torch's
# other contract (found_inf attributes set before step) checks each rank's own gradient,
# which ranks disagree on, so this one is used, and its notice is not shown every run.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


class StepPlanner:
    """The plan of the step under way (StepPlan), read from the balancer once: at the end
    of the step before it (where the epoch goes on: a rank that sat out catches up then,
    before the forward), else at the step's first forward, which arms the exchange with
    it, else at the exchange."""

    def __init__(self, balancer, participants, aggregation: str):
        self.balancer, self.participants, self.aggregation = balancer, participants, aggregation
        self.reset()

    def reset(self) -> None:
        self.plan = None
        self.armed = False                 # the step's first forward armed the exchange

    def current(self) -> StepPlan:
        """The step's plan (raises, saying what to do, when no epoch is open)."""
        b, plan = self.balancer, self.plan
        if plan is not None and not self.armed and (plan.epoch, plan.step, plan.loads) != (b.open_epoch, b.step,
                                                                                            b.loads):
            plan = None                    # planned ahead, and the balancer moved since (a state loaded)
        if plan is None:
            self.plan = plan = StepPlan.read(b, self.participants, self.aggregation)
        return plan

    def arm(self, exchange) -> None:
        """At the step's first forward: buckets may start during backward, over its route."""
        self.current()
        self.armed = True
        self.rearm(exchange)

    def rearm(self, exchange) -> None:
        if self.armed and self.plan.route is not None:
            exchange.arm(self.plan.weight, self.plan.route)


def _tail(telemetry, stop, rides: bool):
    """The extra slots of a step's collective: the balancer's telemetry (dbs within the
    epoch), then, where they ride, the StopRequest's flags (zeros where none is active)."""
    flags = (stop.flags() if stop else [0.0] * StopRequest.FLAGS) if rides else []
    values = [*(() if telemetry is None else telemetry), *flags]
    return np.array(values, dtype=np.float32) if values else None


def _after_tail(sums, telemetry, stop, rides: bool):
    """Hand the summed stop flags to the StopRequest; returns the telemetry's sums (None: none)."""
    flags = StopRequest.FLAGS if rides else 0
    if stop is not None:
        stop.carried(sums[len(sums) - flags:])
    return None if telemetry is None else sums[:len(sums) - flags]


@dataclass(frozen=True)
class StepPlan:
    """A step's facts, read from the balancer once and carried through the step."""
    epoch: int                  # the balancer's open epoch and step when it was read, and its loads
    step: int
    loads: int
    row: np.ndarray             # the step's local batches, every rank's
    sizes: list                 # the same as Python ints (the step's checks: plain Python, see step_weight)
    local: int                  # this rank's
    total: int                  # the step's global batch
    weight: float               # this rank's share of the step's gradient (step_weight)
    route: object               # where its buckets are summed (participants.py; None: out of the sum)

    @classmethod
    def read(cls, balancer, participants, aggregation: str) -> "StepPlan":
        """The balancer's step now (raises, saying what to do, when no epoch is open); its
        route from the participants (collective where the group changes)."""
        row = balancer.step_batch_sizes()
        sizes = row.tolist()
        return cls(balancer.open_epoch, balancer.step, balancer.loads, row, sizes, sizes[balancer.rank], sum(sizes),
                   step_weight(sizes, balancer.rank, aggregation), participants.plan(sizes))


def step_weight(row, rank: int, aggregation: str = "weighted") -> float:
    """This rank's share of a step's global gradient, from the step's local batches. In
    plain Python: a numpy reduction in every step cost 25-30 us of a step's host time,
    its code cold after the step's kernels (scripts/step-profile.py)."""
    sizes = row.tolist() if isinstance(row, np.ndarray) else list(row)
    local = int(sizes[rank])
    if local == 0:
        return 0.0
    if aggregation == "mean":
        return 1.0 / sum(1 for b in sizes if b)
    return local / float(sum(sizes))


def _number(loss) -> float:
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def _loss_share(loss, local: int, total: int, device=None):
    """This rank's part of the global mean loss, loss_i b_i / B (B: `total`): a number,
    or, with the device of a clock that reads late and a tensor loss, a 0-dim tensor there
    (nothing waits for the loss)."""
    if device is not None and isinstance(loss, torch.Tensor):
        if not local:
            return torch.zeros((), dtype=torch.float32, device=device)
        return loss.detach().float().reshape(()) * (local / float(total))
    return _number(loss) * local / float(total) if loss is not None and local else 0.0


def batch_length(args, kwargs) -> int | None:
    """The leading dimension of a forward call's first tensor input (None if there is none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, dict):
            value = next(iter(value.values()), None)
        elif isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


class _ForwardHook:
    """The model's forward pre-hook, holding the optimizer weakly. A deepcopy of the model
    (an EMA copy, the calibration's probe) shares it, and it ignores modules other than
    the wrapped model; a pickled model gets a hook that does nothing."""

    def __init__(self, optimizer):
        self.optimizer = weakref.ref(optimizer)

    def __call__(self, module, args, kwargs):
        if torch.compiler.is_compiling():   # torch.compile traces the model: the hook stays out of its graph
            return None
        optimizer = self.optimizer()
        if optimizer is not None:
            optimizer._on_forward(module, args, kwargs)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_NoHook, ())


class _NoHook:
    """What a pickled model's forward hook becomes: nothing."""

    def __call__(self, module, args, kwargs):
        return None


class StepChecks:
    """Never silently wrong: the samples the model saw in training since the last step
    (counted by its forward hook) against this rank's local batch, and a warning, once,
    where plain BatchNorm layers see uneven local batches."""

    def __init__(self, model, check_batch: bool):
        self.check_batch = check_batch
        self.plain_batchnorm = sync_batchnorm.unsynchronised(model)
        self.warned_batchnorm = False
        self.forward_seen = False          # the hook fires for this model (counts can be checked)
        self.reset()

    def reset(self) -> None:
        self.samples = 0                   # samples the model saw in training mode (None: unknown)
        self.forwards = 0

    def forward(self, args, kwargs) -> None:
        self.forward_seen = True
        self.forwards += 1
        n = batch_length(args, kwargs)
        self.samples = None if n is None or self.samples is None else self.samples + n
        self.last = n                      # the last forward's samples

    def samples_match(self, rank: int, local: int, row, balancer) -> None:
        """Fail loudly if the model did not see this rank's local batch since the last step."""
        if not self.check_batch or not self.forward_seen or self.samples is None:
            return
        seen, expected = self.samples, (local or 1)      # an empty share gets one placeholder sample
        if seen == expected or (local == 0 and seen == 0):
            return
        raise RuntimeError(
            f"rank {rank}, step {balancer.step + 1} of epoch {balancer.open_epoch + 1}: the model saw {seen} "
            f"training sample(s) since the last step, but this rank's local batch is {local} (step's local batches "
            f"{np.asarray(row).tolist()}), so the gradient would be weighted wrongly. Feed the model the batches "
            f"of dbs_mpi.HeteroSampler (DataLoader(dataset, batch_sampler=sampler)), one optimizer.step() per "
            f"batch; pass check_batch=False if the model's first input is not batch-first")

    @staticmethod
    def same_step(plan, balancer) -> None:
        """The step exchanged is the one planned (SyncBatchNorm layers read the balancer's
        row themselves: sync_batchnorm.StepShare)."""
        if (plan.epoch, plan.step) != (balancer.open_epoch, balancer.step):
            raise RuntimeError("the balancer's step changed during this step")

    def batchnorm(self, row, rank: int) -> None:
        """Warn once, on rank 0 (once a job), if plain BatchNorm layers see uneven local batches."""
        if self.warned_batchnorm or not self.plain_batchnorm or min(row) == max(row):
            return
        self.warned_batchnorm = True
        names = self.plain_batchnorm
        if rank != 0:
            return
        warnings.warn(f"the model's BatchNorm layers ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) "
                      f"normalise over each rank's own local batch and the local batches are uneven "
                      f"({np.asarray(row).tolist()}), so training depends on the vector: convert them with "
                      f"dbs_mpi.convert_sync_batchnorm(model, comm) (dbs-mpi train --sync-bn)", UserWarning,
                      stacklevel=user_stacklevel())


class _WrappedOptimizer(torch.optim.Optimizer):
    """What torch.optim code reads of an optimizer, taken from the wrapped one (self.optimizer)."""

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("DistributedOptimizer: the gradient buckets are fixed at construction; add parameter "
                           "groups to the wrapped optimizer before wrapping it")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, aggregation={self.aggregation!r})"


def _trainable(model, optimizer) -> list:
    """The model's trainable parameters; the optimizer may hold no other (and a fused one
    none in another memory order: _check_fused_order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    mine = {id(p) for p in params}
    if any(id(p) not in mine for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("DistributedOptimizer: the optimizer holds a parameter that is not one of the model's "
                         "trainable parameters")
    _check_fused_order(optimizer)
    return params


def build_exchange(comm, params, device, balancer, timeout: float, settings: dict):
    """Collective: the optimizer's exchange, with what its ranks agree once, here: the
    settings every rank must share (aggregation, wait policy, bucket caps, ...), the
    transport (transport.agree: cached on the communicator, so a launcher that checked it
    early shares the agreement) and the placement (gathered once per communicator), hence
    the wait policy. A StopRequest's flags ride the tail where it is in host memory (MPI on
    host memory: elsewhere writing and reading it would wait for the device every step).
    The balancer's telemetry rides it too, and where the balancer measures the gradient
    noise scale, the exchange writes this rank's gradient norm into its slot.
    Returns (the GradientExchange, whether a node is oversubscribed)."""
    if settings["aggregation"] not in AGGREGATIONS:
        raise ValueError(f"aggregation: must be one of {', '.join(AGGREGATIONS)}; got {settings['aggregation']!r}")
    agree_settings(comm, settings, timeout, "DistributedOptimizer")
    places = placement(comm, timeout)
    name = transport.agree(comm, settings["exchange"], device, timeout)
    extra = balancer.telemetry_size + (StopRequest.FLAGS if name == "host" else 0)
    exchange = GradientExchange(comm, params, timeout, sleep_while_waiting(settings["wait_policy"], places),
                                bucket_bytes=int(settings["bucket_mb"] * MIB),
                                first_bucket_bytes=int(settings["first_bucket_mb"] * MIB), transport=name, extra=extra)
    if balancer.noise is not None:
        exchange.measure_norm(balancer.noise_slot)
        balancer.noise.aggregation = settings["aggregation"]
    return exchange, oversubscribed(places)


def _summed_noise(exchange, balancer) -> None:
    """Rank 0, where the balancer measures the noise scale: the squared norm of the step's
    summed gradient (it rides the next step: gradient_noise.py). Reads the device once."""
    if balancer.noise is not None and balancer.rank == 0:
        summed = exchange.flat[:exchange.numel]
        balancer.noise.sum_done(float(torch.dot(summed, summed)))


def _plan_next(steps, balancer, prober, participants) -> None:
    """After a step, the next one's plan (a rank that sat out catches up before it); a rank
    that sits out in it probes itself beside it (prober.py; where it stays in the exchange
    after all, it never does)."""
    local = steps.current().local if balancer.step_pending else None      # (None: the epoch's end)
    if prober is not None:
        prober.between_steps(local if participants.enabled else 1)


def _prober(model, balancer, participants, device, exchange, timeout: float) -> Prober | None:
    """The probes a rank that sits out runs on its own time (prober.py), where they can
    run: dbs within the epoch (its telemetry carries them), ranks leaving the exchange
    (host MPI, no SyncBatchNorm), a model that is not compiled, and not on rank 0 where
    waits spin (it stays in the group's gradient sum)."""
    if balancer.telemetry_size == 0 or not participants.enabled or hasattr(model, "_orig_mod"):
        return None
    if balancer.rank == 0 and not exchange.sleep_while_waiting:
        return None
    return Prober(model, balancer, device, timeout)


def _step_clock(model, device, exchange, balancer) -> StepClock:
    """The optimizer's clock: the model's SyncBatchNorm channels (their waits are not
    compute), and CUDA events read late where nothing needs the host to wait."""
    channels = list({id(layer.channel): layer.channel for layer in sync_batchnorm.layers(model)}.values())
    late = _reads_late(device, exchange.world.transport.name, balancer, bool(channels) and exchange.world_size > 1)
    return StepClock(channels, device, LateSteps(balancer, device) if late else None)


def _reads_late(device: torch.device, exchange: str, balancer, synced_batchnorm: bool) -> bool:
    """Whether the step's clock reads CUDA events late instead of waiting for the device:
    on a GPU rank whose exchange stays on the device (local: one rank; nccl), unless the
    rank emulates a slower device (a stretch needs the compute's end at once), dbs
    re-plans within the epoch (its telemetry is read on the host every step anyway), or
    SyncBatchNorm layers wait for other ranks inside the compute (their waits, which the
    host clock takes out of the compute, would be in the events' compute)."""
    return device.type == "cuda" and exchange in ("local", "nccl") and balancer.emulator.idle \
        and balancer.telemetry_size == 0 and not synced_batchnorm


def _attach_batchnorm(model, comm, exchange_transport, balancer, aggregation: str) -> sync_batchnorm.StepShare:
    """One StepShare for the model's SyncBatchNorm layers, which must span comm's ranks:
    they read each step's row from the balancer and weigh by the exchange's rule, without
    a hook (a compiled model runs none). They move to the exchange's torch.distributed
    group when it has one (nccl, gloo)."""
    share = sync_batchnorm.StepShare(balancer, functools.partial(step_weight, aggregation=aggregation))
    for layer in sync_batchnorm.layers(model):
        if layer.channel is None or not layer.channel.same_ranks(comm):
            raise ValueError("DistributedOptimizer: the model's SyncBatchNorm layers were not converted over this "
                             "optimizer's communicator: dbs_mpi.convert_sync_batchnorm(model, comm) with the "
                             "balancer's comm")
        group = getattr(exchange_transport, "group", None)
        if group is not None and not isinstance(layer.channel, sync_batchnorm.TorchChannel):
            layer.channel = sync_batchnorm.TorchChannel(group, comm)
        layer.share = share
    return share


def check_same_parameters(comm, params, timeout: float) -> None:
    """Collective: fail on every rank together if the model's parameters (their shapes,
    then their values) differ between ranks."""
    crc, shapes = 0, zlib.crc32(repr([tuple(p.shape) for p in params]).encode())
    for p in params:
        crc = zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    gathered = allgather_array(comm, [float(crc), float(shapes), float(sum(p.numel() for p in params))], timeout)
    sums = gathered[:, 0]
    if np.any(gathered[:, 1] != gathered[0, 1]):
        differ = np.flatnonzero(gathered[:, 1] != gathered[0, 1]).tolist()
        raise AgreedError(f"DistributedOptimizer: the model of rank(s) {differ} has other parameters than rank "
                          f"0's ({int(gathered[differ[0], 2])} values against {int(gathered[0, 2])}, or other "
                          f"shapes): every rank wraps the same model", 0, comm.Get_rank() == 0, comm.Get_size())
    if np.any(sums != sums[0]):
        differ = np.flatnonzero(sums != sums[0]).tolist()
        raise AgreedError(f"DistributedOptimizer: the parameters of rank(s) {differ} differ from rank 0's; call "
                          f"dbs_mpi.broadcast_parameters(model, comm) before wrapping the optimizer",
                          0, comm.Get_rank() == 0, comm.Get_size())


def broadcast_state(comm, model, state: dict, params, root: int, timeout: float) -> float:
    """Collective: the model's parameters and buffers, and the tensors of the optimizer
    `state` of `params` (in their order, keys sorted), become root's; returns the largest
    difference any rank had (every rank gets the same number)."""
    tensors = [*model.parameters(), *model.buffers()]
    for p in params:
        for key in sorted(state.get(p, {})):
            if isinstance(state[p][key], torch.Tensor):
                tensors.append(state[p][key])
    drift = broadcast_tensors(tensors, comm, root, timeout)
    return float(allgather_array(comm, [drift], timeout).max())


def _check_fused_order(optimizer) -> None:
    """Refuse a fused torch optimizer over weights in another memory order than the
    default (channels-last), which it would update wrongly (named_optimizers.in_default_order)."""
    for group in optimizer.param_groups:
        if group.get("fused") and not in_default_order(group["params"]):
            raise ValueError("DistributedOptimizer: a fused optimizer (fused=True) would update weights in "
                             "channels-last (or another non-default) memory order wrongly: its kernel pairs them "
                             "with their gradients by memory position, and the gradients are in the default order; "
                             "build it with fused=False (foreach=True is exact) or keep the model's default order")


class DistributedOptimizer(_WrappedOptimizer):
    """Wraps `optimizer` (any torch.optim.Optimizer over `model`'s parameters) so that
    step() applies the sample-weighted gradient of all ranks of `balancer.comm` (the
    arguments in docs/api.md). aggregation: "weighted" or "mean". wait_policy: "auto" |
    "spin" | "sleep" (waits.py). bucket_mb / first_bucket_mb: DDP's bucket caps in MiB.
    timeout: of every wait (default: the balancer's). check_batch: count the training
    samples of each step. exchange: "auto" | "host" | "cuda-aware" | "nccl" | "gloo"
    (transport.py, agreed by all ranks). broadcast_buffers: after every step the model's
    floating-point buffers become those of the first rank that computed (DDP: rank 0's).
    leave_exchange: ranks that sit out leave the gradient's sum (participants.py)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, balancer, *,
                 aggregation: str = "weighted", wait_policy: str = "auto", bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, timeout: float | None = None, check_batch: bool = True,
                 exchange: str = "auto", broadcast_buffers: bool = True, leave_exchange: bool = True):
        if isinstance(optimizer, DistributedOptimizer) or not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer; got {type(optimizer).__name__}")
        self.optimizer, self.model, self.balancer = optimizer, model, balancer
        self.comm, self.aggregation = balancer.comm, aggregation
        self.timeout = balancer.timeout if timeout is None else float(timeout)
        params = _trainable(model, optimizer)
        self.device = params[0].device if params else torch.device("cpu")
        balancer.on_device(self.device)
        check_same_parameters(self.comm, params, self.timeout)
        self.exchange, self.oversubscribed = build_exchange(
            self.comm, params, self.device, balancer, self.timeout,
            dict(aggregation=aggregation, wait_policy=wait_policy, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb,
                 broadcast_buffers=bool(broadcast_buffers), leave_exchange=bool(leave_exchange), exchange=exchange))
        self.sleep_while_waiting = self.exchange.sleep_while_waiting
        self._share = _attach_batchnorm(model, self.comm, self.exchange.world.transport, balancer, aggregation)
        self._clock = _step_clock(model, self.device, self.exchange, balancer)
        channels = self._clock.channels
        self.checks = StepChecks(model, check_batch)
        self._micro = MicroBatches(self.exchange, bool(channels))
        # ranks leave the sum only over MPI on host memory (the same name on every rank)
        self._part = Participants(self.comm, self.exchange, model, optimizer, balancer, self.timeout,
                                  leave_exchange and not channels and self.exchange.agreed == "host")
        self._buffers = [b for b in model.buffers() if b.is_floating_point()] \
            if broadcast_buffers and self.comm.Get_size() > 1 else []
        self._hook = model.register_forward_pre_hook(_ForwardHook(self), with_kwargs=True)
        self._edits = LocalEdits(model, self.exchange.params)
        self._steps = StepPlanner(balancer, self._part, aggregation)      # the step's facts, read once
        self._prober = _prober(model, balancer, self._part, self.device, self.exchange, self.timeout)
        self._new_step(time.perf_counter())

    # --- a step ---------------------------------------------------------------------
    def _new_step(self, now: float) -> None:
        self._clock.restart(now)
        self.checks.reset()
        self._synced = False
        self._steps.reset()
        self._loss = float("nan")
        self._telemetry = None             # the sum of the ranks' balancer.telemetry() (dbs within the epoch)

    def _on_forward(self, module, args, kwargs):
        if module is not self.model or not module.training or not torch.is_grad_enabled():
            return
        if self._clock.forward() and self.balancer.step_pending:
            self._steps.arm(self.exchange)
        self.checks.forward(args, kwargs)
        if self._prober is not None:
            self._prober.remember(args, kwargs, self.checks.last)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (set_to_none is ignored: the .grad tensors stay views of the
        exchange buffer, which is what lets the buckets reduce during backward)."""
        if self.exchange.busy:
            raise RuntimeError("zero_grad() after backward() and before step() would drop gradients already being "
                               "reduced; call it before the forward pass (or after step())")
        self.exchange.adopt_grads()
        self.exchange.zero_grad()
        self._steps.rearm(self.exchange)    # zeroed after the forward: armed again

    @property
    def sits_out(self) -> bool:
        """No samples for this rank in the coming step and no SyncBatchNorm layer needs its forward: the
        loop may skip forward and backward and call step() alone (docs/api.md). Ask it on every rank: at a
        step where the ranks taking part change it is collective (the step's plan)."""
        return not self._clock.channels and self.balancer.step_pending and self._steps.current().local == 0

    def micro_batches(self, tensors, size: int):
        """Gradient accumulation (accumulation.py): `tensors` in micro-batches of at most
        `size` samples, each with one backward(loss); then step() (docs/api.md)."""
        return self._micro.split(tensors, size)

    def backward(self, loss, scaler=None) -> None:
        """loss.backward(), weighted (inside micro_batches: by the micro-batch's share)."""
        self._micro.backward(loss, scaler)

    def synchronize(self, loss=None) -> float:
        """Exchange the gradients now (e.g. to clip the global gradient before step()).
        Returns the global mean loss if `loss` is given (else NaN), as step() does."""
        if self._synced:
            raise RuntimeError("synchronize() twice in one step")
        loss = self._micro.step_loss(loss)
        self._edits.check()                 # warns once where the loop changed its local gradient in place
        start = self._clock.boundary()      # the step's compute ends when the device is done, not its launches
        try:
            plan = self._steps.current()
            self.checks.same_step(plan, self.balancer)
            self.checks.samples_match(self.balancer.rank, plan.local, plan.row, self.balancer)
            self.checks.batchnorm(plan.sizes, self.balancer.rank)
        except Exception:
            self._new_step(self._clock.last_end)    # a refused step leaves nothing behind for the next one
            raise
        began, cpu, in_sync = self._clock.compute(plan.local > 0)     # less SyncBatchNorm's waits (StepClock)
        self.balancer.stretch(start - began - in_sync, cpu, plan.row)    # nothing where the clock reads late
        pre_end = time.perf_counter()
        share = _loss_share(loss, plan.local, plan.total, self.device if self._clock.late is not None else None)
        probe = self._prober and self._prober.take()     # a rank that sits out: its probe on its own time
        telemetry = self.balancer.telemetry(pre_end - began - in_sync, probe)   # dbs: every rank's step time
        rides = self.exchange.agreed == "host"      # a StopRequest's flag rides the same collective
        stop = riding(self.comm) if rides else None
        sums = self._part.reduce(plan.route, plan.weight, share, _tail(telemetry, stop, rides),
                                 sleep=self._prober is not None and self._prober.thread is not None)
        self._telemetry = _after_tail(sums.extra, telemetry, stop, rides)
        _summed_noise(self.exchange, self.balancer)
        self._loss = sums.loss if loss is not None else float("nan")
        self._times = self._clock.phases(began, pre_end, in_sync)
        self._synced = True
        return self._loss

    def step(self, closure=None, *, loss=None, grad_scaler=None) -> float:
        """Complete the gradient exchange (unless synchronize() did), then the wrapped
        optimizer's step. loss: this rank's mean loss of the step (a tensor or number), to
        get the global mean loss back and into the records. Returns it (NaN if not given;
        a 0-dim device tensor where the clock reads late). grad_scaler: what
        `scaler.step(optimizer)` passes (loss_scaling.py: unscaled after the exchange)."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step(closure): closures are not supported (every rank must "
                             "take exactly one exchange per step)")
        if not self._synced:
            self.synchronize(loss)
        startup.done()                      # a launch watchdog (startup.arm) is not needed any more
        start = time.perf_counter()
        if self._part.updates(grad_scaler) and not skip_update(self, grad_scaler, self.exchange):
            scaled_step(self.optimizer, self.balancer.lr_factor)     # global_batch="auto": lr x gain
        self._part.updated(self.balancer, self._buffers, self._steps.plan.sizes)   # buffers; stale ranks; the epoch's end
        self.exchange.flat.zero_()          # the gradients are applied: the next step starts from zero
        self._clock.record(self.balancer, start, self._times, self._loss, self._telemetry)
        global_loss = self._loss
        self._new_step(self._clock.last_end)
        _plan_next(self._steps, self.balancer, self._prober, self._part)
        return global_loss

    _step_supports_amp_scaling = True      # GradScaler.step(optimizer) hands step() the scaler

    def resync(self, root: int = 0) -> float:
        """Collective: every rank's parameters, buffers and optimizer state become root's;
        returns the largest difference any rank had (the same on every rank). For jobs
        that mix CPUs and GPUs, whose roundings differ (docs/api.md)."""
        if self.exchange.busy:
            raise RuntimeError("resync() between backward() and step(): call it after step()")
        return broadcast_state(self.comm, self.model, self.optimizer.state, self.exchange.params, root, self.timeout)

    def close(self) -> None:
        """Remove the hooks (the .grad tensors stay the buffer's views); late steps are read first."""
        if self._clock.late is not None:
            self._clock.late.close()
        if self._prober is not None:
            self._prober.stop()
        self._hook.remove()
        self._edits.close()
        self.exchange.close()
