#!/usr/bin/env bash
# A Slurm cluster inside this machine for trying and testing the job scripts in jobs/
# (Debian's slurm-wlm 22.05 packages, run as root, no systemd needed): one node on
# 127.0.0.1, or with DBS_MPI_SLURM_NODES=N (N >= 2) N nodes, each a network, UTS and
# mount namespace of its own (see "Several nodes" below).
#
#   scripts/slurm-cluster.sh start    # install if missing, start munged, slurmctld, slurmd(s)
#   eval "$(scripts/slurm-cluster.sh env)"   # SLURM_CONF for sbatch/srun/squeue/qsub
#                                     # (start prints the same line on stdout)
#   sbatch --wait jobs/slurm/train.sbatch
#   scripts/slurm-cluster.sh status   # daemons, sinfo, squeue (exit 0 if up, 3 if not)
#   scripts/slurm-cluster.sh stop     # cancel jobs, stop the daemons by their PIDs
#   scripts/slurm-cluster.sh nodes    # the node names, one per line
#   scripts/slurm-cluster.sh cut NODE | heal NODE | kill NODE   # several nodes only:
#                                     # take NODE off the network, put it back, or kill
#                                     # every process on it (slurmd included)
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
#    scripts call the project's .venv/bin/mpirun by path;
#  - slurm-wlm-torque's qrerun fails (it calls Slurm's Perl API with the wrong
#    arguments): the TaskProlog puts a qrerun of its own ($DIR/pbs-bin: scontrol requeue)
#    first on the batch script's PATH.
#
# Several nodes (DBS_MPI_SLURM_NODES=N): nodes node1..nodeN. Each is a network namespace
# (ip netns dbs<PORT>-node<i>) joined by a veth pair to a bridge dbs<PORT>br in this
# machine's namespace, on the private network 10.77.<PORT mod 256>.0/24 (bridge and
# slurmctld .1, node i .(10+i); $DBS_MPI_SLURM_SUBNET replaces the first three numbers).
# Its slurmd runs in a UTS namespace (hostname node<i>) and a mount namespace where
# /etc/hosts is a file naming the nodes, so that MPI launchers resolve them; everything a
# job starts on the node inherits the three. Processes on different nodes talk only over
# TCP through the bridge (MPI sees different hosts); nothing outside the namespaces and
# the bridge is contacted, and nothing under /etc is written. Each node's slurmd (and so
# every process of its jobs) is bound to its share of the machine's cores (the cores
# divided by the nodes, dealt out in turn), so that a node's ranks see and share their
# node's cores as on a real cluster; Slurm is still told that each node has
# $DBS_MPI_SLURM_CPUS CPUs (default: all the machine's), so that `--ntasks-per-node` up
# to that is accepted (with --overcommit where it is more than the cores bound). The
# nodes share the file system.
set -euo pipefail

DIR=${DBS_MPI_SLURM_DIR:-/tmp/dbs-mpi-slurm}
PORT=${DBS_MPI_SLURM_PORT:-6817}
START_TIMEOUT=${DBS_MPI_SLURM_START_TIMEOUT:-60}   # seconds for the node to become idle
# The node count: given, else the one the cluster in $DIR was started with, else 1.
NODES=${DBS_MPI_SLURM_NODES:-$(cat "$DIR/nodes" 2>/dev/null || echo 1)}
SUBNET=${DBS_MPI_SLURM_SUBNET:-10.77.$((PORT % 256))}
BRIDGE=dbs${PORT}br
CONF=$DIR/slurm.conf
[[ $NODES =~ ^[1-9][0-9]?$ ]] || { echo "slurm-cluster: error: DBS_MPI_SLURM_NODES must be 1..99, not '$NODES'" >&2; exit 2; }
# The cores this shell may run on, from the kernel's list ("0-3,8"): nproc counts them, but
# honours OMP_NUM_THREADS / OMP_THREAD_LIMIT (1 in many cluster users' shells).
CORES=()
IFS=, read -ra _ranges <<< "$(awk '/^Cpus_allowed_list:/ {print $2}' /proc/self/status)"
for _r in "${_ranges[@]}"; do
    if [[ $_r == *-* ]]; then CORES+=($(seq "${_r%-*}" "${_r#*-}")); else CORES+=("$_r"); fi
