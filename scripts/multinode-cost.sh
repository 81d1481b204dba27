#!/usr/bin/env bash
# The cost of TCP between nodes against shared memory within one: the same job on
#   one node, 2 ranks  (`mpirun -n 2` on this machine: shared memory, its cores), and
#   two nodes, 1 rank each  (`srun --mpi=pmi2 -N 2` on the namespaced test cluster: TCP
#                            through its bridge, one core per node on a 2-core machine),
# REPEATS times, alternately. Prints each launch's median epoch time (epochs after the
# first) and, at the end, the median over repeats of the ratio two nodes / one node.
# Needs the two-node cluster running (root):
#
#   DBS_MPI_SLURM_NODES=2 scripts/slurm-cluster.sh start
#   scripts/multinode-cost.sh [REPEATS] [dbs-mpi train options...]
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS=${1:-3}; shift || true
ARGS=(--dataset fashion-mnist --model lenet5 --subset 6000 --test-subset 500 --strategy ssgd
      --global-batch 64 --epochs 3 --progress false "$@")
DIR=${DBS_MPI_SLURM_DIR:-/tmp/dbs-mpi-slurm}
export SLURM_CONF=$DIR/slurm.conf
[[ $(cat "$DIR/nodes" 2>/dev/null) == 2 ]] || { echo "multinode-cost: no two-node cluster in $DIR" >&2; exit 2; }
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
PY=.venv/bin/python

epoch_median() {   # median duration of the epochs after the first
    "$PY" -c 'import sys, h5py, numpy as np; print("%.3f" % np.median(h5py.File(sys.argv[1])["epoch/duration"][1:]))' "$1"
}

ratios=()
for ((r = 1; r <= REPEATS; r++)); do
    .venv/bin/mpirun -n 2 .venv/bin/dbs-mpi train "${ARGS[@]}" --out "$OUT/one-$r.h5" >/dev/null
    timeout 600 srun --mpi=pmi2 -N 2 --ntasks-per-node=1 -t 10 .venv/bin/dbs-mpi train "${ARGS[@]}" \
        --out "$OUT/two-$r.h5" >/dev/null
    one=$(epoch_median "$OUT/one-$r.h5"); two=$(epoch_median "$OUT/two-$r.h5")
    ratios+=("$(awk -v a="$two" -v b="$one" 'BEGIN {printf "%.3f", a / b}')")
    echo "repeat $r: epoch time 1 node x 2 ranks ${one} s, 2 nodes x 1 rank ${two} s, ratio ${ratios[-1]}"
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR] = $1} END {printf "median ratio (2 nodes / 1 node): %s over %d repeats\n", a[int((NR + 1) / 2)], NR}'
