"""Configuration: one frozen dataclass, loaded from a TOML file, then overridden
from the command line. Unknown keys and bad values raise ConfigError naming the field.

Every field has a default and a comment with its meaning and units. The whole
configuration is saved (as JSON) with every result file.
"""
from __future__ import annotations

import argparse
import json
import math
import typing
from dataclasses import dataclass, fields
from pathlib import Path

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - older Pythons on clusters
    import tomli as tomllib

from ..options import (DATA_ON_DEVICE, DEFAULT_START, DEVICE_SPEC, EXCHANGES, LR_SCALING, PARTICIPATION, ConfigError,
                       UserError, flat_toml, parse_couple, parse_interval)  # noqa: F401 (UserError)
from ..planning import schedule


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every `dbs-mpi` command: a bad command line raises UserError (one
    line, no usage block, exit 2), so that every rank of a job reports it alike."""

    def error(self, message):
        raise UserError(message)


SYNC_STRATEGIES = ("ssgd", "static", "dbs")
ASYNC_STRATEGIES = ("asgd", "nsoftsync", "dbs-sgd")   # parameter_server/
STRATEGIES = SYNC_STRATEGIES + ASYNC_STRATEGIES
AGGREGATIONS = ("weighted", "mean")
DATASETS = ("fashion-mnist", "mnist", "cifar10", "synthetic")
MODELS = ("lenet5", "mlp", "resnet20", "cifar-cnn")
NORMS = ("group", "batch")
DBS_MODELS = ("affine", "proportional")
WAIT_POLICIES = ("auto", "spin", "sleep")
OPTIMIZERS = ("sgd", "adam", "adamw")
LOADERS = ("auto", "dataloader")
AMPS = ("none", "bf16", "fp16")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")   # torch.compile's own backends


def accumulates(strategy: str, sync_bn: bool) -> bool:
    """Whether a rank of this strategy may run its share in micro-batches: the synchronous
    ones, without SyncBatchNorm (which normalises over the step's whole global batch)."""
    return strategy in SYNC_STRATEGIES and not sync_bn


@dataclass(frozen=True)
class Config:
    # --- what to train ---------------------------------------------------------
    strategy: str = "dbs"            # ssgd (equal local batches) | static (start-up benchmark) | dbs (re-planned from measured step times: every dbs_interval steps, or every epoch) | asgd | nsoftsync | dbs-sgd (parameter server)
    aggregation: str = "weighted"    # weighted: sum_i b_i*g_i / B | mean: (1/n) sum_i g_i
    dataset: str = "fashion-mnist"   # fashion-mnist | mnist | cifar10 | synthetic | MODULE:CALLABLE or file.py:CALLABLE (a factory of the split "train"/"test" returning a map-style Dataset of (tensor, int label))
    data_dir: str = ""               # folder holding <dataset>/ files; "" = $DBS_MPI_DATA_DIR, else ./data
    model: str = "lenet5"            # lenet5 | mlp | resnet20 | cifar-cnn | MODULE:CALLABLE or file.py:CALLABLE (a factory taking sample_shape and/or num_classes, returning an nn.Module)
    loss: str = ""                   # "" = cross-entropy | MODULE:CALLABLE: loss(output, target) -> mean over the batch (a class is instantiated)
    optimizer: str = "sgd"           # sgd (lr, momentum, weight_decay) | adam | adamw (lr, weight_decay); torch's fused update where it has one for the device
    num_classes: int = 0             # plug-in datasets: number of classes; 0 = the dataset's num_classes or len(classes)
    loader: str = "auto"             # auto: built-in datasets (and a plug-in's TensorDataset put on the device, data_on_device) are indexed in memory (fast path), other plug-ins go through torch's DataLoader | dataloader: always DataLoader
    data_on_device: str = "auto"     # the in-memory training and test sets in each GPU rank's memory, batches indexed and augmented there: auto (where the copies of every rank on the GPU fit in a quarter of its free memory) | on (up to half; refused where it does not fit or is not in memory) | off (gathered on the host and copied every step); with loader = dataloader: off
    loader_workers: int = 0          # DataLoader worker processes per rank (0: load in the training process)
    norm: str = "group"              # resnet20's normalisation: group (consistent across uneven local batches) | batch
    sync_bn: bool = False            # BatchNorm layers normalise over the step's global batch (dbs_mpi.SyncBatchNorm; synchronous strategies)
    compile: bool = False            # torch.compile the model's forward (default mode; the first steps compile it)
    compile_backend: str = "inductor"  # torch.compile's backend: inductor (torch's default: generated kernels) | aot_eager | eager (Dynamo's tracing alone) | cudagraphs
    micro_batch: int = 0             # gradient accumulation: each rank runs its local batch in micro-batches of at most this many samples, one exchange a step (0: all at once); not with sync_bn
    amp: str = "none"                # mixed precision (synchronous strategies): none | bf16 (autocast in bfloat16, CPU and GPU) | fp16 (autocast in float16 with loss scaling, torch.amp.GradScaler; every rank on a GPU)
    channels_last: bool = False      # convolutional models: the weights and every batch in channels-last memory order (NHWC), which GPUs' tensor-core convolutions prefer (with amp = bf16: the usual GPU recipe); synchronous strategies
    sample_dropout: bool = False     # the model's nn.Dropout layers draw masks keyed by sample (dbs_mpi.SampleDropout): the same masks at any vector, so runs with dropout agree across launches, resumes and rank counts up to float rounding; synchronous strategies
    augment: bool = False            # cifar10 training only: random crop (padding 4) and horizontal flip, seeded
    epochs: int = 3                  # passes over the training set
    global_batch: int = 512          # B: samples per step, summed over all ranks
    lr: float = 0.05                 # learning rate (the peak of a schedule)
    lr_schedule: str = "constant"    # constant | step (x lr_gamma at each of lr_milestones) | cosine (to 0 after the warm-up) | onecycle (torch's OneCycleLR, its own warm-up); stepped every step
    warmup_epochs: float = 0.0       # linear warm-up over the first epochs' steps, from lr/k to lr (k: its steps); not with onecycle
    lr_milestones: tuple = ()        # step schedule: epochs at which the lr is multiplied by lr_gamma, e.g. 30,60
    lr_gamma: float = 0.1            # step schedule: the factor at each milestone
    momentum: float = 0.9            # SGD momentum (sgd only)
    weight_decay: float = 0.0        # L2 penalty
    seed: int = 0                    # seeds model init, data order, disturbances
    subset: int = 0                  # use only the first N training samples; 0 = all
    test_subset: int = 0             # evaluate on the first N test samples; 0 = all
    drop_last: bool = False          # drop the epoch's last partial global batch
    synthetic_samples: int = 4096    # synthetic dataset: training samples (test: a quarter)
    synthetic_shape: tuple = (1, 28, 28)  # synthetic dataset: sample shape C,H,W (or CxHxW)
    synthetic_classes: int = 10      # synthetic dataset: number of classes
    # --- allocation of the global batch ---------------------------------------
    min_local_batch: int = 1         # smallest local batch any rank gets (full steps)
    max_local_batch: int = 0         # memory bound: the most samples a rank computes at once (0 = no bound); a larger share runs in micro-batches of this size (with sync_bn and the asynchronous strategies, which cannot accumulate, the largest share)
    participation: str = "auto"      # auto: static and dbs leave out a rank whose least share would slow every step (local batch 0, no forward or backward; dbs probes it and takes it back when it pays) | all: every rank takes part
    calibration_from: str = ""       # static, dbs: plan from the start-up calibration recorded in this result file (its startup/*, same number of ranks) instead of timing the ranks; two static launches from one file train alike, bit for bit
    benchmark_steps: int = 5         # start-up benchmark: timed steps at each of two local batch sizes (at most: 3 where steady)
    benchmark_warmup: int = 2        # start-up benchmark: untimed steps first
    dbs_model: str = "affine"        # affine: step time a_i + b/v_i | proportional: b/v_i (the DBS paper's rule)
    dbs_smoothing: float = 0.5       # weight of a new measurement when it is within dbs_follow of the model
    dbs_follow: float = 0.25         # relative change of a rank's speed followed at once, unsmoothed
    dbs_min_gain: float = 0.03       # re-allocate only if the predicted step time falls by this share
    dbs_interval: str = "1"          # dbs re-plans every N steps from a robust estimate of every rank's step time (the new vector applies within the epoch) | epoch: once per epoch from its compute time (the DBS paper's rule)
    dbs_window: int = 32             # steps of history per rank for dbs's step-time estimate (dbs_interval in steps)
    global_batch_auto: bool = False  # what `--global-batch auto` sets: B adapts after every epoch to the most goodput (throughput x statistical efficiency, from the measured gradient noise scale), from global_batch_start, between min_global_batch and max_global_batch; synchronous strategies
    global_batch_start: int = 0      # global_batch = auto: B0, the first epoch's global batch, which lr is tuned for (0: 128)
    min_global_batch: int = 0        # global_batch = auto: the smallest B it may choose (0: half the start); below the start the lr stays the start's
    max_global_batch: int = 0        # global_batch = auto: the largest B it may choose (0: 4096; never more than the training samples)
    lr_scaling: str = "adascale"     # global_batch = auto: the lr at B is lr x adascale (AdaScale's gain at the measured noise scale) | sqrt (sqrt(B / B0)) | linear (B / B0); schedules run on samples, an epoch is the same share of the schedule at any B
    noise_scale: bool = False        # measure the gradient noise scale every step from the ranks' gradient norms (step/noise_scale, step/grad_sq, step/grad_trace); synchronous strategies
    # --- asynchronous strategies (parameter server: rank 0 serves, the others work) ---
    softsync_n: int = 1              # nsoftsync: the server applies after floor(workers / n) gradients
    staleness_lr: bool = False       # each gradient scaled by 1/max(staleness, 1) before the optimizer: with sgd, its learning rate (alpha0 where staleness is 0); adam and adamw normalise by the gradients' running scale, so there a stale gradient counts less in their averages, and a constant staleness changes nothing
    implicit_momentum: bool = True   # asynchronous, sgd: the server's momentum is momentum - (1 - c/lambda), at least 0, since asynchrony adds about 1 - c/lambda (docs/method.md, section 8); false: momentum as given
    softsync_wait: bool = False      # nsoftsync: a worker gets new weights only once its gradient is applied (softsync_n = 1: hardsync, staleness 0); false: at once (Zhang et al.)
    time_budget: float = 0.0         # asynchronous strategies: seconds of training after which no new work is handed out; 0 = no limit (epochs still caps the run)
    # --- heterogeneity emulation -----------------------------------------------
    speeds: tuple = ()               # per-rank speed in (0, 1]: rank i computes 1/speeds[i] times slower; () = all 1
    slow_rank: int = -1              # disturbance: this rank is slowed ... (-1 = none)
    slow_factor: float = 1.0         # ... by this factor (compute time x factor) ...
    slow_epochs: tuple = (0, 0)      # ... in epochs [start, stop)
    slow_steps: tuple = (0, 0)       # ... and in the run's steps [start, stop), counted from 0 over all epochs (and across resumes); asynchronous strategies: the worker's gradients
    slow_seconds: tuple = (0.0, 0.0)  # ... and from start to stop seconds of training (from the first step; evaluation and checkpoints not counted); asynchronous strategies: the worker's own
    sleep_prob: float = 0.0          # DBS paper's disturbance: per epoch and rank, chance that sleeps start
    sleep_seconds: tuple = (5.0, 10.0)  # ... extra sleep per epoch, seconds, uniform in [lo, hi]
    sleep_epochs: tuple = (4, 20)    # ... for this many epochs, uniform in [lo, hi]
    contention_rank: int = -1        # real contention: a busy process shares this rank's core ... (-1 = none)
    contention_steps: tuple = (0, 0)  # ... in the run's steps [start, stop) (not emulated: the OS shares the core)
    couple: str = ""                 # coupled speeds, RANK:K[,RANK:K...]: rank RANK computes K times slower in a step where another rank of its node computes (as a GPU beside CPU ranks); synchronous strategies
    # --- run-time ----------------------------------------------------------------
    device: str = "auto"             # auto: a node's ranks take its GPUs by local rank while there are GPUs, the others the CPU | cpu | cuda (visible GPU local rank mod count) | cuda:N
    devices: tuple = ()              # per-rank devices, e.g. cuda,cuda,cpu (overrides device); () = device on every rank
    exchange: str = "auto"           # gradient exchange: auto | host (MPI on host memory; GPU buckets staged through pinned buffers) | cuda-aware (MPI on device buffers) | nccl (torch.distributed, every rank on a GPU) | gloo (torch.distributed on CPU tensors)
    threads: int = 0                 # torch threads per rank; 0 = a GPU rank 1, a CPU rank the node's cores not taken by GPU ranks / its CPU ranks
    wait_policy: str = "auto"        # waiting ranks: sleep | spin | auto (sleep only where a node has more ranks than cores)
    comm_timeout: float = 600.0      # seconds a rank may wait in one collective before the job is aborted
    startup_timeout: float = 0.0     # seconds the launch (imports, MPI start, the first collectives, reading the configuration) may take on any rank before the job is ended; 0 = comm_timeout (which bounds the rest of the set-up)
    bucket_mb: float = 25.0          # gradient bucket cap, MiB (PyTorch DDP's); a full bucket is reduced during backward; 0 = no cap
    first_bucket_mb: float = 1.0     # cap of the first bucket (the last layers' gradients, ready first), MiB; 0 = no cap
    checkpoint_every: int = 1       # write a checkpoint every N epochs (and on SIGTERM/SIGUSR1); 0 = only on signals
    checkpoint: str = ""             # checkpoint file; "" = <out>.ckpt
    out: str = ""                    # result file (HDF5); "" = results/<strategy>-<date>-<time>.h5
    progress: bool = True            # progress bar on rank 0 (when stderr is a terminal)

    # ------------------------------------------------------------------------
    def __post_init__(self):
        validate(self)

    @property
    def accumulates(self) -> bool:
        """A rank may run its local batch in micro-batches (synchronous, no SyncBatchNorm)."""
        return accumulates(self.strategy, self.sync_bn)

    @property
    def share_bound(self) -> int:
        """The largest local batch the planner may give a rank (0: none): max_local_batch
        only where a rank cannot accumulate; elsewhere a larger share runs in micro-batches."""
        return 0 if self.accumulates else self.max_local_batch

    @property
    def micro_size(self) -> int:
        """Samples a rank computes at once (0: its whole local batch): the smaller of
        micro_batch and max_local_batch, where it accumulates."""
        sizes = [n for n in (self.micro_batch, self.max_local_batch if self.accumulates else 0) if n]
        return min(sizes, default=0)

    def replace(self, **changes) -> "Config":
        return from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


FIELDS = {f.name: f for f in fields(Config)}
_HINTS = typing.get_type_hints(Config)


def _fail(name: str, why: str):
    raise ConfigError(f"{name}: {why}")


def field_value(name: str, value):
    """One field's value as the configuration reads it (a string "1,0.5" for a list too),
    not checked against the others: ConfigError naming the field."""
    return _coerce(name, value)


def _coerce(name: str, value):
    """Turn a TOML or command-line value into the field's type, or fail naming the field."""
    kind = _HINTS[name]
    if kind not in _COERCE:  # pragma: no cover
        raise AssertionError(f"no coercion for {name}")
    return _COERCE[kind](name, value)


def _to_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    _fail(name, f"expected true or false, got {value!r}")


def _to_int(name: str, value) -> int:
    if isinstance(value, bool):
        _fail(name, f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    _fail(name, f"expected an integer, got {value!r}")


def _to_float(name: str, value) -> float:
    if isinstance(value, bool):
        _fail(name, f"expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    else:
        try:
            out = float(str(value).strip())
        except ValueError:
            _fail(name, f"expected a number, got {value!r}")
    if not math.isfinite(out):
        _fail(name, f"expected a finite number, got {value!r}")
    return out


def _to_str(name: str, value) -> str:
    if not isinstance(value, str):
        _fail(name, f"expected a string, got {value!r}")
    return value


def _to_tuple(name: str, value) -> tuple:
    """A list field: strings (STRING_LISTS), or integers or finite numbers, the type of
    the default's elements; a string is split at commas (synthetic_shape also at x)."""
    default = FIELDS[name].default
    elem = type(default[0]) if default else STRING_LISTS.get(name, float)
    if elem is str:
        return _string_list(name, value)
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v != ""] if value.strip() else []
        if name == "synthetic_shape" and len(value) == 1 and "x" in value[0]:
            value = value[0].split("x")
    if not isinstance(value, (list, tuple)):
        _fail(name, f"expected a comma-separated list, got {value!r}")
    try:
        return tuple(_list_element(v, elem) for v in value)
    except (TypeError, ValueError):
        _fail(name, f"expected a list of {'integers' if elem is int else 'numbers'}, got {value!r}")


def _list_element(v, elem):
    if isinstance(v, bool):
        raise ValueError
    if elem is int:
        if isinstance(v, float) and not v.is_integer():
            raise ValueError
        return int(v)
    x = float(v)
    if not math.isfinite(x):
        raise ValueError
    return x


_COERCE = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str, tuple: _to_tuple}


STRING_LISTS = {"devices": str}     # tuple fields of strings (the others hold numbers)


def _string_list(name: str, value) -> tuple:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v != ""]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        _fail(name, f"expected a comma-separated list of names, got {value!r}")
    return tuple(v.lower() for v in value)


