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
MPIEXEC  ?= $(abspath $(VENV))/bin/mpirun
endif
NP       ?= 4
# CPU build of PyTorch for the dev install (an unpinned torch pulls a CUDA build).
TORCH    ?= torch==2.13.0
DATA_DIR ?= data
# Bound on each MPI test session, so that a hang fails instead of blocking CI.
TEST_TIMEOUT ?= 2400

.PHONY: install venv deps data test test-serial test-serial-jobs test-serial-resume test-serial-rest test-mpi test-np% run bench bench-hetero bench-ab info clean experiments figures test-notebooks

# `make install` is idempotent: a stamp in the venv records a finished install (per MPI
# choice), redone only when setup.cfg or pyproject.toml change; the data script skips
# files that are there. `make test`, `make run` and the benchmarks depend on it, so each
# works alone on a fresh clone.
STAMP    := $(VENV)/.installed-$(MPI)
install: $(STAMP) data

venv: $(PY)
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

$(STAMP): setup.cfg pyproject.toml | $(PY)
	$(MAKE) --no-print-directory deps
	touch $@

# The packages, unconditionally (the stamp's recipe; `make deps` to redo them by hand).
deps: $(PY)
ifeq ($(MPI),system)
	env MPICC=mpicc $(PY) -m pip install -q --no-binary=mpi4py --no-cache-dir mpi4py
else
	$(PY) -m pip install -q mpich mpi4py
endif
	@# Bytecode: torch's is compiled on the other core while pip installs the rest (every
	@# rank imports torch, often several at once), then that of the other packages a rank
	@# imports. sympy and mpmath count: torch's optimizers import torch._dynamo, which
	@# imports sympy, in their constructor; uncompiled, that took every rank 5 CPU-s (and
	@# every launch again where PYTHONDONTWRITEBYTECODE is set, as on CI). A file that does
	@# not compile here (torch ships one for Python 3.12 only) is left to Python, as pip
	@# leaves it. The test and analysis packages are not compiled (pip compiles every file,
	@# on one core: 21 of the install's 30 CPU-s); Python compiles the few modules imported.
	$(PY) -m pip install -q --no-compile "$(TORCH)"
	$(PY) -m compileall -q -j 0 $$($(PACKAGE_DIRS) torch torchgen sympy mpmath) > /dev/null 2>&1 & compiling=$$!; \
	$(PY) -m pip install -q --no-compile -e ".[test,analysis]"; installed=$$?; wait $$compiling; \
	[ $$installed = 0 ] || exit $$installed; \
	$(PY) -m compileall -q -j 0 $$($(PACKAGE_DIRS) numpy h5py tqdm dbs_mpi) > /dev/null 2>&1; exit 0

# The folders of the packages named after it.
PACKAGE_DIRS = $(PY) -c 'import importlib.util as u, sys; print(*(u.find_spec(n).submodule_search_locations[0] for n in sys.argv[1:]))'

# Fashion-MNIST from Debian's package, unpacked without root (scripts/get-data.sh;
# it does nothing if the files are there).
data:
	@bash scripts/get-data.sh $(DATA_DIR)

# The suites three at a time, the next starting when one ends: the job-script tests wait
# (for Slurm, for a timeout, for a node cut off) more than they compute, and the two other
# serial sessions keep the cores busy meanwhile. Each suite's output is printed in one
# piece when it ends.
test: install
	@echo "make test: 7 suites, three at a time; each prints its output when it ends (about 13 min on 2 cores)"
	$(MAKE) --no-print-directory -j3 --output-sync=target test-serial-jobs test-serial-resume test-serial-rest \
		test-np4 test-np2 test-notebooks test-np1

# Every test process and every rank the tests launch gets one torch thread
# (OMP_THREAD_LIMIT=1, which dbs-mpi respects): the suites share the cores, and a rank's
# second thread only spins while another suite has the core. Measured: a 1-rank run took
# 2.5x the CPU time, and was slower; the MPI suites took 1.8x at 4 ranks and 1.5x at 2,
# mostly in their single-process references (COMM_SELF: a rank alone takes both cores). And
# OMP_NUM_THREADS=1, torch's default before dbs-mpi sets the threads: torch hangs when its
# threads exceed OMP_THREAD_LIMIT. The tests of the thread choice set their own.
ONE_THREAD := OMP_NUM_THREADS=1 OMP_THREAD_LIMIT=1

# Unit tests, and tests that launch mpirun themselves (error propagation, CLI), in one
# session; `make test` runs it as three: the job scripts and nodes (mostly waiting) with the
# fresh clone's install and runs (which compute while they wait), the stops, resumes,
# examples and stalled ranks, and the rest. (The job-script session grew by the cluster
# semantics' tests to 13 min: the stalled ranks moved to the resume session.)
SERIAL_JOBS   := tests/test_jobs.py tests/test_multinode.py tests/test_fresh_clone.py
SERIAL_RESUME := tests/test_checkpoint.py tests/test_examples.py tests/test_stuck.py
PYTEST_SERIAL = $(ONE_THREAD) DBS_MPI_MPIEXEC=$(MPIEXEC) timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider
test-serial:
	$(PYTEST_SERIAL) tests
test-serial-jobs:
	$(PYTEST_SERIAL) $(SERIAL_JOBS)
