"""Devices: which device every rank computes on, and a clock that is true on it.

The papers' platforms mix CPUs and GPUs: one multicore CPU rank beside one rank per GPU
(heterogeneous gradient computing), or several workers sharing one GPU (DBS). A rank's
device comes from one of

  auto     the ranks of a node take its GPUs by local rank while there are GPUs; the
           others compute on the CPU. A GPU counts once per node, whichever ranks see it
           (CUDA_VISIBLE_DEVICES may differ per rank: a scheduler binding one GPU per
           task gives every rank its own).
  cpu      the CPU.
  cuda     a GPU of the node by local rank: local rank k takes visible GPU k mod count
           (several ranks on one GPU when there are more ranks than GPUs).
  cuda:N   GPU N of the ones this rank sees.

and a per-rank list (`devices = ["cuda", "cuda", "cpu"]`) sets each rank's own. A
device that does not exist is the user's mistake: one line naming it, on every rank.

Threads. A GPU rank's host thread launches kernels and copies batches: one core. The
CPU ranks of a node share the node's other cores:

    threads(CPU rank) = (cores of the node - GPU ranks on the node) // CPU ranks on the node

A core of its own. Sharing cores with busy CPU ranks slows that host thread, and with it
the GPU (measured on an H100 node, docs/performance.md, "GPU figures"). On a node that mixes GPU and
CPU ranks which the launcher left unbound (every rank of the node may run on the same
cores), `select` keeps the CPU ranks' threads off one core per GPU rank (with its SMT
siblings; `core_plan`), so the GPU ranks' host threads find a core nobody computes on.
A launcher's own binding (`mpirun -bind-to core`, `srun --cpu-bind`) is left as it is.
DBS_MPI_BIND chooses: `cpu` (the default: as above; the GPU ranks stay unbound, so
their DataLoader workers, which inherit a binding, keep every core), `gpu` (the GPU
ranks bound to their cores as well), `none`.

Timing. CUDA runs asynchronously: a wall clock around a forward and backward measures
the kernel launches, not the compute. `synchronize(device)` waits for the device's
queued work, so a clock read after it (the start-up calibration, the optimizer's step
clock) sees the real compute, and DBS allocates from true speeds. Emulated speeds
stretch a GPU rank's synchronised wall time (its CPU time says nothing about its
device's work).

No MPI here except in `select` (one allgather of every rank's host and visible GPUs).
"""
from __future__ import annotations

import ctypes
import os
import platform
import socket

import torch
from mpi4py import MPI

from ..options import DEVICE_SPEC, UserError
from . import placement
from .agreement import collective
from .collectives import allgather_object


def check_spec(spec: str, what: str = "device") -> str:
    """A device option's value, checked for its syntax (auto, cpu, cuda, cuda:N)."""
    spec = str(spec).strip().lower()
    if not DEVICE_SPEC.match(spec):
        raise UserError(f"{what}: {spec!r} is not a device; use auto, cpu, cuda or cuda:N")
    return spec


def visible_gpus() -> list[str]:
    """Identities of the GPUs this process sees, in CUDA's order: their UUIDs (the same
    GPU has the same UUID in every process of a node, whatever CUDA_VISIBLE_DEVICES says)."""
    if not torch.cuda.is_available():
        return []
    ids = []
    for index in range(torch.cuda.device_count()):
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        ids.append(str(uuid) if uuid is not None else f"index {index}")
    return ids