def validate(c: Config) -> None:
    """Checks that do not depend on the number of ranks or on files, in this order: the
    types (a frozen dataclass built by hand gets no coercion), the choices, the ranges,
    the emulation's settings."""
    _check_types(c)
    _check_choices(c)
    _check_ranges(c)
    _check_emulation(c)
    _check_async_only(c)


def _check_types(c: Config) -> None:
    for name in FIELDS:
        value = getattr(c, name)
        kind = _HINTS[name]
        ok = (isinstance(value, kind) and not (kind is int and isinstance(value, bool))) or (
            kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            _fail(name, f"expected {kind.__name__}, got {value!r}")


def _check_choices(c: Config) -> None:
    def choice(name, options):
        if getattr(c, name) not in options:
            _fail(name, f"must be one of {', '.join(options)}; got {getattr(c, name)!r}")

    choice("strategy", STRATEGIES)
    choice("aggregation", AGGREGATIONS)
    if ":" not in c.dataset:
        choice("dataset", DATASETS)
    if ":" not in c.model:
        choice("model", MODELS)
    choice("optimizer", OPTIMIZERS)
    choice("loader", LOADERS)
    if c.loss and ":" not in c.loss:
        _fail("loss", f"must be empty (cross-entropy) or MODULE:CALLABLE; got {c.loss!r}")
    choice("data_on_device", DATA_ON_DEVICE)
    if c.data_on_device == "on" and c.loader == "dataloader":
        _fail("data_on_device", "on indexes the data where it is, on the in-memory fast path; use loader = \"auto\"")
    if c.augment and ":" in c.dataset:
        _fail("augment", "the built-in augmentation is the built-in datasets'; a plug-in's dataset augments its own "
                         "samples")
    if c.augment and c.loader == "dataloader":
        _fail("augment", "the built-in augmentation runs on the in-memory fast path; use loader = \"auto\"")
    choice("norm", NORMS)
    if c.sync_bn and c.strategy in ASYNC_STRATEGIES:
        _fail("sync_bn", f"synchronises BatchNorm over the ranks of a step: strategies {', '.join(SYNC_STRATEGIES)} "
                         f"only (got {c.strategy})")
    if c.compile and c.strategy in ASYNC_STRATEGIES:
        _fail("compile", f"a compiled model runs with the synchronous strategies {', '.join(SYNC_STRATEGIES)} only "
                         f"(got {c.strategy})")
    if c.micro_batch and (c.sync_bn or c.strategy in ASYNC_STRATEGIES):
        _fail("micro_batch", "SyncBatchNorm normalises over the step's global batch, which micro-batches would cut "
                             f"into parts; and it runs with the synchronous strategies {', '.join(SYNC_STRATEGIES)} only")
    if c.channels_last and c.strategy in ASYNC_STRATEGIES:
        _fail("channels_last", f"runs with the synchronous strategies {', '.join(SYNC_STRATEGIES)} only "
                               f"(got {c.strategy})")
    if c.sample_dropout and c.strategy in ASYNC_STRATEGIES:
        _fail("sample_dropout", f"keys masks by the position in a synchronous step's global batch: strategies "
                                f"{', '.join(SYNC_STRATEGIES)} only (got {c.strategy})")
    choice("lr_scaling", LR_SCALING)
    _check_adaptive(c)
    if c.noise_scale and c.strategy in ASYNC_STRATEGIES:
        _fail("noise_scale", f"fits the gradients of a synchronous step's ranks: strategies {', '.join(SYNC_STRATEGIES)} "
                             f"only (got {c.strategy})")
    if c.calibration_from and c.strategy not in ("static", "dbs"):
        _fail("calibration_from", f"static and dbs plan from a calibration; {c.strategy} has none to reuse")
    choice("compile_backend", COMPILE_BACKENDS)
    choice("amp", AMPS)
    if c.amp != "none" and c.strategy in ASYNC_STRATEGIES:
        _fail("amp", f"mixed precision runs with the synchronous strategies {', '.join(SYNC_STRATEGIES)} only "
                     f"(got {c.strategy})")
    choice("dbs_model", DBS_MODELS)
    choice("participation", PARTICIPATION)
    choice("wait_policy", WAIT_POLICIES)
    choice("exchange", EXCHANGES)
    for name, specs in (("device", [c.device]), ("devices", c.devices)):
        for spec in specs:
            if not DEVICE_SPEC.match(spec):
                _fail(name, f"{spec!r} is not a device; use auto, cpu, cuda or cuda:N")


def _check_async_only(c: Config) -> None:
    """The parameter server's options, refused under a synchronous strategy (they were ignored)."""
    if c.strategy in ASYNC_STRATEGIES:
        return
    for name, unset in ASYNC_ONLY.items():
        if getattr(c, name) != unset:
            _fail(name, f"applies to the asynchronous strategies {', '.join(ASYNC_STRATEGIES)} only (got "
                        f"{c.strategy}; leave it at {unset!r})")


def stored(config: dict) -> dict:
    """A checkpoint's configuration as today's checks take it: the parameter server's
    options under a synchronous strategy, which older versions accepted and ignored, at
    their defaults (they had no effect on the run)."""
    if config.get("strategy") in ASYNC_STRATEGIES:
        return dict(config)
    return {**config, **ASYNC_ONLY}


def _check_adaptive(c: Config) -> None:
    """global_batch = auto and its bounds."""
    if not c.global_batch_auto:
        for name in ("global_batch_start", "min_global_batch", "max_global_batch"):
            if getattr(c, name):
                _fail(name, "bounds the adaptive global batch: set global_batch = auto (--global-batch auto)")
        return
    if c.strategy in ASYNC_STRATEGIES:
        _fail("global_batch", f"auto adapts a synchronous step's global batch: strategies "
                              f"{', '.join(SYNC_STRATEGIES)} only (got {c.strategy})")
    if c.global_batch_start and c.global_batch_start != c.global_batch:
        _fail("global_batch_start", f"is {c.global_batch_start}, but global_batch, where auto starts, is "
                                    f"{c.global_batch}")
    if c.min_global_batch > c.global_batch:
        _fail("min_global_batch", f"must be at most the start, {c.global_batch}; got {c.min_global_batch}")
    if c.max_global_batch and c.max_global_batch < c.global_batch:
        _fail("max_global_batch", f"must be at least the start, {c.global_batch}; got {c.max_global_batch}")


LARGEST_INT = 2 ** 62     # integer options are below it (numpy's and torch's 64-bit integers hold them)
SEED_LIMIT = 2 ** 47      # seeds are below it: seed x 100003 + rank is a 64-bit torch seed
ASYNC_ONLY = {"softsync_n": 1, "softsync_wait": False, "time_budget": 0.0, "staleness_lr": False}   # (their defaults)


def _check_ranges(c: Config) -> None:
    def positive(name):
        if getattr(c, name) <= 0:
            _fail(name, f"must be positive; got {getattr(c, name)!r}")

    def non_negative(name):
        if getattr(c, name) < 0:
            _fail(name, f"must be zero or positive; got {getattr(c, name)!r}")

    for name in ("epochs", "global_batch", "softsync_n", "synthetic_samples", "synthetic_classes", "benchmark_steps",
                 "comm_timeout", "slow_factor", "lr_gamma"):
        positive(name)
    for name in ("lr", "momentum", "weight_decay", "subset", "test_subset", "max_local_batch",
                 "benchmark_warmup", "threads", "checkpoint_every", "sleep_prob", "dbs_min_gain",
                 "bucket_mb", "first_bucket_mb", "num_classes", "loader_workers", "startup_timeout", "micro_batch",
                 "global_batch_start", "min_global_batch", "max_global_batch"):
        non_negative(name)
    for f in fields(c):                    # (numpy and torch take 64-bit integers: a larger one was a traceback)
        value = getattr(c, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= LARGEST_INT:
            _fail(f.name, f"must be below 2**62; got {value}")
    if not 0 <= c.seed < SEED_LIMIT:
        _fail("seed", f"must be at least 0 and below 2**47 (rank r's torch seed is seed x 100003 + r); got {c.seed}")
    if c.synthetic_classes < 2:
        _fail("synthetic_classes", f"must be at least 2; got {c.synthetic_classes}")
    if c.time_budget < 0:
        _fail("time_budget", f"must be zero (no limit) or positive seconds; got {c.time_budget}")
    if c.min_local_batch < 1:
        _fail("min_local_batch", f"must be at least 1; got {c.min_local_batch}")
    if c.max_local_batch and c.max_local_batch < c.min_local_batch:
        _fail("max_local_batch", f"must be 0 (no bound) or at least min_local_batch={c.min_local_batch}")
    if not 0 < c.dbs_smoothing <= 1:
        _fail("dbs_smoothing", f"must be in (0, 1]; got {c.dbs_smoothing}")
    if c.dbs_follow < 0:
        _fail("dbs_follow", f"must be zero or positive; got {c.dbs_follow}")
    if len(c.synthetic_shape) != 3 or min(c.synthetic_shape) < 1:
        _fail("synthetic_shape", f"must be three positive integers C,H,W; got {c.synthetic_shape}")
    parse_interval(c.dbs_interval)
    if c.dbs_window < 5:
        _fail("dbs_window", f"must be at least 5 steps; got {c.dbs_window}")
    problem = schedule.check(c.lr_schedule, c.epochs, c.warmup_epochs, c.lr_milestones)
    if problem:
        name, _, message = problem.partition(": ")
        _fail(name, message)
    if (c.lr_schedule != "constant" or c.warmup_epochs) and c.strategy in ASYNC_STRATEGIES:
        _fail("lr_schedule", f"schedules step with the synchronous strategies {', '.join(SYNC_STRATEGIES)} only; "
                             f"{c.strategy}'s server applies a constant lr")


def _check_emulation(c: Config) -> None:
    """Emulated speeds and disturbances (heterogeneity.py)."""
    if c.sleep_prob > 1:
        _fail("sleep_prob", f"must be in [0, 1]; got {c.sleep_prob}")
    for s in c.speeds:
        if not 0 < s <= 1e6:
            _fail("speeds", f"every speed must be positive; got {s}")
    if c.slow_factor > 1000:
        _fail("slow_factor", f"must be at most 1000 (the slowed rank would never finish); got {c.slow_factor}")
    if c.speeds and min(c.speeds) < 1e-3 * max(c.speeds):
        # the emulator sleeps (1/s - 1) x the compute time: beyond 1000x a run would never end
        _fail("speeds", f"the slowest rank must be at least 1/1000 as fast as the fastest; got {list(c.speeds)}")
    for name in ("slow_epochs", "slow_steps", "slow_seconds", "sleep_seconds", "sleep_epochs", "contention_steps"):
        pair = getattr(c, name)
        if len(pair) != 2 or pair[0] < 0 or pair[1] < pair[0]:
            _fail(name, f"must be two numbers lo,hi with 0 <= lo <= hi; got {pair}")
    if parse_couple(c.couple) and c.strategy in ASYNC_STRATEGIES:
        _fail("couple", f"couples a rank's speed to the other ranks of its synchronous step: strategies "
                        f"{', '.join(SYNC_STRATEGIES)} only (got {c.strategy})")


def check_world(c: Config, world_size: int) -> None:
    """Checks that depend on the number of ranks."""
    if c.devices and len(c.devices) != world_size:
        _fail("devices", f"has {len(c.devices)} entries but there are {world_size} ranks")
    if c.speeds and len(c.speeds) != world_size:
        _fail("speeds", f"has {len(c.speeds)} values but there are {world_size} ranks")
    if c.global_batch < world_size * c.min_local_batch:
        _fail("global_batch", f"{c.global_batch} is smaller than ranks x min_local_batch = "
                              f"{world_size} x {c.min_local_batch}")
    if c.share_bound and c.global_batch > world_size * c.share_bound:
        _fail("global_batch", f"{c.global_batch} is larger than ranks x max_local_batch = "
                              f"{world_size} x {c.max_local_batch}")
    for name in ("slow_rank", "contention_rank"):
        if getattr(c, name) >= world_size:
            _fail(name, f"is {getattr(c, name)} but ranks are 0..{world_size - 1}")
    for rank in parse_couple(c.couple):
        if rank >= world_size:
            _fail("couple", f"names rank {rank} but ranks are 0..{world_size - 1}")
    if c.strategy in ASYNC_STRATEGIES and world_size < 2:
        _fail("strategy", f"{c.strategy} needs at least 2 ranks (rank 0 serves the parameters, the others work); "
                          f"run it under mpirun -n 2 or more")
    if c.strategy == "nsoftsync" and c.softsync_n > world_size - 1:
        _fail("softsync_n", f"is {c.softsync_n} but there are only {world_size - 1} workers (1 <= n <= workers; "
                            f"n = workers is ASGD)")


# What a run configured before these options existed did: dbs re-planned once per epoch,
# and every rank took part.
LEGACY = {"dbs_interval": "epoch", "participation": "all"}


def from_dict(values: dict) -> Config:
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        _fail(unknown[0], f"unknown configuration key (known: {', '.join(FIELDS)})")
    return Config(**{k: _coerce(k, v) for k, v in _adaptive_batch(values).items()})


def _adaptive_batch(values: dict) -> dict:
    """global_batch = "auto": global_batch becomes the start (B0), global_batch_auto true."""
    if str(values.get("global_batch", "")).strip().lower() != "auto":
        return values
    start = _to_int("global_batch_start", values.get("global_batch_start") or DEFAULT_START)
    return {**values, "global_batch": start, "global_batch_start": start, "global_batch_auto": True}


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config: no such file {str(path)!r}") from None
    except (OSError, ValueError) as exc:             # (TOMLDecodeError, and UnicodeDecodeError: not UTF-8)
        raise ConfigError(f"config: cannot read {str(path)!r}: {exc}") from None
    return flat_toml(data)           # ([sections] group keys; keys stay flat)


def load(config_file: str | None = None, overrides: dict | None = None) -> Config:
    """File values, then overrides (command line); every value validated."""
    values = load_toml(config_file) if config_file else {}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_dict(values)


def options_markdown() -> str:
    """Every option of `dbs-mpi train` (= every field of Config) as docs/options.md shows it."""
    def default(value) -> str:
        if isinstance(value, tuple):
            return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "(none)"
        if isinstance(value, bool):
            return str(value).lower()
        return f'"{value}"' if isinstance(value, str) else str(value)

    lines = ["| option | TOML key | default | meaning |", "|---|---|---|---|"]
    for name, value, comment in describe():
        lines.append(f"| `--{name.replace('_', '-')}` | `{name}` | `{default(value)}` | {comment.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


def describe() -> list[tuple[str, object, str]]:
    """(name, default, comment) for every field, for the CLI's help and the docs."""
    import inspect
    import re
    comments = {}
    for line in inspect.getsource(Config).splitlines():
        m = re.match(r"\s+(\w+): [\w.]+ = .*?#\s*(.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2)
    return [(f.name, f.default, comments.get(f.name, "")) for f in fields(Config)]


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m dbs_mpi.tools.config --markdown   (the options table of docs/options.md)")
    sys.stdout.write(options_markdown())