done
# The CPUs Slurm is told each node has (so that it accepts --ntasks-per-node up to them),
# and, with several nodes, the cores each node's processes are bound to: a share of the
# machine's (at least 1).
CPUS=${DBS_MPI_SLURM_CPUS:-${#CORES[@]}}
SHARE=$(( ${#CORES[@]} / NODES > 0 ? ${#CORES[@]} / NODES : 1 ))
PACKAGES=(slurmctld slurmd slurm-client munge slurm-wlm-torque)
export SLURM_CONF=$CONF

log() { echo "slurm-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

# alive_pid PIDFILE NAME: the PID in PIDFILE if that process is alive (not a zombie) and is NAME.
alive_pid() {
    local f=$1 name=$2 pid
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
    # A killed daemon stays a zombie until PID 1 reaps it, which in a container may be late.
    [[ $(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) != Z ]] || return 1
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

# The node names, one per line.
node_names() {
    if ((NODES == 1)); then echo localhost; else seq -f 'node%g' 1 "$NODES"; fi
}

write_config() {
    local mem_mb real_mb ctl_addr=127.0.0.1 d_files=slurmd nodes_line
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    real_mb=$((mem_mb * 9 / 10 / NODES))    # below what slurmd measures, or the node drains
    nodes_line="NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$real_mb State=UNKNOWN"
    if ((NODES > 1)); then
        ctl_addr=$SUBNET.1 d_files=slurmd-%n nodes_line=""
        for ((i = 1; i <= NODES; i++)); do
            nodes_line+="NodeName=node$i NodeAddr=$SUBNET.$((10 + i)) CPUs=$CPUS RealMemory=$real_mb State=UNKNOWN"$'\n'
        done
        { echo "127.0.0.1 localhost"; for ((i = 1; i <= NODES; i++)); do echo "$SUBNET.$((10 + i)) node$i"; done; } > "$DIR/hosts"
    else
        rm -f "$DIR/hosts"
    fi
    cat > "$CONF" <<EOF
# Written by scripts/slurm-cluster.sh: a $NODES-node test cluster inside this machine.
ClusterName=dbsmpi
SlurmctldHost=localhost($ctl_addr)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/${d_files/slurmd/d}
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/$d_files.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/$d_files.log
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
$nodes_line
PartitionName=debug Nodes=$(node_names | paste -sd,) Default=YES MaxTime=INFINITE State=UP
EOF
    mkdir -p "$DIR/pbs-bin"
    cat > "$DIR/pbs-bin/qrerun" <<'EOF'
#!/bin/bash
# qrerun JOBID of the test cluster: Torque's N.host or N[i].host as Slurm's N or N_i, requeued.
id=${1%%.*}
[[ $id =~ ^([0-9]+)\[([0-9]+)\]$ ]] && id=${BASH_REMATCH[1]}_${BASH_REMATCH[2]}
exec scontrol requeue "$id"
EOF
    chmod +x "$DIR/pbs-bin/qrerun"
    # A TaskProlog's "export NAME=VALUE" lines on stdout enter the task's environment.
    cat > "$DIR/pbs-taskprolog.sh" <<'EOF'
#!/bin/bash
# Slurm TaskProlog of the test cluster (scripts/slurm-cluster.sh): the variables that
# PBS/Torque gives a job, which slurm-wlm-torque's qsub does not set. Only for the batch
# script; job steps (srun, mpirun's proxies) inherit them from it.
# With several nodes (a hosts file beside this script), for every task: the nodes share
# one kernel, and UCX (pip's MPICH) would see one machine and pass messages between them
# through shared memory. Between nodes, MPI goes over TCP on the node's eth0 through the
# bridge instead, as on a real cluster (and stops when a node is cut off).
if [[ -f "$(dirname "$0")/hosts" ]]; then
    echo "export UCX_TLS=${UCX_TLS:-tcp,self}"
    echo "export UCX_NET_DEVICES=${UCX_NET_DEVICES:-eth0}"
fi
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
echo "export PATH=$(dirname "$0")/pbs-bin:${PATH:-/usr/bin:/bin}"
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

# --- several nodes: namespaces, veth pairs and a bridge --------------------------------

netns() { echo "dbs${PORT}-$1"; }                       # NODE -> its network namespace
veth() { echo "dbs${PORT}v${1#node}"; }                 # NODE -> its veth end on the bridge

# node_cpuset NODE: the SHARE cores node<i> runs on, "a,b,..": the machine's cores dealt
# out in turn, so that nodes share a core only when there are more nodes than cores.
node_cpuset() {
    local i j set=()
    i=$(node_index "$1")
    for ((j = 0; j < SHARE; j++)); do set+=("${CORES[((i - 1) * SHARE + j) % ${#CORES[@]}]}"); done
    (IFS=,; echo "${set[*]}")
}

slurmd_pidfile() {
    if ((NODES == 1)); then echo "$DIR/run/slurmd.pid"; else echo "$DIR/run/slurmd-$1.pid"; fi
}

# node_index NODE: i of node<i>, or an error naming the nodes.
node_index() {
    [[ $1 =~ ^node([0-9]+)$ ]] && ((BASH_REMATCH[1] >= 1 && BASH_REMATCH[1] <= NODES)) \
        || die "no node '$1' (nodes: $(node_names | paste -sd ' '); DBS_MPI_SLURM_NODES=$NODES)"
    echo "${BASH_REMATCH[1]}"
}

setup_network() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local node i ns v
    for node in $(node_names); do
        i=$(node_index "$node") ns=$(netns "$node") v=$(veth "$node")
        [[ -e /run/netns/$ns ]] || ip netns add "$ns"
        ip link show "$v" >/dev/null 2>&1 || ip link add "$v" type veth peer name eth0 netns "$ns"
        ip link set "$v" master "$BRIDGE" up
        ip -n "$ns" addr replace "$SUBNET.$((10 + i))/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
    done
}

teardown_network() {
    local node ns pids
    for node in $(node_names); do
        ns=$(netns "$node")
        [[ -e /run/netns/$ns ]] || continue
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        # shellcheck disable=SC2086  # one argument per PID
        [[ -z $pids ]] || { log "killing what is left on $node: $(echo $pids)"; kill -9 $pids 2>/dev/null || true; }
        ip netns delete "$ns" || log "could not delete namespace $ns"
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link delete "$BRIDGE" || log "could not delete $BRIDGE"; fi
}

# start_slurmd NODE: slurmd for NODE; on several nodes inside the node's namespaces.
start_slurmd() {
    local node=$1
    if ((NODES == 1)); then
        /usr/sbin/slurmd -f "$CONF" -N "$node" || die "slurmd did not start (log: $DIR/log/slurmd.log)"
        return
    fi
    # taskset: the node's own cores (its share of the machine's). nsenter: the node's network (not `ip netns exec`, whose fresh /sys hides the cgroup
    # file system slurmd reads). unshare: its hostname, and its /etc/hosts bound over the
    # machine's in a private mount namespace. slurmd forks into the background and keeps
    # all three; so does every job step it starts.
    taskset -c "$(node_cpuset "$node")" nsenter --net="/run/netns/$(netns "$node")" unshare --uts --mount --propagation private \
        sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && exec /usr/sbin/slurmd -f "$3" -N "$1"' \
        sh "$node" "$DIR/hosts" "$CONF" || die "slurmd of $node did not start (log: $DIR/log/slurmd-$node.log)"
}

# wait_ready NODE SINCE: until NODE accepts jobs and a slurmd started at SINCE or later has
# registered (a restarted slurmctld shows the saved node state before that). Bounded.
wait_ready() {
    local node=$1 since=$2 state="" started deadline=$((SECONDS + START_TIMEOUT))
    while ((SECONDS < deadline)); do
        state=$(timeout 10 sinfo -h -n "$node" -o %t 2>/dev/null || true)
        case $state in
            idle|mix|alloc)
                started=$(timeout 10 scontrol -o show node "$node" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' || true)
                started=${started#SlurmdStartTime=}
                if [[ -n $started && $started != None ]] && (($(date -d "$started" +%s) >= since - 1)); then
                    return 0
                fi ;;
            drain*|down*) timeout 10 scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.25
    done
    tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/"slurmd*.log >&2 || true
    die "node $node not ready after ${START_TIMEOUT}s (state '${state}'); logs in $DIR/log"
}

start() {
    [[ $(id -u) == 0 ]] || die "needs root (installs packages, runs munged as the munge user)"
    local t0=$EPOCHREALTIME pid node
    mkdir -p "$DIR"/{log,run,state/ctld,state/d}
    ((NODES == 1)) || for node in $(node_names); do mkdir -p "$DIR/state/d-$node"; done
    if [[ -s $DIR/nodes && $(<"$DIR/nodes") != "$NODES" ]] && alive_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
        die "the cluster in $DIR runs with $(<"$DIR/nodes") node(s), not $NODES: stop it first"
    fi
    echo "$NODES" > "$DIR/nodes"
    install_packages
    write_config
    ((NODES == 1)) || setup_network
    start_munge
    if pid=$(alive_pid "$DIR/run/slurmctld.pid" slurmctld); then
        log "slurmctld already running (pid $pid): reconfigure"
        scontrol reconfigure || true
    else
        /usr/sbin/slurmctld -f "$CONF" || die "slurmctld did not start (log: $DIR/log/slurmctld.log)"
    fi
    local -A since=()
    for node in $(node_names); do
        since[$node]=0
        if ! alive_pid "$(slurmd_pidfile "$node")" slurmd >/dev/null; then
            since[$node]=$(date +%s)
            start_slurmd "$node"
        fi
    done
    for node in $(node_names); do wait_ready "$node" "${since[$node]}"; done
    log "up in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}') s: node(s) $(node_names | paste -sd ' '), $CPUS CPUs each$( ((NODES == 1)) || echo " (bound to $SHARE core(s) each)"), slurmctld port $PORT; config $CONF"
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
    local i node
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
    for node in $(node_names); do stop_pid slurmd "$(slurmd_pidfile "$node")"; done
    stop_pid slurmctld "$DIR/run/slurmctld.pid"
    stop_pid munged "$DIR/munge/munged.pid"
    ((NODES == 1)) || teardown_network
}

status() {
    local up=1 name f pid node
    for name in munged slurmctld; do
        f=$DIR/run/$name.pid; [[ $name == munged ]] && f=$DIR/munge/munged.pid
        if pid=$(alive_pid "$f" "$name"); then echo "$name: running (pid $pid)"; else echo "$name: stopped"; up=0; fi
    done
    for node in $(node_names); do
        if pid=$(alive_pid "$(slurmd_pidfile "$node")" slurmd); then echo "slurmd $node: running (pid $pid)"
        else echo "slurmd $node: stopped"; up=0; fi
    done
    if ((up)); then
        echo "SLURM_CONF=$CONF"
        timeout 10 sinfo || true
        timeout 10 squeue || true
        return 0
    fi
    return 3
}

# After `heal`: the controller may have marked NODE down (a job it could not end there)
# or not responding; bring it back to service (RESUME, a reconfigure to ping it, again
# every 2 s) and wait until it is usable, at most HEAL_TIMEOUT seconds. Measured on 2
# cores: 0.02-0.6 s, from `down*` (cut for 80 s) too.
HEAL_TIMEOUT=${DBS_MPI_SLURM_HEAL_TIMEOUT:-20}
back_in_service() {
    local node=$1 state end=$((SECONDS + HEAL_TIMEOUT)) pinged=0
    while ((SECONDS < end)); do
        state=$(timeout 10 sinfo -h -n "$node" -o '%t' 2>/dev/null || true)
        case $state in
            idle|alloc|mix|comp) log "$node $state"; return 0 ;;
            down*|drain*|fail*) timeout 10 scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
        esac
        if [[ $state == *'*' ]] && ((SECONDS >= pinged)); then
            timeout 10 scontrol reconfigure 2>/dev/null || true; pinged=$((SECONDS + 2))
        fi
        sleep 0.2
    done
    log "$node still '$state' after ${HEAL_TIMEOUT} s"
}

# cut NODE / heal NODE: detach NODE's veth from the bridge and attach it again. The node
# keeps its link and addresses, so nothing on either side sees an error: packets are just
# lost, as when a switch or a cable fails silently. kill NODE: SIGKILL to every process
# on NODE (its slurmd, job steps and ranks), as when the node crashes.
node_op() {
    local op=$1 node=$2 pids
    ((NODES > 1)) || die "'$op' needs a cluster of several nodes (DBS_MPI_SLURM_NODES)"
    node_index "$node" >/dev/null
    case $op in
        cut) ip link set "$(veth "$node")" nomaster; log "$node cut off the network" ;;
        heal) ip link set "$(veth "$node")" master "$BRIDGE"; log "$node back on the network"; back_in_service "$node" ;;
        kill)
            pids=$(ip netns pids "$(netns "$node")" 2>/dev/null || true)
            # shellcheck disable=SC2086  # one argument per PID
            [[ -z $pids ]] || kill -9 $pids 2>/dev/null || true
            log "$node: killed $(wc -w <<< "$pids") process(es)" ;;
    esac
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    restart) stop; start ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    cpus) echo "$CPUS" ;;
    nodes) node_names ;;
    cut|heal|kill) node_op "$1" "${2:-}" ;;
    *) echo "usage: $0 start|stop|status|restart|env|cpus|nodes|cut NODE|heal NODE|kill NODE" >&2; exit 2 ;;
esac
