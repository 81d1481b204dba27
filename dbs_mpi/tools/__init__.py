"""What is built on the library: the `dbs-mpi` command (cli.py, train.py, config.py,
plugins.py), the built-in datasets and models, and the research around the method
(benchmarks, the experiment grid, the analysis of result files, the simulator and its
machine constants).

Nothing below this package imports from it.
"""
