"""What every layer checks a user's choice against: the error a bad choice raises, and
the choices that the layers below the configuration check themselves (a library user
passes `exchange=` and `device=` to them without a configuration file).

UserError is the one exception that means "the user's mistake": the command line prints
its message as one line on every rank and exits 2. Everything else is a bug or a
failure of the machine, reported with its traceback.
"""
import re


class UserError(Exception):
    """A mistake of the user's (bad option, missing file): reported in one line, exit 2."""


class ConfigError(UserError):
    """A bad value of a configuration field: the message starts with the field's name."""


EXCHANGES = ("auto", "host", "cuda-aware", "nccl", "gloo")   # mpi/transport.py
DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")       # mpi/devices.py
