"""The bucketed gradient exchange: the sample-weighted allreduce of every step.

`GradientExchange` owns one flat float32 buffer that the model's .grad tensors are
views of (autograd accumulates straight into it: no copies), cut into buckets as in
PyTorch DDP (reverse registration order, 25 MiB cap, a 1 MiB first bucket), plus one
slot for the loss. Every rank scales its gradients by its weight b_i/B and sums them
with an in-place allreduce: the sample-weighted gradient sum_i (b_i/B) g_i and the
global mean loss (docs/method.md, "Sample-weighted gradients"). With several buckets, a
bucket's reduction starts from autograd hooks as soon as backward has filled it.

It decides *when* a bucket is reduced and with which weight (the buffer and its .grad
views are `GradientBuffer`'s, the order in which a step's buckets start during backward
`BucketSchedule`'s); a transport (transport.py) moves the bytes (MPI from host memory,
CUDA-aware MPI, or torch.distributed). Its waits are the bounded ones of waits.py, with
its two wait policies.

The buffer (GradientBuffer) holds every gradient, bucket after bucket in launch order,
then one slot for the step's loss and `extra` slots that any rank may fill (the
balancer's telemetry, the stop flags: they reach every rank in the same allreduce, no
extra collective). A .grad that something replaced is taken over in the parameter's hook
or at the latest in `reduce`, so every form of zero_grad gives the right gradient.

A step (GradientExchange) is `zero_grad(weight)` (or `arm(weight, route)` on already
zeroed gradients), `backward(loss)` (or loss.backward()), `reduce(weight, route, ...)`.
Weighting: `backward(loss)` seeds autograd with the weight, so the gradients arrive
already multiplied by b_i/B and nothing is scaled afterwards; after a plain
loss.backward() every bucket is scaled (one pass over its bytes) just before its
allreduce starts.

* Overlap (BucketSchedule). With several buckets and several ranks, a bucket's
  non-blocking Iallreduce starts from autograd hooks as soon as backward has filled it,
  strictly in bucket order; every bucket is reduced by the same kind of call on every
  rank (non-final buckets: Iallreduce; the final bucket: blocking Allreduce), so no rank
  can mismatch another.
* The final bucket carries the loss slot, so it starts in `reduce`, when the loss is
  known; everything not started yet (a rank with no samples runs no backward; a
  parameter unused in this step fires no hook; zero_grad() was called without a weight)
  starts there too, in bucket order. With one bucket (LeNet-5 and the MLP at the default
  caps) a step is one blocking Allreduce, no hooks; on this 2-core machine overlap did
  not pay even with small buckets (see bench overlap), so the DDP caps are the default.
* Waiting. "spin": blocking Allreduce of the final bucket, then Waitall. "sleep": first
  a sleeping Ibarrier (posted after the buckets' Iallreduces, so MPI_Test on it
  progresses them too) until every rank has arrived, then the same calls, which spin
  only while bytes move. Every rank must wait alike: the caller agrees the policy
  (DistributedOptimizer does, with its other settings).

A step's buckets go by a `Route`: the world's (every rank; the step's tail, the loss,
the balancer's telemetry and the stop flags, rides the final bucket) or a group's (the
ranks taking part, participants.py: the gradients alone, and the tail summed over the
world by `sum_tail`). `reduce` is the one routine that completes a step over either.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from ..mpi import transport as transports
from ..mpi.supervisor import SUPERVISOR
from ..mpi.waits import POLL_SLEEP_MAX, wait

MIB = 2 ** 20
BUCKET_BYTES = 25 * MIB        # PyTorch DDP's bucket cap
FIRST_BUCKET_BYTES = 1 * MIB   # PyTorch DDP's first-bucket cap (the last layers: ready first)
WHAT = "the gradient allreduce"


@dataclass(frozen=True)
class Route:
    """Where a step's buckets are summed: a transport over the ranks of `comm`; `tail`:
    the loss and extra slots ride the final bucket (the world's route only)."""
    transport: object
    comm: MPI.Comm
    tail: bool = False


@dataclass(frozen=True)
class StepSums:
    """What a step's exchange summed besides the gradient: the global mean loss (a float, or
    a 0-dim tensor on the buffer's device: nothing waited for it) and the extra slots' sums
    (numpy; None where there are none)."""
    loss: object
    extra: np.ndarray | None


def bucket_layout(numels, bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                  itemsize: int = 4) -> list[list[int]]:
    """Parameter indices of each bucket, in launch order (PyTorch DDP's rule).

    Parameters are taken in reverse registration order (backward produces the last
    layers' gradients first); a bucket is closed as soon as it holds at least its cap
    in bytes: `first_bucket_bytes` for the first bucket, `bucket_bytes` for the others
    (so a bucket exceeds its cap by at most one tensor, and a tensor larger than the
    cap gets a bucket of its own). A cap of 0 means no cap. There is always at least
    one bucket (empty if there are no parameters)."""
    buckets, current, size = [], [], 0
    for index in reversed(range(len(numels))):
        current.append(index)
        size += numels[index] * itemsize
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if cap and size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current or not buckets:
        buckets.append(current)
    return buckets


class GradientBuffer:
    """One flat float32 buffer that every gradient lives in, cut into buckets, and the
    .grad views into it. It knows nothing of ranks (GradientExchange sums it over them).

    Bucket after bucket in launch order (`layout`, from bucket_layout; inside a bucket,
    parameters keep their registration order), then `tail` slots of the final bucket (the
    step's loss and the extra ones). Each parameter's .grad is a view of its place, so
    autograd accumulates straight into the buffer (no copies) and the optimizer reads the
    reduced values. A .grad that something replaced (optimizer.zero_grad() or
    model.zero_grad() with set_to_none=True, the default, then a backward that made a
    fresh tensor) is taken over by `adopt`: its values are copied into the buffer and the
    view is put back; a .grad set to None counts as zero."""

    def __init__(self, params: list, layout: list[list[int]], tail: int, device: torch.device):
        self.params, self.layout, self.device = params, layout, device
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.numel + tail, dtype=torch.float32, device=device)
        self.bounds = []                 # (start, stop) of every bucket in flat; the final one ends with the tail
        self.bucket_of = [0] * len(params)
        self.grad_ptr = [0] * len(params)        # the data of every .grad view: another one is a replaced .grad
        self.grad_views = [None] * len(params)
        offset = 0
        for b, indices in enumerate(layout):
            start = offset
            for index in sorted(indices):
                p = params[index]
                n = p.numel()
                p.grad = self.flat[offset:offset + n].view_as(p)
                self.bucket_of[index] = b
                self.grad_ptr[index] = p.grad.data_ptr()
                self.grad_views[index] = p.grad
                offset += n
            self.bounds.append((start, offset))
        self.bounds[-1] = (self.bounds[-1][0], self.numel + tail)
        # What the weighting pass scales: numpy views on the CPU (a few microseconds less per
        # step than torch's mul_ on LeNet-5's buffer), tensor slices on a GPU.
        whole = self.flat.numpy() if device.type == "cpu" else self.flat
        self.bucket_views = [whole[start:stop] for start, stop in self.bounds]
        self.final_grads = whole[self.bounds[-1][0]:self.numel]

    def bucket_numels(self) -> list[int]:
        """Gradient elements of every bucket, in launch order (the loss and extra slots not counted)."""
        return [stop - start for start, stop in self.bounds[:-1]] + [self.numel - self.bounds[-1][0]]

    def gradient(self) -> torch.Tensor:
        """A copy of all gradients, flattened in registration order (like torch.cat of the .grad)."""
        return torch.cat([p.grad.reshape(-1) for p in self.params]) if self.params else torch.zeros(0)

    def adopt(self, index: int) -> None:
        """Put parameter `index`'s .grad back into the buffer (zero if it is None)."""
        p, view = self.params[index], self.grad_views[index]
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad.detach().reshape(view.shape))
        p.grad = view

    def adopt_grads(self) -> None:
        """Take over every .grad that no longer views the buffer (see the class docstring)."""
        for index, (p, ptr) in enumerate(zip(self.params, self.grad_ptr)):
            if p.grad is None or p.grad.data_ptr() != ptr:
                self.adopt(index)

    def views_intact(self) -> bool:
        """True if every .grad views the buffer (nothing replaced them since the last step)."""
        return all(p.grad is not None and p.grad.data_ptr() == ptr for p, ptr in zip(self.params, self.grad_ptr))


