"""PyTorch DistributedDataParallel over uneven local batches: sample-weighted gradients.

DDP averages the ranks' gradients,

    g_ddp = (1/n) sum_i g_i            (n ranks; g_i = gradient of rank i's mean loss)

which is the gradient of the mean loss over the step's global batch only when every
local batch has the same size. With dbs-mpi's uneven local batches b_i (HeteroSampler;
B = sum_i b_i, the last step of an epoch may be partial, a rank may have b_i = 0) that
gradient is (docs/method.md, "Sample-weighted gradients")

    g = (1/B) sum over the B samples of grad(loss_k) = sum_i (b_i / B) g_i

`sample_weighted(ddp_model)` makes DDP compute g, with a DDP communication hook that
reduces every gradient bucket as

    bucket_i * b_i  --all_reduce(SUM)-->  sum_i b_i g_i  --divide by B-->  g

A comm hook gets the rank's raw local gradient: DDP divides by the world size only in
its built-in reduction, never before a registered hook (torch's register_comm_hook:
"Grad bucket's tensors will not be predivided by world_size"; its default hook divides
itself: `tensor.div_(group_to_use.size())`), so nothing has to be undone.

Where b_i and B come from (the forward pre-hook that sample_weighted registers on the
DDP model counts training-mode forwards with grad enabled, the ones a backward follows):

* counted (default): b_i is the leading dimension of the forward's first tensor input
  (a batch whose first input is not batch-first: set `state.local_batch = n` before
  the forward). B is summed over the ranks by one more all_reduce of the 1-element
  tensor [b_i], issued with the step's first bucket, so it overlaps backward; every
  bucket's division waits for it. A rank may feed an empty batch (b_i = 0): its
  buckets are zeroed (not multiplied, so a NaN gradient of an empty mean cannot leak).
  Any uneven sampler works, and no host synchronisation is needed on GPUs.
* balancer= (for HeteroSampler loops): b_i and B are read from the balancer's table of
  the step, the table the sampler serves, so no collective is needed for B. This is the
  mode that makes the zero-sample rank exact: HeteroSampler gives a rank whose share of
  the last, partial step is 0 one placeholder sample (the step's first), so that every
  rank runs forward and backward (DDP needs every rank's buckets); counted, it would
  weigh 1 and enter the gradient twice. The table says b_i = 0: the bucket is zeroed.
  The forward's batch length is checked against the table ((b_i or 1) samples, a
  mismatch raises, check_batch=False turns it off). And a HeteroSampler loop needs the
  balancer's step counter to move on: DistributedOptimizer.step() does it in its own
  loop; here the hook does, when the step's last bucket is reduced (balancer.record_step,
  with the step's data, compute and last-collective times, so end_epoch() works and
  dbs re-plans from measured compute; the loss is not known here: NaN). Under dbs with
  a step interval, every rank's compute time of the step reaches every rank in one more
  small all_reduce issued with the last bucket (balancer.telemetry()), so the vector is
  re-planned within the epoch as in DistributedOptimizer's loop. Emulated speeds
  (Balancer(speeds=...)) stretch the step's compute before its last bucket starts.

Usage (a plain torch optimizer; every rank):

    comm = dbs_mpi.init()
    device = dbs_mpi.select_device(comm)
    dbs_mpi.init_process_group(comm, device=device)   # nccl: a GPU per rank; else gloo
    model = DDP(net)                                # device_ids=[local gpu] on GPUs
    balancer = dbs_mpi.Balancer(comm, global_batch=512, policy="dbs")
    dbs_mpi.sample_weighted(model, balancer=balancer)
    sampler = dbs_mpi.HeteroSampler(ds, balancer, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()         # g = sum_i (b_i / B) g_i in every .grad
            optimizer.step()
        balancer.end_epoch()

(With any other uneven sampler: `dbs_mpi.sample_weighted(model)`, counted.)

Collectives are issued in the same order on every rank (B first, then the buckets in
order), and each bucket's division waits for B, so gloo's out-of-order completion cannot
matter. On NCCL every operation stays on the device. Gradient accumulation under DDP's
no_sync(): the forwards under it count towards the step's b_i, which the forward that DDP
reduces completes; each micro-batch's mean loss scaled by its share n_k / b_i (what
`state.micro_batches` yields with it) accumulates the local gradient g_i, which the hook
weighs by b_i as a whole batch's. With a balancer the step's micro-batches must add up to
the table's b_i; a backward that DDP reduces without a counted forward before it raises.

BatchNorm under DDP: torch.nn.SyncBatchNorm gathers every rank's sample count, so its
forward statistics are right under uneven batches, but its backward sums the ranks'
unweighted loss gradients, which is the sample-weighted gradient only when every b_i is
equal; and it refuses CPU tensors ("SyncBatchNorm expected input tensor to be on GPU",
torch 2.x, so a gloo job cannot use it at all). dbs_mpi.convert_sync_batchnorm(model,
comm) before DDP(model) gives the exact weighted backward on any device (its statistics
travel over MPI, sync_batchnorm.py); with balancer=, the layers read the step's row from
it when they run (a placeholder sample counts 0), so a torch.compile'd model gets it too.

`init_process_group(comm)` starts torch.distributed over the ranks of an MPI
communicator (rank 0 hosts the TCPStore, its address and port travel by MPI), failing
on every rank together when it fails on one.
"""
import time
import weakref

