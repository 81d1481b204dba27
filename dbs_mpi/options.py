"""What every layer checks a user's choice against: the error a bad choice raises, and
the choices that the layers below the configuration check themselves (a library user
passes `exchange=`, `device=` and `interval=` to them without a configuration file).
Plain Python: the command line reads it before the start-up watchdog forks, before
numpy, torch or MPI load.

UserError is the one exception that means "the user's mistake": the command line prints
its message as one line on every rank and exits 2. Everything else is a bug or a
failure of the machine, reported with its traceback.
"""
import numbers
import re


class UserError(Exception):
    """A mistake of the user's (bad option, missing file): reported in one line, exit 2."""


class ConfigError(UserError):
    """A bad value of a configuration field: the message starts with the field's name."""


PARTICIPATION = ("auto", "all")     # auto: the planners choose which ranks take part | all: every rank does
EXCHANGES = ("auto", "host", "cuda-aware", "nccl", "gloo")   # mpi/transport.py
DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")       # mpi/devices.py
DATA_ON_DEVICE = ("auto", "on", "off")      # the in-memory data in a GPU's memory (training/device_data.py)
LR_SCALING = ("adascale", "sqrt", "linear")   # the lr at an adaptive global batch (planning/goodput.py)
DEFAULT_START = 128       # B0 of an adaptive global batch where none is given
DEFAULT_UPPER = 4096      # the largest B it may choose by default (the data bounds it too)


def flat_toml(data: dict) -> dict:
    """A configuration file's parsed TOML with its keys flat: [sections] only group them,
    and dashes read as underscores (the configuration and the start-up watchdog alike)."""
    flat = {}
    for key, value in data.items():
        for k, v in (value.items() if isinstance(value, dict) else [(key, value)]):
            flat[k.replace("-", "_")] = v
    return flat


def parse_interval(value) -> int | None:
    """dbs_interval as the balancer takes it: a positive number of steps, or "epoch"
    (None: the DBS paper's per-epoch rule)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "epoch":
            return None
        if not (text.isascii() and text.isdigit()):         # ('²' is a digit to isdigit, not to int)
            raise ConfigError(f"dbs_interval: must be a positive number of steps or \"epoch\"; got {value!r}")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"dbs_interval: must be a positive number of steps or \"epoch\"; got {value!r}")
    return int(value)


def parse_couple(text: str) -> dict[int, float]:
    """couple, "RANK:K[,RANK:K...]" (heterogeneity.Emulator's coupled speeds), as {rank: K}."""
    couple = {}
    for part in (p for p in str(text).replace(" ", "").split(",") if p):
        rank, sep, factor = part.partition(":")
        try:
            r, k = int(rank), float(factor)
        except ValueError:
            raise ConfigError(f"couple: expected RANK:K[,RANK:K...] (e.g. 0:2); got {part!r}") from None
        if not sep or r < 0 or not 1 <= k <= 1000:
            raise ConfigError(f"couple: expected RANK:K with RANK >= 0 and 1 <= K <= 1000; got {part!r}")
        if r in couple:
            raise ConfigError(f"couple: rank {r} is given twice; got {text!r}")
        couple[r] = k
    return couple


def user_stacklevel() -> int:
    """The stacklevel at which a warning issued by the caller of this function points at
    the user's code: the first frame outside dbs_mpi, torch and Python's own libraries
    (a DataLoader or an lr_scheduler's wrapper may stand between the user and dbs-mpi)."""
    import os
    import sys
    skip = tuple(os.path.dirname(m.__file__) for m in (sys.modules.get("dbs_mpi"), sys.modules.get("torch"))
                 if m is not None and getattr(m, "__file__", None))
    stdlib = os.path.dirname(os.__file__)
    frame, level = sys._getframe(1), 1          # level 1: the function that warns
    while frame is not None:
        name = frame.f_code.co_filename
        library = name.startswith(skip) or name.startswith("<frozen") or (
            name.startswith(stdlib) and "-packages" not in name)
        if not library:
            return level
        frame, level = frame.f_back, level + 1
    return 1

