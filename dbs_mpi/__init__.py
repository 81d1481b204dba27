"""dbs-mpi: heterogeneity-aware data-parallel training of PyTorch models over MPI.

Where each idea of the papers lives:
  allocation.py     batch-size vectors from measured speed; the DBS controller
  sharding.py       uneven shards with equal step counts; allocation invariance
  strategies.py     ssgd / static / dbs, weighted or mean aggregation
  comm.py           sample-weighted gradient allreduce, non-spinning waits, failing together
  profiling.py      compute / communication / wait times; the start-up benchmark
  heterogeneity.py  emulated speeds and disturbances
  results.py        the HDF5 result file
  checkpoint.py     checkpoints, stop requests (SIGTERM/SIGUSR1), resume
  parameter_server.py  asgd, n-softsync, dbs-sgd on an MPI parameter server
  data.py, models.py   datasets and models (no MPI)
  train.py          the training loop;  cli.py  the `dbs-mpi` command;  bench.py  benchmarks
  experiments.py    the experiment grid;  analysis.py  result files -> pandas tables
"""
__version__ = "0.1.0"
