#!/usr/bin/env bash
# A single-node Slurm cluster on 127.0.0.1 for trying and testing the job scripts in
# jobs/ (Debian's slurm-wlm 22.05 packages, run as root, no systemd needed).
#
#   scripts/slurm-cluster.sh start    # install if missing, start munged, slurmctld, slurmd
#   eval "$(scripts/slurm-cluster.sh env)"   # SLURM_CONF for sbatch/srun/squeue/qsub
#                                     # (start prints the same line on stdout)
#   sbatch --wait jobs/slurm/train.sbatch
#   scripts/slurm-cluster.sh status   # daemons, sinfo, squeue (exit 0 if up, 3 if not)
#   scripts/slurm-cluster.sh stop     # cancel jobs, stop the daemons by their PIDs
#
# Everything lives in $DBS_MPI_SLURM_DIR (default /tmp/dbs-mpi-slurm): slurm.conf, a
# munge key and socket of its own, state, PID files and logs (log/). Nothing under /etc
# is written: the clients find the configuration through SLURM_CONF (`env` prints it).
# The slurmctld state is kept across stop/start so that job IDs keep increasing (result
# files carry the job ID); remove the directory for a fresh cluster.
#
# The node "localhost" (127.0.0.1) offers $DBS_MPI_SLURM_CPUS CPUs (default: the cores
# this shell may use; OMP_NUM_THREADS, which nproc would honour, does not count).
# A job may ask for more tasks than that with `sbatch --overcommit` (e.g. 4 ranks on 2
# cores). Ports: $DBS_MPI_SLURM_PORT (slurmctld, default 6817) and the next one (slurmd).
#
# Test-cluster specifics (kept out of the job scripts):
#  - a TaskProlog exports the PBS/Torque variables (PBS_O_WORKDIR, PBS_NODEFILE,
#    PBS_JOBID, PBS_ARRAYID, ...) that slurm-wlm-torque's qsub does not set, so that
#    jobs/pbs/*.pbs run unchanged under `qsub`;
#  - `qsub -W block=true` exits 0 even when the job failed: read the job's state and
#    exit code with `scontrol show job ID` (kept for MinJobAge seconds after the end)
#    or from log/jobcomp.log (one line per finished job, kept);
#  - installing slurm-wlm-torque makes /usr/bin/mpirun Slurm's wrapper: the job
#    scripts call the project's .venv/bin/mpirun by path.
set -euo pipefail