import torch
import torch.distributed as dist

from ..mpi.devices import model_device
from ..mpi.process_group import destroy_process_group, init_process_group  # noqa: F401 (documented here too)
from . import sync_batchnorm
from .event_clock import LateSteps
from .optimizer import _reads_late, batch_length
from .step_clock import StepClock

# --- the sample-weighted comm hook --------------------------------------------------

class HookClock:
    """The DDP hook's use of the step clock (step_clock.StepClock, DistributedOptimizer's
    too), in balancer mode: data from the last step's end to the first forward; compute
    from there to the last bucket, stretched there to the emulated speed; the collective
    until the last bucket's future completes, when the step is recorded (the optimizer's
    update shows in the next step's data time). On NCCL a future completes when its work
    is queued, so the collective reads about 0 and the wait for slower ranks shows in the
    next step's data time; compute, what DBS allocates from, is measured on the compute
    stream either way: by waiting for it at the last bucket, or, where nothing else needs
    the host to wait (optimizer._reads_late: NCCL, no emulation, no re-planning within the
    epoch), by CUDA events read one or more steps later (event_clock.LateSteps)."""

    def __init__(self, balancer, device: torch.device, late: LateSteps | None = None):
        self.balancer = balancer
        self.clock = StepClock([], device, late)
        self.began = (0.0, None, 0.0)   # the compute's start, CPU seconds and SyncBatchNorm seconds
        self.pre_end = 0.0

    def start(self) -> None:
        self.clock.forward()

    def end_compute(self, row) -> None:
        """At the last bucket: the compute ends when the device is done (not when backward's
        last kernel was launched), and emulated speeds stretch that wall time (row: the
        step's local batches, which a coupled rank's stretch reads)."""
        end = self.clock.boundary()
        self.began = began, cpu, in_sync = self.clock.compute(True)
        self.balancer.stretch(end - began - in_sync, cpu, row)
        self.pre_end = time.perf_counter()

    def telemetry(self, device: torch.device, group):
        """dbs within the epoch: the future of the sum of every rank's balancer.telemetry()
        (its compute time of this step, its sampler's position, rank 0's proposal); None
        where the balancer needs none. Issued with the last bucket, in the same order on
        every rank."""
        values = self.balancer.telemetry(self.pre_end - self.began[0] - self.began[2])
        if values is None:
            return None
        tensor = torch.tensor(values, device=device)          # a copy: the all_reduce works in place
        return dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def end_step(self, telemetry=None) -> None:
        """The step is over (its last bucket's future completed): record it, with the sum of
        telemetry if any. DDP waits for this before backward() returns, so a new vector is
        in the balancer's table before the loop asks the sampler for more."""
        end = time.perf_counter()
        summed = None if telemetry is None else telemetry.wait()[0].cpu().numpy()
        began, _, in_sync = self.began
        times = (max(began - self.clock.last_end, 0.0), self.pre_end - began - in_sync, end - self.pre_end + in_sync)
        self.clock.record(self.balancer, end, times, float("nan"), summed, update=False)    # late: 2 phases
        self.clock.restart(end)


