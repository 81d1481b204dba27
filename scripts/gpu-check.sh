#!/usr/bin/env bash
# The GPU checks of a GPU node in one bounded run: the GPU figures (docs/performance.md,
# "GPU figures") and the CUDA tests at 1 and 2 ranks, every step under its own time limit,
# the whole run under BUDGET seconds (a step that would start with less than 20 s left is
# skipped). The checks come in groups, run in the order CHECKS names them; the default
# puts first what the open GPU work needs most, for a lease of about 10 minutes:
#
#   facts     the GPU, torch, CUDA, MPI
#   overhead  one GPU rank against a plain loop, the data on the device (5 repeats), and where
#             its step's host time goes, part by part (scripts/step-profile.py), and the
#             optimizer's update per tensor, foreach and fused (scripts/optimizer-update.py)
#   mixed     a GPU rank beside CPU ranks against the GPU alone (scripts/gpu-mixed.py)
#   tests     the CUDA tests at 1 rank, then at 1 and 2 MPI ranks
#   recipe    ResNet-20's samples/s at each step of the recipe (scripts/gpu-recipe.py)
#   more      the rest: the data on the host, torch.compile, mixed precision, the GPU rank
#             beside CPU trainers, core binding, 4 ranks sharing the GPU, bench hetero
#
#   scripts/gpu-check.sh [OUTDIR]          # default results/gpu; the log: OUTDIR/gpu-check.log
#   CHECKS="facts tests" BUDGET=300 scripts/gpu-check.sh "$OUT/gpu"
#
# The steps' limits are bounds, not estimates, and add up to more than the budget (tests
# alone: 720 s): a group runs only while the budget lasts, and a step is cut to what is
# left. Name the groups most needed first; a 15-minute lease holds one call of BUDGET=540
# and a minute or two of start-up.
#
# OUTDIR must hold no result files yet. Environment: PYTHON (default python3), MPIRUN
# (default mpirun; words, e.g. "mpirun --allow-run-as-root": it must start the MPI that
# mpi4py loads, which the facts check), BUDGET (default 540), CHECKS (default "facts
# overhead mixed tests recipe more"), SCALE (1: the sizes below; 2 or more: larger runs
# and more repeats for a longer allocation).
# Assumes a node with one GPU and 16 cores (8 ranks: 1 GPU rank and 7 CPU ranks of 2 threads),
# and Fashion-MNIST in data/fashion-mnist (30 MB: `make data` unpacks it; copy it along to a
# node without a network). The MPI tests need pytest-mpi: where python lacks it, a wheel in
# WHEELS (default .whl; `pip download --no-deps pytest-mpi -d .whl` where there is a network)
# is installed into a temporary folder. The package runs from this checkout (PYTHONPATH), and
# as root under Open MPI its mpirun is allowed to (OMPI_ALLOW_RUN_AS_ROOT: the tests' own
# launches too).
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
out=${1:-results/gpu}
py=${PYTHON:-python3}
read -ra mpirun <<< "${MPIRUN:-mpirun}"      # (words: MPIRUN="mpirun --allow-run-as-root" as root under Open MPI)
export MPIRUN="${mpirun[*]}"                  # (scripts/gpu-mixed.py launches its jobs with it)
budget=${BUDGET:-540}
checks=${CHECKS:-facts overhead mixed tests recipe more}
checks=${checks//,/ }
scale=${SCALE:-1}
if compgen -G "$out/*.h5" > /dev/null || compgen -G "$out/mixed/*.h5" > /dev/null; then
    echo "gpu-check: $out has result files already (a run's --out is never overwritten): give a new OUTDIR" >&2
    exit 2
fi
mkdir -p "$out"
log=$out/gpu-check.log
bench=$out/bench
start=$SECONDS

step() {    # step NAME LIMIT COMMAND...: COMMAND's output into the log, bounded by LIMIT and the budget
    local name=$1 limit=$2 left t0 code
    shift 2
    left=$((budget - (SECONDS - start)))
    if ((left < 20)); then
        echo "== $name: skipped, the budget of ${budget} s is spent" | tee -a "$log"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s): $*" | tee -a "$log"
    t0=$SECONDS
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    code=$?
    echo "== $name: exit $code after $((SECONDS - t0)) s" | tee -a "$log"
}

cuda_aware() {
    timeout 60 "$py" -c "from dbs_mpi.mpi import devices; raise SystemExit(0 if devices.mpi_cuda_aware() else 1)" \
        2>/dev/null
}

