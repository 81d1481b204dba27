"""The library a training script uses (docs/api.md): the balancer, the sample-weighted
DistributedOptimizer and its bucketed exchange, SyncBatchNorm, the DDP hook, evaluation,
checkpoints and result files, and the batches they read.

The public names are re-exported by `dbs_mpi` itself (dbs_mpi.Balancer, ...): import them
from there.
"""