class SampleWeightedState:
    """What the hook needs for the step under way: the process group, this rank's local
    batch b_i (`local_batch`, set by the forward pre-hook, or by hand before the
    forward), and the global batch B of the step (a number from the balancer, or the
    future of the all_reduce of [b_i]).

    balancer: read b_i and B from its table of the step, and move its step counter on
    when the step's last bucket is reduced (see the module's docstring). check_batch:
    with a balancer, check the forward's batch length against the table."""

    def __init__(self, process_group=None, balancer=None, check_batch: bool = True, late: LateSteps | None = None,
                 device: torch.device = torch.device("cpu")):
        self.process_group = process_group
        self.balancer, self.check_batch = balancer, bool(check_batch)
        self.clock = HookClock(balancer, device, late) if balancer is not None else None
        self._local = None            # b_i of the step under way
        self._total = None            # B (balancer) or, from the first bucket on, the future of its all_reduce
        self._row = None              # the step's local batches (balancer), read at its forward
        self._armed = False           # a counted forward (or a hand-set local_batch) since the last backward
        self._pending = 0             # samples of this step's forwards under no_sync() (accumulated micro-batches)
        self._by_hand = False         # local_batch was set by hand for this step
        self.batchnorm = None         # the model's SyncBatchNorm layers' StepShare (they read the balancer's row)
        self._model = None            # a weak reference to the DDP model (micro_batches)

    @property
    def local_batch(self) -> "int | None":
        """This rank's samples in the step under way (None before the first forward)."""
        return self._local

    @local_batch.setter
    def local_batch(self, samples: int) -> None:
        if self.balancer is not None:
            raise AttributeError("local_batch comes from the balancer's table of the step; set it by hand only "
                                 "without a balancer")
        if int(samples) < 0:
            raise ValueError(f"local_batch: must be >= 0; got {samples}")
        self._local, self._armed, self._by_hand = int(samples), True, True

    # --- forward --------------------------------------------------------------------
    def on_forward(self, module, args, kwargs) -> None:
        """The DDP model's forward pre-hook: a forward that a reduced backward may follow.
        Under DDP's no_sync() (a micro-batch of an accumulated step) its samples are
        counted towards the step's b_i, which the forward that DDP reduces completes."""
        if not module.training or not torch.is_grad_enabled():
            return
        seen = batch_length(args, kwargs)
        if not module.require_backward_grad_sync:
            self._count_micro_batch(module, seen)
            self._pending += seen or 0
        else:
            step = None if seen is None else self._pending + seen      # the step's samples, micro-batches too
            self._pending = 0
            if self.balancer is not None:
                self._arm_from_balancer(step)
            elif not self._by_hand:
                if step is None:
                    raise RuntimeError(_NO_COUNT)
                self._local = step
        if not self._armed and self.clock is not None:
            self.clock.start()
        self._armed = True

    def _count_micro_batch(self, module, seen: "int | None") -> None:
        """A forward under no_sync(): its samples count towards the step's local batch."""
        if sync_batchnorm.layers(module.module):
            raise RuntimeError("sample_weighted: gradient accumulation under DDP's no_sync() with SyncBatchNorm "
                               "layers: they normalise over the step's global batch, which micro-batches would cut "
                               "into parts; feed the whole local batch in one forward, or use GroupNorm/LayerNorm")
        if seen is None and not self._by_hand:
            raise RuntimeError(_NO_COUNT)
        if self.balancer is not None and self.check_batch and seen is not None:
            row = self.balancer.step_batch_sizes()
            local = int(row[self.balancer.rank])
            if self._pending + seen >= (local or 1):
                raise RuntimeError(self._mismatch(self._pending + seen, local, row, "before the forward that DDP "
                                                  "reduces (the last, outside no_sync())"))

    def _arm_from_balancer(self, seen: "int | None") -> None:
        b = self.balancer
        row = b.step_batch_sizes()            # raises, saying what to do, when no epoch is open
        local = int(row[b.rank])
        if self.check_batch and seen is not None and seen != (local or 1):
            raise RuntimeError(self._mismatch(seen, local, row, "by the forward that DDP reduces"))
        self._local, self._total, self._row = local, int(row.sum()), row

    def _mismatch(self, seen: int, local: int, row, when: str) -> str:
        b = self.balancer
        return (f"rank {b.rank}, step {b.step + 1} of epoch {b.open_epoch + 1}: the DDP model got {seen} sample(s) "
                f"in this step {when}, but this rank's local batch is {local} (step's local batches "
                f"{row.tolist()}), so the gradient would be weighted wrongly. Feed it the batches of "
                f"dbs_mpi.HeteroSampler (DataLoader(dataset, batch_sampler=sampler)), one forward and backward per "
                f"batch, or its micro-batches under no_sync() and the last outside it; pass check_batch=False if "
                f"the model's first input is not batch-first")

    # --- accumulation -----------------------------------------------------------------
    def micro_batches(self, tensors, size: int):
        """Gradient accumulation under DDP: this rank's local batch `tensors` (batch-first
        tensors) in micro-batches of at most `size` samples, each with its weight n_k / b_i,
        all but the last under the DDP model's no_sync():

            for (xm, ym), weight in state.micro_batches((x, y), 64):
                (loss_fn(model(xm), ym) * weight).backward()

        The accumulated .grad is then the local batch's mean gradient g_i, which the hook
        weighs by b_i as a whole batch's (a plain no_sync() loop that scales each
        micro-batch's mean loss by n_k / b_i is the same)."""
        model = self._model() if self._model is not None else None
        if model is None:
            raise RuntimeError("micro_batches: the state has no DDP model (make it with dbs_mpi.sample_weighted)")
        tensors = tuple(tensors) if isinstance(tensors, (tuple, list)) else (tensors,)
        if int(size) < 1:
            raise ValueError(f"micro_batches: size must be at least 1; got {size}")
        local = len(tensors[0])
        if any(len(t) != local for t in tensors):
            raise ValueError(f"micro_batches: the tensors hold {[len(t) for t in tensors]} samples; they must hold "
                             f"the same local batch")
        parts = list(zip(*(t.split(int(size)) for t in tensors)))
        for k, part in enumerate(parts):
            part = part if len(part) > 1 else part[0]
            weight = len(part[0] if isinstance(part, tuple) else part) / max(local, 1)
            if k < len(parts) - 1:
                with model.no_sync():
                    yield part, weight
            else:
                yield part, weight

    # --- backward (from the hook) ---------------------------------------------------
    def begin_backward(self, device: torch.device, group) -> None:
        """The step's first bucket: check a counted forward came first; launch B's sum."""
        if not self._armed:
            raise RuntimeError("sample_weighted: DDP is reducing gradients, but no training forward of the DDP model "
                               "(model.train(), grad enabled) was seen since the last backward, so this rank's "
                               "local batch is unknown. Register the hook with dbs_mpi.sample_weighted(model) "
                               "(it adds the forward pre-hook that counts), and run one forward of the DDP model "
                               "before each backward, or set state.local_batch by hand")
        self._armed = self._by_hand = False
        if self.balancer is None:
            count = torch.full((1,), float(self._local), dtype=torch.float32, device=device)
            self._total = dist.all_reduce(count, group=group, async_op=True).get_future()


