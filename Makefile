# dbs-mpi: thin wrappers around the commands the README documents.
# Every variable can be overridden: make test NP=2, make run MPIEXEC=srun, ...

VENV     ?= .venv
PYTHON   ?= python3
PY       := $(VENV)/bin/python
# MPI=mpich (default): MPICH from PyPI inside the venv, no root needed.
# MPI=system: mpi4py compiled against the cluster's MPI (mpicc on PATH, e.g. after
#             `module load openmpi`), launched with the system's mpirun.
MPI      ?= mpich
ifeq ($(MPI),system)
MPIEXEC  ?= mpirun
else
MPIEXEC  ?= $(VENV)/bin/mpirun
endif
NP       ?= 4
# CPU build of PyTorch for the dev install (an unpinned torch pulls a CUDA build).
TORCH    ?= torch==2.13.0
DATA_DIR ?= data
# Bound on each MPI test session, so that a hang fails instead of blocking CI.
TEST_TIMEOUT ?= 900

.PHONY: install venv deps data test test-serial test-mpi test-np% run bench-hetero info clean

install: deps data

venv: $(PY)
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

deps: $(PY)
ifeq ($(MPI),system)
	env MPICC=mpicc $(PY) -m pip install -q --no-binary=mpi4py --no-cache-dir mpi4py
else
	$(PY) -m pip install -q mpich mpi4py
endif
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"

# Fashion-MNIST from Debian's package, unpacked without root (scripts/get-data.sh).
data:
	bash scripts/get-data.sh $(DATA_DIR)

test: test-serial test-np1 test-np2 test-np4

# Unit tests, and tests that launch mpirun themselves (error propagation, CLI).
test-serial:
	DBS_MPI_MPIEXEC=$(MPIEXEC) timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider tests

# The MPI tests at one rank, without mpirun (the 1-rank path needs no launcher).
test-np1:
	timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider --with-mpi -m mpi tests

# The MPI tests (pytest-mpi) at NP ranks; rank 0 reports, other ranks speak on failure.
test-np%:
	timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $* $(PY) tests/mpi_pytest.py -q -p no:cacheprovider --with-mpi -m mpi tests

test-mpi: test-np2 test-np4

# The main job: NP ranks with emulated heterogeneous speeds, Fashion-MNIST, LeNet-5.
run:
	$(MPIEXEC) -n $(NP) $(VENV)/bin/dbs-mpi train --config jobs/main.toml --data-dir $(DATA_DIR)

bench-hetero:
	$(MPIEXEC) -n 2 $(VENV)/bin/dbs-mpi bench hetero --data-dir $(DATA_DIR)

info:
	$(MPIEXEC) -n $(NP) $(VENV)/bin/dbs-mpi info

clean:
	rm -rf build *.egg-info .pytest_cache