class BucketSchedule:
    """Which of a step's buckets have started, with which weight, and their requests in
    flight: the state of a step between zero_grad/arm and GradientExchange.allreduce.

    Buckets start strictly in bucket order, whatever order backward fills them in, so
    every rank calls the same collectives in the same order; the final bucket never
    starts here (it carries the loss: allreduce starts it). With overlap, a
    post-accumulate-grad hook on every parameter counts down its bucket; when all of a
    bucket's gradients are there and the step has a weight, the bucket is weighted (unless
    backward(loss) seeded the weight: `prescaled`) and its non-blocking sum-allreduce
    (Iallreduce) starts, while backward goes on. MPICH moves a non-blocking collective on
    only inside MPI calls: every hook Tests the oldest request in flight, so
    communication progresses between the layers' backward kernels."""

    def __init__(self, buffer: GradientBuffer, transport, overlap: bool):
        self.buckets = buffer.bucket_views       # what the weighting pass scales
        self.world = transport                   # the step's transport unless route() gave another
        self.sizes = [len(indices) for indices in buffer.layout]
        self.last = len(buffer.layout) - 1       # the final bucket
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook_for(buffer, index))
                      for index, p in enumerate(buffer.params)] if overlap else []
        self.measure, self.norm_slot = False, None   # measure_into: the squared norm of this rank's gradient
        self.local_squared = 0.0                     # ... of the last step (0: no samples, out of the sum)
        self.reset()

    def reset(self) -> None:
        """A new step: no bucket started, no weight yet."""
        self.weight = None                       # set by zero_grad(weight) or arm: hooks may start buckets
        self.prescaled = False                   # backward(loss) seeded the gradients with the weight
        self.holding = False                     # a micro-batch before the last: no bucket is complete yet
        self.left = list(self.sizes)             # gradients still to come, per bucket
        self.next = 0                            # next bucket to start
        self.requests = []                       # in flight: buckets 0 .. self.next - 1
        self.oldest = 0                          # first request not known to be complete
        self.squared = 0.0                       # measure: the squared norm of the buckets started so far
        self.route(self.world)

    def route(self, transport) -> None:
        """The step's buckets go through `transport` (before any has started)."""
        if self.requests and transport is not self.transport:
            raise RuntimeError("a step's route changed after its first bucket had started")
        self.transport = transport
        self.gated = transport.deferred          # its requests may begin late (their data on a GPU)

    def _hook_for(self, buffer: GradientBuffer, index: int):
        bucket = buffer.bucket_of[index]
        ptr = buffer.grad_ptr[index]

        def hook(p):
            if p.grad is None or p.grad.data_ptr() != ptr:
                buffer.adopt(index)
            if self.holding:
                return
            self.left[bucket] -= 1
            if bucket < self.next:
                raise RuntimeError("a gradient changed after its bucket's allreduce had started: with overlap, "
                                   "run one backward per step between zero_grad() and allreduce()")
            if self.left[bucket] == 0 and self.weight is not None:
                self.start_ready()
            elif self.oldest < len(self.requests):
                self.progress()
        return hook

    def start(self, bucket: int, weight: float) -> None:
        """Weight `bucket` (unless backward did) and start its sum; it is the next one in order."""
        if self.measure:
            self.squared = self.squared + squared_norm(self.buckets[bucket], weight if self.prescaled else 1.0)
        if weight != 1.0 and not self.prescaled:
            scale(self.buckets[bucket], weight)
        self.transport.stage(bucket)
        self.requests.append(self.transport.start(bucket))
        self.next = bucket + 1

    def measure_into(self, slot: int) -> None:
        """Every step from now on writes the squared norm of this rank's own gradient (its mean
        over the local batch, before the weighting) into extra slot `slot` (gradient_noise.py)."""
        self.measure, self.norm_slot, self.local_squared = True, int(slot), 0.0

    def note_final(self, final, weight: float) -> None:
        """The step's squared norm, with the final bucket's (before it is weighted)."""
        if self.measure:
            self.local_squared = float(self.squared + squared_norm(final, weight if self.prescaled else 1.0))

    def noted(self, extra):
        """The tail's extra slots with this rank's squared norm in its slot (where measured)."""
        if self.norm_slot is not None:
            extra[self.norm_slot] = self.local_squared
        return extra

    def start_ready(self) -> None:
        """Start every bucket before the final one that backward has filled, in order."""
        while self.next < self.last and self.left[self.next] <= 0:
            self.start(self.next, self.weight)
        self.progress()

    def progress(self) -> None:
        """Let MPICH move the buckets in flight on (it does only inside MPI calls); on a GPU,
        begin the collectives of the buckets whose data has become ready, in bucket order."""
        requests = self.requests
        while self.oldest < len(requests) and requests[self.oldest].Test():
            self.oldest += 1
        if self.gated:
            for r in requests[self.oldest:]:
                if not r.begin(block=False):
                    break

    def close(self) -> None:
        """Remove the hooks."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


class GradientExchange(GradientBuffer):
    """Sample-weighted gradient allreduce over flat buckets that the .grad tensors view
    (the module's docstring: a step, overlap, the final bucket, waiting). A step is
    `zero_grad(weight)` (or `arm(weight, route)` on zeroed gradients), `backward(loss)`
    (or loss.backward()), then `reduce` (or `allreduce`) over the step's route."""

    def __init__(self, comm: MPI.Comm, params, timeout: float = 600.0, sleep_while_waiting: bool = False,
                 bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 overlap: bool = True, transport: str = "host", stage: bool | None = None, extra: int = 0):
        self.comm = comm
        self.timeout = timeout
        self.world_size = comm.Get_size()
        params = [p for p in params if p.requires_grad]
        device = _one_float32_device(params)
        # Every rank must take the same waiting path (the Ibarrier is a collective): the
        # caller agrees it (DistributedOptimizer does, with its other settings).
        self.sleep_while_waiting = bool(sleep_while_waiting) and self.world_size > 1
        layout = bucket_layout([p.numel() for p in params], bucket_bytes, first_bucket_bytes)
        self.extra_slots = int(extra)
        super().__init__(params, layout, 1 + self.extra_slots, device)
        self.agreed = transport           # the name every rank agreed (a CPU rank of a cuda-aware job moves host memory)
        self.world = Route(transports.make(transport, comm, self.flat, self.bounds, timeout, stage, 1 + extra),
                           comm, tail=True)
        self.last_route = self.world     # the route of the last step reduced
        # On a GPU the hooks run on autograd's device thread: MPI calls from there need
        # MPI_THREAD_MULTIPLE (mpi4py's default); without it every bucket starts in allreduce().
        self.overlap = bool(overlap) and self.world_size > 1 and len(self.layout) > 1 and (
            not self.flat.is_cuda or MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        self._schedule = BucketSchedule(self, self.world.transport, self.overlap)

    @property
    def transport(self):
        """The transport of the last step reduced (the world's until a step went through a group's)."""
        return self.last_route.transport

    @property
    def busy(self) -> bool:             # buckets started during backward are being reduced
        return bool(self._schedule.requests)

    @property
    def num_buckets(self) -> int:
        return len(self.layout)

    def close(self) -> None:             # the hooks go, the .grad views stay
        self._schedule.close()
        self.overlap = False

    # --- a step ---------------------------------------------------------------
    def zero_grad(self, weight: float | None = None) -> None:
        """Zero all gradients and begin a step. With this rank's weight (b_i/B), buckets
        start as soon as backward has filled them; without, everything starts in reduce()."""
        schedule = self._schedule
        if schedule.requests:
            raise RuntimeError("zero_grad() while gradient buckets are still being reduced: call reduce() once "
                               "after every backward")
        schedule.reset()
        self.flat.zero_()
        schedule.weight = None if weight is None else float(weight)

    def arm(self, weight: float, route: Route | None = None) -> None:
        """Begin a step on zeroed gradients: buckets may start during backward, weighted
        by `weight`, over `route` (default: the world's)."""
        schedule = self._schedule
        if schedule.requests:
            raise RuntimeError("arm() while gradient buckets are still being reduced: call allreduce() once "
                               "after every backward")
        schedule.route((route or self.world).transport)
        schedule.weight = float(weight)

    def route_over(self, sub: MPI.Comm) -> Route:
        """A route over `sub` (some of this exchange's ranks): the gradients alone (the tail goes
        over the world: sum_tail), by MPI on host memory, staged into the world's host copy."""
        tail = 1 + self.extra_slots
        if sub.Get_size() == 1:
            return Route(transports.Local(self.flat, tail), sub)
        bounds = [*self.bounds[:-1], (self.bounds[-1][0], self.numel)]     # the tail stays out
        part = transports.HostMPI(sub, self.flat, bounds, self.world.transport.staged, tail)
        part.share_host_copy(self.world.transport)
        return Route(part, sub)

    def measure_norm(self, slot: int) -> None:
        """Each step writes this rank's squared gradient norm into extra slot `slot` (BucketSchedule.measure_into)."""
        self._schedule.measure_into(slot)

    def hold(self, holding: bool) -> None:
        """Gradient accumulation (accumulation.py): while holding, backward's hooks start
        no bucket (the gradients are a partial sum); the last micro-batch's backward does."""
        self._schedule.holding = bool(holding)

    def backward(self, loss: torch.Tensor, share: float = 1.0) -> None:
        """loss.backward(), seeded with this rank's weight (armed): autograd produces weight *
        gradient, no bucket needs a scaling pass (without a weight, reduce() scales).
        share: a micro-batch's part of the local batch, which multiplies the seed."""
        schedule = self._schedule
        # (loss * seed).backward() rather than loss.backward(seed): the same gradients, bit
        # for bit, without autograd's check of a given seed (its first call imports sympy, ~2 s)
        if schedule.weight is None or schedule.weight == 1.0:
            (loss if share == 1.0 else loss * share).backward()
            return
        if schedule.left != schedule.sizes and not schedule.prescaled:
            raise RuntimeError("backward(loss) after a plain backward in the same step: the gradients would "
                               "be weighted unevenly")
        schedule.prescaled = True
        (loss * (schedule.weight * share)).backward()

    def allreduce(self, weight: float, loss_share: float, extra=None) -> float:
        """reduce() over the world; returns the global mean loss alone."""
        return self.reduce(weight, self.world, loss_share, extra).loss

    def reduce(self, weight: float, route: Route | None = None, loss_share=0.0, extra=None) -> StepSums | None:
        """The one routine that completes a step: .grad <- the sum over `route`'s ranks
        (default: the world's) of weight_r * grad_r, weight being b_i/B (1/n: plain
        averaging) as armed. The world's route carries the tail in its final bucket:
        loss_share (loss_i b_i/B: its sum is the global mean loss) and `extra`; returns
        their sums. A group's route sums the gradient alone (None; then sum_tail)."""
        route = route or self.world
        weight = float(weight)
        schedule = self._schedule
        if schedule.weight is not None and weight != schedule.weight:
            raise RuntimeError(f"allreduce(weight={weight:g}) but zero_grad was given weight {schedule.weight:g}: "
                               f"the buckets already started were scaled by that")
        if route.tail and self.extra_slots and (extra is None or len(extra) != self.extra_slots):
            raise ValueError(f"allreduce: {self.extra_slots} extra values expected (the balancer's telemetry, the "
                             f"stop flags)")
        last = schedule.last
        self.adopt_grads()
        try:
            schedule.route(route.transport)
            self.last_route = route
            while schedule.next < last:    # not started yet (no backward, unused parameters, no weight given)
                schedule.start(schedule.next, weight)
            schedule.note_final(self.final_grads, weight)
            if weight != 1.0 and not schedule.prescaled:
                scale(self.final_grads, weight)
            transport = route.transport
            transport.stage(last)
            if route.tail:
                transport.set_tail(loss_share, schedule.noted(extra) if self.extra_slots else None)
            if route.comm.Get_size() > 1:
                # Every bucket's collective is under way before the barrier (on a GPU some
                # wait for their data): all ranks call the collectives in the same order.
                transport.begin_all(schedule.requests)
                if self.sleep_while_waiting:
                    wait(route.comm.Ibarrier(), self.timeout, f"{WHAT} (waiting for the other ranks)")
                SUPERVISOR.arm(self.comm, self.timeout, WHAT)
                try:
                    transport.reduce(last, schedule.requests)
                    transport.wait(schedule.requests)
                finally:
                    SUPERVISOR.disarm()
            transport.finish()
            return _tail_sums(self, transport, isinstance(loss_share, torch.Tensor)) if route.tail else None
        finally:
            schedule.reset()

    def sum_tail(self, loss_share: float, extra=None, sleep: bool = False) -> StepSums:
        """The step's tail alone summed over the world (a step whose gradient went over a
        group, or over none on this rank): a non-blocking allreduce, waited for sleeping
        where the wait policy or `sleep` (a probe computes beside: prober.py) says so, else
        polling (the same call on every rank, whichever way each waits)."""
        extra = () if extra is None else self._schedule.noted(extra)
        tail = np.array([float(loss_share), *extra], dtype=np.float32)
        if self.world_size > 1:
            pause = POLL_SLEEP_MAX if self.sleep_while_waiting or sleep else 0.0
            wait(self.comm.Iallreduce(MPI.IN_PLACE, tail, op=MPI.SUM), self.timeout,
                 f"{WHAT} (the step's loss and times)", pause)
        return StepSums(float(tail[0]), tail[1:].copy() if self.extra_slots else None)

    def drop_step(self) -> None:
        """This rank sums no gradient in this step (it is out of the step's group)."""
        if self._schedule.requests:
            raise RuntimeError("a rank out of the step's group started gradient buckets")
        self._schedule.reset()
        self._schedule.local_squared = 0.0



def _tail_sums(exchange: GradientExchange, transport, on_device: bool = False) -> StepSums:
    """The loss slot's sum (a float; on_device: a 0-dim tensor, read by nothing: after
    finish() every transport has the sums in the buffer) and the extra slots'."""
    loss = exchange.flat[exchange.numel].clone() if on_device else transport.loss()
    return StepSums(loss, transport.extra() if exchange.extra_slots else None)


def _one_float32_device(params) -> torch.device:
    """The one device of `params`, all float32: what one flat buffer can hold (checked
    before any collective, so that a wrong model fails on its own rank, at once)."""
    for p in params:
        if p.dtype != torch.float32:
            raise TypeError("GradientExchange supports float32 parameters only")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"GradientExchange: the parameters are on several devices ({sorted(map(str, devices))}); "
                         f"move the model to one device (model.to(device)) before wrapping the optimizer")
    return devices.pop() if devices else torch.device("cpu")


def squared_norm(view, seed: float):
    """|view / seed|^2 (0 where seed is 0: no samples); a float, or a 0-dim tensor on a GPU
    (read once, at the end of the step)."""
    if seed == 0.0:
        return 0.0
    if isinstance(view, np.ndarray):
        return float(np.dot(view, view)) / (seed * seed)
    return torch.dot(view, view) / (seed * seed)


def scale(view, weight: float) -> None:
    """view *= weight, in place (a numpy view of CPU memory, or a tensor on its device)."""
    if isinstance(view, np.ndarray):
        np.multiply(view, weight, out=view)
    else:
        view.mul_(weight)