_NO_COUNT = ("sample_weighted: the DDP model's forward has no batch-first tensor input to count this rank's samples "
             "from; set state.local_batch = <samples> before each step's first forward (state: what sample_weighted "
             "returned)")


def _divide(reduced: torch.futures.Future, total) -> torch.Tensor:
    """sum_i b_i g_i / B, in place in the reduced bucket. total: B, or the future of its sum."""
    buffer = reduced.value()[0]
    if isinstance(total, int):
        return buffer.div_(total)
    count = total.wait()[0]
    _check_total(count)
    return buffer.div_(count)


def _check_total(count: torch.Tensor) -> None:
    message = ("sample_weighted: no rank had samples in this step (B = 0): the gradient of the mean loss over no "
               "samples is undefined; give some rank a non-empty batch")
    if count.device.type == "cpu":
        if float(count) <= 0:
            raise RuntimeError(message)
    elif hasattr(torch, "_assert_async"):
        torch._assert_async(count > 0, message)          # checked on the device: no host synchronisation


def sample_weighted_hook(state: SampleWeightedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket of the gradient sum_i (b_i / B) g_i.

    First bucket of a backward: launch the all_reduce of [b_i] (unless the balancer
    gives B). Every bucket: multiply by b_i (zero it if b_i = 0), all_reduce (SUM),
    then divide by B once B's sum is complete."""
    group = state.process_group
    buffer = bucket.buffer()
    if bucket.index() == 0:
        state.begin_backward(buffer.device, group)
    clock = state.clock if bucket.is_last() else None
    telemetry = None
    if clock is not None:
        clock.end_compute(state._row)
        telemetry = clock.telemetry(buffer.device, group)
    if state.local_batch:
        buffer.mul_(state.local_batch)
    else:
        buffer.zero_()
    total = state._total

    # The callback runs on the backend's thread and must not hold the state (nor anything
    # else that holds the process group): dropping the group's last reference there
    # would destroy the group from its own thread (gloo aborts: a thread joins itself).
    def finish(reduced):
        out = _divide(reduced, total)
        if clock is not None:
            clock.end_step(telemetry)
        return out
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(finish)


def sample_weighted(ddp_model, process_group=None, *, balancer=None,
                    check_batch: bool = True) -> SampleWeightedState:
    """Make `ddp_model` (a DistributedDataParallel) reduce the sample-weighted gradient
    sum_i (b_i / B) g_i; returns the hook's state.

    process_group: default, the DDP model's. balancer: the dbs_mpi.Balancer whose
    HeteroSampler feeds the loop (b_i, B from its table: exact for the placeholder sample
    of a rank without samples, and the balancer's steps move on); without it b_i is
    counted from the forward. Call it once, before the first backward."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"sample_weighted: expects a torch.nn.parallel.DistributedDataParallel model; got "
                        f"{type(ddp_model).__name__} (wrap it: DistributedDataParallel(model))")
    group = process_group if process_group is not None else ddp_model.process_group
    if balancer is not None and (balancer.world_size, balancer.rank) != (dist.get_world_size(group),
                                                                         dist.get_rank(group)):
        raise ValueError(f"sample_weighted: the balancer's communicator (rank {balancer.rank} of "
                         f"{balancer.world_size}) is not the DDP process group (rank {dist.get_rank(group)} of "
                         f"{dist.get_world_size(group)}): make both from the same communicator "
                         f"(dbs_mpi.init_process_group(comm), Balancer(comm, ...))")
    if balancer is not None and balancer.adaptive is not None:
        raise ValueError("sample_weighted: a balancer with global_batch=\"auto\" chooses B from the ranks' gradient "
                         "norms, which DDP's hook does not carry: train it with dbs_mpi.DistributedOptimizer, or fix B")
    late = None
    if balancer is not None:
        device = model_device(ddp_model)
        balancer.on_device(device)
        backend = "nccl" if dist.get_backend(group) == "nccl" else "other"
        synced = bool(sync_batchnorm.layers(ddp_model.module)) and balancer.world_size > 1
        late = LateSteps(balancer, device) if _reads_late(device, backend, balancer, synced) else None
    state = SampleWeightedState(group, balancer, check_batch, late, model_device(ddp_model))
    state._model = weakref.ref(ddp_model)
    if balancer is not None and sync_batchnorm.layers(ddp_model.module):
        state.batchnorm = sync_batchnorm.StepShare(balancer)      # w_i = b_i / B: the hook's weights
        for layer in sync_batchnorm.layers(ddp_model.module):
            layer.share = state.batchnorm
    ddp_model.register_forward_pre_hook(state.on_forward, with_kwargs=True)
    ddp_model.register_comm_hook(state, sample_weighted_hook)
    return state