facts() {
    nvidia-smi -L
    "$py" -c "import sys, torch, mpi4py, h5py, numpy; from mpi4py import MPI
print('python', sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda,
      'cuDNN', torch.backends.cudnn.version(), 'NCCL', torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print('mpi4py', mpi4py.__version__, 'h5py', h5py.__version__, 'numpy', numpy.__version__)
print(MPI.Get_library_version().splitlines()[0])"
    "$py" -m dbs_mpi info --device cuda
}

mpi_launch() {    # (its output, not its exit: some mpirun wrappers exit 0 when they start nothing)
    local said
    said=$($MPIRUN -n 2 "$py" -c "from mpi4py import MPI; c = MPI.COMM_WORLD
print('rank', c.Get_rank(), 'of', c.Get_size())" 2>&1)
    echo "$said"
    [[ $(grep -c "of 2$" <<< "$said") == 2 ]] || { echo "mpirun ($MPIRUN) did not start one job of 2 ranks of" \
        "the MPI that mpi4py loads: set MPIRUN"; return 1; }
}

export -f facts mpi_launch
export py
cpus=cuda$(printf ',cpu%.0s' 1 2 3 4 5 6 7)
recipe=("$py" -m dbs_mpi train --device cuda --model resnet20 --dataset synthetic --synthetic-shape 3,32,32
        --synthetic-samples $((12800 * scale)) --test-subset 1000 --global-batch 256 --epochs 3 --strategy ssgd
        --progress false)

check_facts() {    # and that mpirun starts one job of 2 ranks of the MPI that mpi4py loads (else 2 jobs of 1)
    step facts 60 bash -c facts
    step mpi-launch 60 bash -c mpi_launch
}

overhead() {    # overhead WHERE REPEATS LIMIT LIMIT: one GPU rank against a plain PyTorch loop of the same model
    local where=$1 repeats=$2  # and batch, the data of both held on the device (on) or copied from the host (off)
    step "overhead-lenet5-data-$where" "$3" "$py" -m dbs_mpi bench overhead --device cuda \
        --model lenet5 --local-batch 512 --steps 100 --repeats "$repeats" --data-on-device "$where" \
        --out-dir "$bench/data-$where"
    step "overhead-resnet20-data-$where" "$4" "$py" -m dbs_mpi bench overhead --device cuda \
        --model resnet20 --dataset synthetic --synthetic-shape 3,32,32 --synthetic-samples $((12800 * scale)) \
        --local-batch 256 --steps 50 --repeats "$repeats" --data-on-device "$where" --out-dir "$bench/data-$where"
}

check_overhead() {    # the data on the device, 5 repeats (the issue's median); where the step's host time goes
    overhead on 5 120 150
    step step-profile-lenet5 90 "$py" scripts/step-profile.py --device cuda --model lenet5 --local-batch 512 \
        --steps 100 --data-on-device on --torch-profiler
    step optimizer-update 60 "$py" scripts/optimizer-update.py --device cuda --models lenet5,resnet20
}

check_mixed() {    # 1 GPU + 7 CPU ranks (LeNet-5, ResNet-20), 1 GPU + 1 CPU rank, and the GPU slowed until mixing pays
    step mixed 420 "$py" scripts/gpu-mixed.py --cases lenet5,resnet20,pair,pays --repeats "$scale" \
        --out-dir "$out/mixed"
}

pytest_mpi() {    # pytest-mpi importable, from WHEELS where python lacks it (the newest wheel there)
    local site=/tmp/gpu-check-pytest-mpi wheel
    "$py" -c "import pytest_mpi" 2>/dev/null && return 0
    wheel=$(compgen -G "${WHEELS:-.whl}/pytest_mpi-*.whl" | sort -V | tail -n 1)
    [ -n "$wheel" ] && rm -rf "$site" &&
        "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" &&
        export PYTHONPATH="$PYTHONPATH:$site" && "$py" -c "import pytest_mpi" && return 0
    echo "== cuda-tests-mpi: not run, python has no pytest-mpi and none installs from ${WHEELS:-.whl}" | tee -a "$log"
    return 1
}

check_tests() {    # the MPI ones first: the only GPU checks of a mixed job's exchange
    pytest_mpi || { step cuda-tests-1-rank 480 "$py" -m pytest -q -p no:cacheprovider -s -rs -m "cuda and not mpi" \
        tests/test_cuda.py tests/test_optimizer.py tests/test_event_clock.py; return; }
    step cuda-tests-mpi-1-rank 90 "${mpirun[@]}" -n 1 "$py" tests/mpi_pytest.py -q -p no:cacheprovider -rs \
        --with-mpi -m "mpi and cuda" tests/test_cuda.py
    step cuda-tests-2-ranks 150 "${mpirun[@]}" -n 2 "$py" tests/mpi_pytest.py -q -p no:cacheprovider -rs \
        --with-mpi -m "mpi and cuda" tests/test_cuda.py
    step cuda-tests-1-rank 480 "$py" -m pytest -q -p no:cacheprovider -s -rs -m cuda tests/test_cuda.py \
        tests/test_optimizer.py tests/test_event_clock.py
}

check_recipe() {    # the recipe for ResNet-20 on one GPU rank, a step added at each run
    step recipe-1-host 90 "${recipe[@]}" --data-on-device off --out "$out/recipe-1-host.h5"
    step recipe-2-device 90 "${recipe[@]}" --data-on-device on --out "$out/recipe-2-device.h5"
    step recipe-3-channels-last 90 "${recipe[@]}" --channels-last true --out "$out/recipe-3-channels-last.h5"
    step recipe-4-bf16 90 "${recipe[@]}" --channels-last true --amp bf16 --out "$out/recipe-4-bf16.h5"
    step recipe-table 30 "$py" scripts/gpu-recipe.py "$out"/recipe-*.h5
}

check_more() {
    overhead off 0 90 120       # (0: the case's default repeats)
    step recipe-5-compile 240 "${recipe[@]}" --channels-last true --amp bf16 --compile true \
        --out "$out/recipe-5-compile.h5"
    step recipe-table-compile 30 "$py" scripts/gpu-recipe.py "$out"/recipe-*.h5
    for amp in none bf16 fp16; do    # mixed precision against float32, one short run each
        step "amp-$amp" 90 "$py" -m dbs_mpi train --device cuda --model resnet20 --epochs 3 --global-batch 256 \
            --strategy ssgd --amp "$amp" --out "$out/amp-$amp.h5" --progress false
    done
    # the GPU rank's step beside CPU trainers (busy cores, threads, a core of its own)
    step gpu-beside-cpu 150 "$py" scripts/gpu-beside-cpu.py --steps 150
    # the mixed job with the CPU ranks kept off the GPU rank's core (the default) and not (none), alternated
    for rep in 1 2 3; do
        for bind in none cpu; do
            step "mixed-bind-$bind-$rep" 60 env DBS_MPI_BIND=$bind "${mpirun[@]}" -n 8 "$py" -m dbs_mpi train \
                --devices "$cpus" --strategy dbs --subset $((30000 * scale)) --epochs 2 --progress false \
                --out "$out/bind-$bind-$rep.h5"
        done
    done
    # 1 GPU rank beside 7 CPU ranks of 2 threads, every strategy, one epoch (the older table)
    step mixed-bench-lenet5 150 "${mpirun[@]}" -n 8 "$py" -m dbs_mpi bench hetero --speeds none --devices "$cpus" \
        --subset $((30000 * scale)) --out-dir "$bench"
    # 4 ranks sharing the GPU with different shares: ResNet-20, host-staged (and CUDA-aware where MPI is)
    for exchange in host cuda-aware; do
        if [ "$exchange" = cuda-aware ] && ! cuda_aware; then
            echo "== shared-gpu-cuda-aware: not run, this MPI is not CUDA-aware" | tee -a "$log"
            continue
        fi
        step "shared-gpu-$exchange" 150 "${mpirun[@]}" -n 4 "$py" -m dbs_mpi bench hetero --device cuda \
            --speeds 1,0.5,0.5,0.25 --model resnet20 --dataset synthetic --synthetic-shape 3,32,32 \
            --synthetic-samples $((8192 * scale)) --global-batch 256 --exchange "$exchange" --out-dir "$bench"
    done
}

for check in $checks; do
    if ! declare -F "check_$check" > /dev/null; then
        echo "gpu-check: unknown check '$check' (facts overhead mixed tests recipe more)" >&2
        exit 2
    fi
done
for check in $checks; do
    "check_$check"
done
echo "== done after $((SECONDS - start)) s" | tee -a "$log"