test-serial-resume:
	$(PYTEST_SERIAL) $(SERIAL_RESUME)
test-serial-rest:
	$(PYTEST_SERIAL) tests $(SERIAL_JOBS:%=--ignore=%) $(SERIAL_RESUME:%=--ignore=%)

# The MPI tests: the files that mark tests `mpi` (collecting only them saves every rank
# 2.7 s of CPU, importing the other test modules).
MPI_TESTS := $(shell grep -l 'mark\.mpi' tests/test_*.py)

# The MPI tests at one rank, without mpirun (the 1-rank path needs no launcher).
test-np1:
	$(ONE_THREAD) timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider --with-mpi -m mpi $(MPI_TESTS)

# The MPI tests (pytest-mpi) at NP ranks; rank 0 reports, other ranks speak on failure.
test-np%:
	$(ONE_THREAD) timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $* $(PY) tests/mpi_pytest.py -q -p no:cacheprovider --with-mpi -m mpi \
		$(MPI_TESTS)

test-mpi: test-np2 test-np4

# The main job: NP ranks with emulated heterogeneous speeds, Fashion-MNIST, LeNet-5.
# ARGS: more `dbs-mpi train` options, which override the file's (make run ARGS="--epochs 1").
# Any NP: rank i runs at the speed jobs/main.toml gives rank i mod (its number of speeds),
# so NP=2 is 1,0.5, NP=3 adds 0.25 and NP=8 repeats the four (ARGS="--speeds ..." overrides).
ARGS     ?=
RUN_SPEEDS = $(PY) -c 'import sys; from dbs_mpi.tools.config import load_toml; s = load_toml("jobs/main.toml")["speeds"]; print(",".join(str(s[i % len(s)]) for i in range(int(sys.argv[1]))))'
run: install
	$(MPIEXEC) -n $(NP) $(VENV)/bin/dbs-mpi train --config jobs/main.toml --data-dir $(DATA_DIR) \
		--speeds "$$($(RUN_SPEEDS) $(NP))" $(ARGS)

# Every benchmark case in one job (cases needing fewer ranks run on the first ranks; the
# 4-rank runs are oversubscribed on a 2-core machine and marked so); one table at the end,
# HDF5 under results/bench/. 12 to 16 minutes on 2 cores (busy machine). Bounded by BENCH_TIMEOUT.
BENCH_TIMEOUT ?= 1800
bench: install
	timeout $(BENCH_TIMEOUT) $(MPIEXEC) -n 4 $(VENV)/bin/dbs-mpi bench all --data-dir $(DATA_DIR)

bench-hetero: install
	$(MPIEXEC) -n 2 $(VENV)/bin/dbs-mpi bench hetero --data-dir $(DATA_DIR)

# The main job at another revision (BASE, default the last commit) and at the working
# tree, side by side, 3 repeats: median epoch times and their ratio (scripts/ab-runs.py).
BASE ?= HEAD
bench-ab: install
	$(PY) scripts/ab-runs.py --variant before=$(BASE) --variant after=. --repeats 3 --np $(NP) --mpiexec $(MPIEXEC)

info: install
	$(MPIEXEC) -n $(NP) $(VENV)/bin/dbs-mpi info

clean:
	rm -rf build *.egg-info .pytest_cache

# The experiment grid of jobs/experiments.toml, one `dbs-mpi train` launch per run, result
# files in GRID_OUT (complete runs are skipped, interrupted ones resumed, each launch bounded
# by the grid's timeout). SCALE=small: this 2-core machine (122 runs, about 100 min: adaptive-bn's 18 take
# an hour); SCALE=paper: a cluster.
# ONLY=name[,name...] restricts it to experiments, figures or runs.
SCALE    ?= small
GRID_OUT ?= results/grid
ONLY     ?=
experiments: install
	$(PY) -m dbs_mpi.tools.experiments --scale $(SCALE) --out $(GRID_OUT) --mpiexec "$(MPIEXEC)" \
		--data-dir $(DATA_DIR) $(if $(ONLY),--only $(ONLY))

# Execute the notebooks in analysis/ headless on GRID_OUT: PNG, PDF and caption of every
# figure into analysis/figures/, executed copies into analysis/executed/ (not committed),
# then README.md's "Figures" section and analysis/figures/README.md from the captions.
NOTEBOOKS       := $(sort $(wildcard analysis/*.ipynb))
NOTEBOOK_TIMEOUT ?= 600
figures: install
	DBS_MPI_GRID=$(abspath $(GRID_OUT)) timeout $(NOTEBOOK_TIMEOUT) $(VENV)/bin/jupyter nbconvert --to notebook \
		--execute --ExecutePreprocessor.timeout=300 --output-dir analysis/executed $(NOTEBOOKS)
	$(PY) analysis/readme.py

# The notebooks execute without error on the committed results (figures go to a temporary
# folder, nothing in the tree changes) and produce every figure.
test-notebooks:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	DBS_MPI_GRID=$(abspath $(GRID_OUT)) DBS_MPI_FIGURES=$$tmp timeout $(NOTEBOOK_TIMEOUT) \
		$(VENV)/bin/jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=300 \
		--output-dir $$tmp $(NOTEBOOKS) && \
	$(PY) analysis/readme.py --check $$tmp