DIR=${DBS_MPI_SLURM_DIR:-/tmp/dbs-mpi-slurm}
# nproc honours OMP_NUM_THREADS / OMP_THREAD_LIMIT (1 in many cluster users' shells): not here.
CPUS=${DBS_MPI_SLURM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
PORT=${DBS_MPI_SLURM_PORT:-6817}
START_TIMEOUT=${DBS_MPI_SLURM_START_TIMEOUT:-60}   # seconds for the node to become idle
CONF=$DIR/slurm.conf
PACKAGES=(slurmctld slurmd slurm-client munge slurm-wlm-torque)
export SLURM_CONF=$CONF

log() { echo "slurm-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

# alive_pid PIDFILE NAME: the PID in PIDFILE if that process is alive and is NAME.
alive_pid() {
    local f=$1 name=$2 pid
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
    echo "$pid"
}

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get"
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    local rc=0
    if ! timeout 600 apt-get install -y -q --no-install-recommends "${missing[@]}" >"$DIR/log/apt.log" 2>&1; then
        log "install failed; apt-get update and retry"
        timeout 600 apt-get update -q >>"$DIR/log/apt.log" 2>&1 || true
        timeout 600 apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$DIR/log/apt.log" 2>&1 || rc=$?
    fi
    ((rc == 0)) || { tail -n 20 "$DIR/log/apt.log" >&2; die "apt-get install failed (log: $DIR/log/apt.log)"; }
}

write_config() {
    local mem_mb real_mb
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    real_mb=$((mem_mb * 9 / 10))            # below what slurmd measures, or the node drains
    cat > "$CONF" <<EOF
# Written by scripts/slurm-cluster.sh: a one-node test cluster on 127.0.0.1.
ClusterName=dbsmpi
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No systemd, cgroup v1 here: track processes by parentage, no task confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# One line per finished job (state, exit code), kept after scontrol forgets the job.
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
# srun starts MPI ranks with PMI-2 (MPICH, Open MPI); pmix is not installed.
MpiDefault=pmi2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
# Jobs get memory per CPU instead of the whole node, so that they can share it.
DefMemPerCPU=$((real_mb / CPUS))
# A request the partition can never satisfy fails at submission instead of pending.
EnforcePartLimits=ALL
# Finished jobs stay visible to scontrol this long; small, so that sbatch --wait
# polls every 2 s instead of backing off to 32 s.
MinJobAge=4
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
# PBS/Torque variables for jobs submitted with slurm-wlm-torque's qsub.
TaskProlog=$DIR/pbs-taskprolog.sh
Epilog=$DIR/epilog.sh
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$real_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    # A TaskProlog's "export NAME=VALUE" lines on stdout enter the task's environment.
    cat > "$DIR/pbs-taskprolog.sh" <<'EOF'
#!/bin/bash
# Slurm TaskProlog of the test cluster (scripts/slurm-cluster.sh): the variables that
# PBS/Torque gives a job, which slurm-wlm-torque's qsub does not set. Only for the batch
# script; job steps (srun, mpirun's proxies) inherit them from it.
[[ -z ${SLURM_STEP_ID:-} ]] || exit 0      # the batch script has no step ID here
[[ -n ${PBS_JOBID:-} ]] && exit 0
job=${SLURM_JOB_ID}
nodefile="$(dirname "$0")/nodefiles/${job}"
mkdir -p "$(dirname "$nodefile")"
# One line per task slot: expand SLURM_TASKS_PER_NODE ("2(x3),1") over the node list.
mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST}" 2>/dev/null || echo "${SLURM_JOB_NODELIST}")
counts=()
IFS=, read -ra groups <<< "${SLURM_TASKS_PER_NODE:-1}"
for g in "${groups[@]}"; do
    if [[ $g =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
        for ((i = 0; i < BASH_REMATCH[2]; i++)); do counts+=("${BASH_REMATCH[1]}"); done
    else
        counts+=("$g")
    fi
done
: > "$nodefile"
for ((n = 0; n < ${#nodes[@]}; n++)); do
    for ((k = 0; k < ${counts[n]:-1}; k++)); do echo "${nodes[n]}" >> "$nodefile"; done
done
echo "export PBS_ENVIRONMENT=PBS_BATCH"
# Torque names an array task JOBID[INDEX]; the node file is per Slurm job.
if [[ -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    echo "export PBS_JOBID=${SLURM_ARRAY_JOB_ID}[${SLURM_ARRAY_TASK_ID}].localhost"
else
    echo "export PBS_JOBID=${job}.localhost"
fi
echo "export PBS_JOBNAME=${SLURM_JOB_NAME:-}"
echo "export PBS_O_WORKDIR=${SLURM_SUBMIT_DIR:-$PWD}"
echo "export PBS_O_HOST=${SLURM_SUBMIT_HOST:-localhost}"
echo "export PBS_QUEUE=${SLURM_JOB_PARTITION:-}"
echo "export PBS_NODEFILE=${nodefile}"
echo "export PBS_NUM_NODES=${SLURM_JOB_NUM_NODES:-1}"
echo "export PBS_NP=$(wc -l < "$nodefile")"
echo "export PBS_NUM_PPN=${counts[0]:-1}"
if [[ -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    echo "export PBS_ARRAYID=${SLURM_ARRAY_TASK_ID}"        # Torque
    echo "export PBS_ARRAY_INDEX=${SLURM_ARRAY_TASK_ID}"   # PBS Pro
fi
EOF
    cat > "$DIR/epilog.sh" <<EOF
#!/bin/sh
# Slurm Epilog (root, at the end of every job): remove the job's PBS node file.
rm -f "$DIR/nodefiles/\${SLURM_JOB_ID}"
exit 0
EOF
    chmod 755 "$DIR/pbs-taskprolog.sh" "$DIR/epilog.sh"
}

start_munge() {
    local m=$DIR/munge pid
    if pid=$(alive_pid "$m/munged.pid" munged); then log "munged already running (pid $pid)"; return 0; fi
    install -d -o munge -g munge -m 755 "$m"   # munged: socket dir must be o+x
    if [[ ! -s $m/munge.key ]]; then
        dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
        chown munge:munge "$m/munge.key"; chmod 600 "$m/munge.key"
    fi
    rm -f "$m/munge.socket.2" "$m/munge.socket.2.lock"
    runuser -u munge -- /usr/sbin/munged --socket="$m/munge.socket.2" --key-file="$m/munge.key" \
        --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" \
        || { cat "$m/munged.log" >&2 2>/dev/null || true; die "munged did not start"; }
}

start() {
    [[ $(id -u) == 0 ]] || die "needs root (installs packages, runs munged as the munge user)"
    local t0=$EPOCHREALTIME pid
    mkdir -p "$DIR"/{log,run,state/ctld,state/d}
    install_packages
    write_config
    start_munge
    if pid=$(alive_pid "$DIR/run/slurmctld.pid" slurmctld); then
        log "slurmctld already running (pid $pid): reconfigure"
        scontrol reconfigure || true
    else
        /usr/sbin/slurmctld -f "$CONF" || die "slurmctld did not start (log: $DIR/log/slurmctld.log)"
    fi
    local since=0
    if ! alive_pid "$DIR/run/slurmd.pid" slurmd >/dev/null; then
        since=$(date +%s)
        /usr/sbin/slurmd -f "$CONF" -N localhost || die "slurmd did not start (log: $DIR/log/slurmd.log)"
    fi
    # Wait (bounded) until the node accepts jobs and this slurmd has registered (a
    # restarted slurmctld shows the saved node state before that).
    local state="" started ready=0 deadline=$((SECONDS + START_TIMEOUT))
    while ((SECONDS < deadline)); do
        state=$(timeout 10 sinfo -h -n localhost -o %t 2>/dev/null || true)
        case $state in
            idle|mix|alloc)
                started=$(timeout 10 scontrol -o show node localhost 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' || true)
                started=${started#SlurmdStartTime=}
                if [[ -n $started && $started != None ]] && (($(date -d "$started" +%s) >= since - 1)); then
                    ready=1; break
                fi ;;
            drain*|down*) timeout 10 scontrol update NodeName=localhost State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.25
    done
    if ((!ready)); then
        tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
        die "node not ready after ${START_TIMEOUT}s (state '${state}'); logs in $DIR/log"
    fi
    log "up in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}') s: node localhost, $CPUS CPUs, slurmctld port $PORT; config $CONF"
    echo "export SLURM_CONF=$CONF"     # stdout: eval "$(scripts/slurm-cluster.sh start)"
}

stop_pid() {   # stop_pid NAME PIDFILE: SIGTERM, wait up to 15 s, then SIGKILL
    local name=$1 f=$2 pid i
    pid=$(alive_pid "$f" "$name") || { rm -f "$f"; return 0; }
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "$name (pid $pid) still running: SIGKILL"; kill -9 "$pid" 2>/dev/null || true; fi
    rm -f "$f"
    log "stopped $name (pid $pid)"
}

stop() {
    local i
    if alive_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
        # Cancel every job first so that no job step outlives slurmd (bounded wait).
        local jobs
        jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
        # shellcheck disable=SC2086  # one argument per job ID
        [[ -z $jobs ]] || timeout 10 scancel --full --quiet $jobs 2>/dev/null || true
        for ((i = 0; i < 40; i++)); do
            [[ -z $(timeout 10 squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.25
        done
    fi
    stop_pid slurmd "$DIR/run/slurmd.pid"
    stop_pid slurmctld "$DIR/run/slurmctld.pid"
    stop_pid munged "$DIR/munge/munged.pid"
}

status() {
    local up=1 name f pid
    for name in munged slurmctld slurmd; do
        f=$DIR/run/$name.pid; [[ $name == munged ]] && f=$DIR/munge/munged.pid
        if pid=$(alive_pid "$f" "$name"); then echo "$name: running (pid $pid)"; else echo "$name: stopped"; up=0; fi
    done
    if ((up)); then
        echo "SLURM_CONF=$CONF"
        timeout 10 sinfo || true
        timeout 10 squeue || true
        return 0
    fi
    return 3
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    restart) stop; start ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    cpus) echo "$CPUS" ;;
    *) echo "usage: $0 start|stop|status|restart|env|cpus" >&2; exit 2 ;;
esac