def gpu_identity(device) -> tuple[str, str]:
    """(host, UUID) of a GPU device: equal for two ranks on the same GPU."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return socket.gethostname(), visible_gpus()[index]


def assign(specs: list[str], inventory: list[tuple[str, list[str]]]) -> list[str]:
    """Every rank's device ("cpu" or "cuda:i", i an index into that rank's visible GPUs).

    specs: one device spec per rank (auto | cpu | cuda | cuda:N). inventory: (host,
    visible GPU identities) per rank, in rank order. Raises UserError naming the first
    rank whose device does not exist. Pure: the same answer on every rank."""
    local_rank, taken = {}, {}
    out = []
    for rank, (spec, (host, gpus)) in enumerate(zip(specs, inventory)):
        k = local_rank.get(host, 0)
        local_rank[host] = k + 1
        used = taken.setdefault(host, set())
        if spec == "cpu":
            out.append("cpu")
        elif spec == "auto":
            free = [i for i, g in enumerate(gpus) if g not in used]
            if free:
                used.add(gpus[free[0]])
                out.append(f"cuda:{free[0]}")
            else:
                out.append("cpu")
        else:
            out.append(_cuda(rank, spec, host, gpus, k))
            used.add(gpus[int(out[-1].split(":")[1])])
    return out


def _cuda(rank: int, spec: str, host: str, gpus: list[str], local_rank: int) -> str:
    if not gpus:
        why = "torch.cuda.is_available() is False" + (
            f"; this torch ({torch.__version__}) is a CPU-only build" if torch.version.cuda is None else "")
        raise UserError(f"device: {spec} requested for rank {rank} on {host}, which has no CUDA device ({why})")
    if spec == "cuda":
        return f"cuda:{local_rank % len(gpus)}"
    index = int(spec.split(":")[1])
    if index >= len(gpus):
        raise UserError(f"device: {spec} requested for rank {rank} on {host}, which sees {len(gpus)} CUDA "
                        f"device(s) (cuda:0 .. cuda:{len(gpus) - 1})")
    return spec


def per_rank_specs(device: str, devices, world_size: int) -> list[str]:
    """One device spec per rank: the per-rank list if given (its length must be the world
    size), else `device` for everybody."""
    if devices:
        if len(devices) != world_size:
            raise UserError(f"devices: has {len(devices)} entries but there are {world_size} ranks")
        return [check_spec(d, "devices") for d in devices]
    return [check_spec(device)] * world_size


def select(comm, device: str = "auto", devices=None, timeout: float = 600.0,
           threads: bool | None = None) -> torch.device:
    """Collective: this rank's torch.device (see the module docstring); every rank fails
    together, one line from the rank that names the problem, if a device does not exist.
    The GPU becomes the rank's current CUDA device. threads: set this rank's torch threads
    to its share (`cpu_threads`: 1 on a GPU rank, the cores GPU ranks leave on a CPU rank);
    None: unless dbs_mpi.init(threads=...) was given them."""
    def choose():
        specs = per_rank_specs(device, devices, comm.Get_size())
        inventory = allgather_object(comm, (socket.gethostname(), visible_gpus()), timeout,
                                     "gathering every rank's GPUs")
        return assign(specs, inventory)

    # The specs (and DBS_MPI_BIND) are checked on every rank together before anybody gathers (a rank failing
    # inside choose() before its allgather would leave the others waiting); the assignment
    # is then computed identically everywhere, so every rank raises the same error.
    def check():
        per_rank_specs(device, devices, comm.Get_size())
        return bind_mode()
    mode = collective(comm, check, timeout=timeout)
    chosen = collective(comm, choose, timeout=timeout)
    mine = torch.device(chosen[comm.Get_rank()])
    if mine.type == "cuda":
        torch.cuda.set_device(mine)
    places = placement.placement(comm, timeout)    # collective on every rank, whatever each decides below
    cores = core_plan(places, chosen, siblings, mode)[comm.Get_rank()]
    if cores is not None:
        bind_process(cores)
    if threads or (threads is None and not placement.THREADS_GIVEN):
        placement.set_torch_threads(cpu_threads(places, chosen, comm.Get_rank(), placement.thread_limit()))
    return mine


select_device = select          # the public name (dbs_mpi.select_device)


def all_devices(comm, device: torch.device, timeout: float = 600.0) -> list[dict]:
    """Every rank's `describe(device)`, in rank order (for records, thread shares, info)."""
    return allgather_object(comm, describe(device), timeout, "gathering every rank's device")


