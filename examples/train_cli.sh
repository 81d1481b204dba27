#!/usr/bin/env bash
# The same training as examples/train_api.py, through `dbs-mpi train` and its plug-ins:
# the user's model and dataset named as file.py:CALLABLE, AdamW, the dbs strategy.
#
#   bash examples/train_cli.sh results/example-cli.h5 [more dbs-mpi train options]
#
# MPIEXEC and NP may be set (default: the venv's mpirun, 2 ranks).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
out="${1:?usage: train_cli.sh RESULT.h5 [dbs-mpi train options]}"; shift
MPIEXEC="${MPIEXEC:-$root/.venv/bin/mpirun}"
DBS_MPI="${DBS_MPI:-$root/.venv/bin/dbs-mpi}"
exec "$MPIEXEC" -n "${NP:-2}" "$DBS_MPI" train \
    --model "$here/my_project.py:SmallNet" \
    --dataset "$here/my_project.py:Squares" \
    --optimizer adamw --lr 0.002 --strategy dbs --global-batch 256 --epochs 3 \
    --loader-workers 2 --speeds 1,0.5 --out "$out" "$@"
