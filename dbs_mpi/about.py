"""What any layer may read about the package and the process: the version, and the cores
this process was given when dbs_mpi was first imported.

The cores are read here, before torch can be imported (dbs_mpi/__init__.py imports this
module first): with OMP_PROC_BIND set, OpenMP pins the main thread to its first core
when torch loads, and a script that imports torch first sees only that core
(mpi/placement.affinity takes the union).
"""
import os

__version__ = "0.4.0"

try:
    AFFINITY_AT_IMPORT = frozenset(os.sched_getaffinity(0))
except AttributeError:  # pragma: no cover - not Linux
    AFFINITY_AT_IMPORT = frozenset()