def cpu_threads(places, device_names: list[str], rank: int, limit: int | None = None) -> int:
    """Torch threads of `rank`: 1 on a GPU rank; on a CPU rank, the node's cores not taken
    by its GPU ranks' processes, shared out over its CPU ranks (at least 1).

    places: (host, cores) per rank (placement.placement); device_names: every rank's device."""
    if device_names[rank] != "cpu":
        return 1
    host = places[rank][0]
    on_node = [r for r, (h, _) in enumerate(places) if h == host]
    gpu_ranks = sum(1 for r in on_node if device_names[r] != "cpu")
    cpu_ranks = len(on_node) - gpu_ranks
    share = max(1, (placement.node_cores(places)[host] - gpu_ranks) // max(cpu_ranks, 1))
    share = min(share, len(places[rank][1]) or share)
    return min(share, limit) if limit else share


BIND_MODES = ("cpu", "gpu", "none")


def bind_mode() -> str:
    """DBS_MPI_BIND (see the module docstring), checked."""
    mode = os.environ.get("DBS_MPI_BIND", "cpu").strip().lower() or "cpu"
    if mode not in BIND_MODES:
        raise UserError(f"DBS_MPI_BIND: must be one of {', '.join(BIND_MODES)}; got {mode!r}")
    return mode


def core_plan(places, device_names: list[str], smt=None, mode: str = "cpu") -> list[set[int] | None]:
    """The cores each rank is bound to (None: left as it is): on a node with GPU and CPU
    ranks whose affinity sets are all the same (the launcher bound nothing), GPU rank j
    of the node gets the j-th core of the set with its SMT siblings (`smt(core)`), the
    CPU ranks every core no GPU rank took; only where at least one core is left per CPU
    rank. mode "cpu" (the default) leaves the GPU ranks unbound (their cores are only
    kept free of CPU ranks); "none": nobody is bound.
    places: (host, cores) per rank (placement.placement); pure."""
    smt = smt or (lambda core: {core})
    plan: list[set[int] | None] = [None] * len(places)
    if mode == "none":
        return plan
    for host in dict.fromkeys(h for h, _ in places):
        ranks = [r for r, (h, _) in enumerate(places) if h == host]
        gpu = [r for r in ranks if device_names[r] != "cpu"]
        cpu = [r for r in ranks if device_names[r] == "cpu"]
        if not gpu or not cpu or len({places[r][1] for r in ranks}) != 1:
            continue
        free = sorted(places[ranks[0]][1])
        taken = []
        for r in gpu:
            if not free:
                break
            own = {c for c in smt(free[0]) if c in free} | {free[0]}
            taken.append((r, own))
            free = [c for c in free if c not in own]
        if len(taken) < len(gpu) or len(free) < len(cpu):
            continue
        for r, own in taken:
            plan[r] = own if mode == "gpu" else None
        for r in cpu:
            plan[r] = set(free)
    return plan


def siblings(core: int) -> set[int]:
    """The SMT siblings of `core` (itself included), from Linux's sysfs; {core} elsewhere."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {core}
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out or {core}


def bind_process(cores: set[int]) -> None:
    """Bind every thread of this process (and those it starts later) to `cores`."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:                     # pragma: no cover - not Linux
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:                 # a thread that ended meanwhile
            pass


def synchronize(device) -> None:
    """Wait for the work queued on `device`'s current stream, the compute (nothing to wait
    for on the CPU). Not the whole device: NCCL's stream may hold all-reduces of earlier
    buckets that wait for slower ranks, which is not this rank's compute."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def describe(device) -> dict:
    """Name and memory of a device, for `dbs-mpi info` and the result file."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": str(device), "name": props.name, "memory_gib": props.total_memory / 2 ** 30,
                "capability": f"{props.major}.{props.minor}"}
    memory = _proc_field("/proc/meminfo", "MemTotal")
    return {"device": "cpu", "name": _proc_field("/proc/cpuinfo", "model name") or platform.machine(),
            "memory_gib": int(memory.split()[0]) / 2 ** 20 if memory else float("nan"), "capability": ""}


def _proc_field(path: str, key: str) -> str:
    """The value of the first `key: value` line of a /proc file ("" if there is none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.split(":")[0].strip() == key:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cuda_versions() -> dict:
    """The CUDA and cuDNN versions this torch was built with (None where absent)."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"cuda": torch.version.cuda, "cudnn": cudnn, "gpus": torch.cuda.device_count()}


def mpi_cuda_aware() -> bool | None:
    """Whether the MPI library takes device buffers: MPIX_Query_cuda_support() (MPICH and
    Open MPI export it), None if the library cannot say."""
    try:
        query = getattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support", None)
    except OSError:
        return None
    if query is None:
        return None
    query.restype = ctypes.c_int
    return bool(query())


def to_device(batch, device, non_blocking: bool = True):
    """A batch (tensor, or tuple/list/dict of them) on `device`; a CPU batch bound for a
    GPU goes through pinned memory with a non-blocking copy (nothing moves on the CPU;
    copies to the CPU block, so that the result can be read at once)."""
    device = torch.device(device)
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=non_blocking and device.type == "cuda")
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (or buffer); the CPU for a model with none."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def memory_format(model: torch.nn.Module) -> torch.memory_format:
    """channels_last where a 4-d weight of the model is in that order and not also plain
    contiguous, as a 1x1 kernel's is either way (`--channels-last`, or a user's
    model.to(memory_format=...)), else contiguous: the order its inputs take."""
    for p in model.parameters():
        if p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous():
            return torch.channels_last
    return torch.contiguous_format


def in_format(x, fmt: torch.memory_format):
    """x (a 4-d batch) in memory format `fmt`; anything else as it is."""
    return x.contiguous(memory_format=fmt) if isinstance(x, torch.Tensor) and x.dim() == 4 else x


def autocast_dtype(device) -> torch.dtype | None:
    """The dtype torch.autocast computes `device`'s forward in on this thread (None: off),
    which a thread of its own (the probes) does not inherit."""
    kind = torch.device(device).type
    try:
        on = torch.is_autocast_enabled(kind)
    except TypeError:             # (torch before 2.4: no device argument)
        on = torch.is_autocast_cpu_enabled() if kind == "cpu" else torch.is_autocast_enabled()
    if not on:
        return None
    try:
        return torch.get_autocast_dtype(kind)
    except AttributeError:        # (torch before 2.4)
        return torch.get_autocast_cpu_dtype() if kind == "cpu" else torch.get_autocast_gpu_dtype()
