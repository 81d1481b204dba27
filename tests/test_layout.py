"""The package's shape: the public API resolves, models and data know nothing of MPI,
and the modules the training loop builds on never import the command line's train.py
(no circular import between train.py and parameter_server.py)."""
import subprocess
import sys

import pytest

import dbs_mpi


def imported_after(statement: str) -> set[str]:
    """The dbs_mpi modules a fresh interpreter holds after `statement`."""
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.startswith('dbs_mpi')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["parameter_server", "balancer", "optimizer", "sharding", "evaluation",
                                    "checkpoint", "results", "plugins"])
def test_library_modules_do_not_import_the_command_line(module):
    loaded = imported_after(f"import dbs_mpi.{module}")
    assert not loaded & {"dbs_mpi.train", "dbs_mpi.cli"}, loaded


@pytest.mark.parametrize("module", ["models", "data", "allocation", "dynamic", "sharding", "heterogeneity", "config",
                                    "bench_tracking", "startup"])   # startup: it must run before MPI_Init
def test_models_data_and_pure_functions_do_not_import_mpi(module):
    code = f"import sys, dbs_mpi.{module}; print('mpi4py.MPI' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_every_public_name_resolves():
    for name in dbs_mpi.__all__:
        assert getattr(dbs_mpi, name) is not None, name
    with pytest.raises(AttributeError):
        dbs_mpi.no_such_name
