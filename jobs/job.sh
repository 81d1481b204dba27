# What every job script in jobs/ does around `dbs-mpi train` (sourced by them, in the
# project's root; bash). The scheduler's script sets, before `job_run`:
#   SCHED        slurm | pbs
#   JOB_ID       the job's ID (array tasks: <array job>_<index>), for names and the log
#   BASE         the result path without .h5 (results/train-<job id>)
#   NTASKS       the ranks; HOSTS: the launcher's host options (an array, may be empty)
#   TRAIN_ARGS   the `dbs-mpi train` options of this job (an array)
#
# Meaning of the signals (the scheduler's, or the script's own timer under PBS):
#   USR1   the warning before the time limit (Slurm: --signal=B:USR1@120): the ranks
#          checkpoint and stop (file `interrupted`), and the job requeues itself;
#   TERM   a user's cancel (scancel, qdel) or a preemption: the ranks checkpoint and
#          stop (file `cancelled`), and the job ends for good (resumable by hand: OUT=).
# The traps are set as soon as this file is sourced: a signal that comes while the job
# plans is kept (without a trap USR1 would kill the batch shell). A signal is passed to
# the launcher once its ranks take it: once they have written the result file (they
# set their handlers before), not while they start (USR1 or TERM would kill a starting
# rank, or the launcher itself). A TERM before the launch ends the job without launching.
# A job continues only its own run (`dbs-mpi job plan`, docs in dbs_mpi/tools/job.py): a
# fresh start writes a new file, never one of another run with the same job ID; a log
# that already holds another job's lines (a job ID used again) says where this job's lines begin.

WARNED=0; CANCELLED=0; PENDING=""; launcher=""; JOB_LOG=""
job_signal() {      # the trap of USR1 and TERM: noted, and passed on to the launcher when it can be
    if [[ $1 == USR1 ]]; then
        WARNED=1; echo "dbs-mpi job ${JOB_ID:-?}: the time limit is near; checkpointing to continue"
    elif [[ -n $launcher ]]; then
        CANCELLED=1; echo "dbs-mpi job ${JOB_ID:-?}: TERM (a cancel, a preemption or the scheduler's requeue): checkpointing; this script does not requeue it"
    else
        CANCELLED=1; echo "dbs-mpi job ${JOB_ID:-?}: TERM (a cancel, a preemption or the scheduler's requeue) before the launch: not launching; this script does not requeue it"
    fi
    PENDING=$1
    job_pass_on
}
trap 'job_signal USR1' USR1
trap 'job_signal TERM' TERM

job_pass_on() {     # the pending signal to the launcher, once its ranks have written the result file
    [[ -n $PENDING && -n $launcher ]] || return 0
    [[ -f $OUT && $(stat -c %y "$OUT" 2>/dev/null) != "$OUT_STAMP" ]] || return 0
    kill -"$PENDING" "$launcher" 2>/dev/null
    PENDING=""
}

job_error() {       # one line where the user will look (the job's log), then exit 2
    echo "dbs-mpi job ${JOB_ID:-?}: error: $*" >&2
    exit 2
}

job_tools() {       # DBS_MPI and MPIEXEC: the project's venv first, else PATH
    if [[ -z ${MPIEXEC:-} ]]; then
        if [[ -x $PWD/.venv/bin/mpirun ]]; then MPIEXEC=$PWD/.venv/bin/mpirun; else MPIEXEC=mpirun; fi
    fi
    if [[ -x $PWD/.venv/bin/dbs-mpi ]]; then DBS_MPI=$PWD/.venv/bin/dbs-mpi; else DBS_MPI=dbs-mpi; fi
    command -v "${DBS_MPI}" >/dev/null || job_error "no dbs-mpi: neither $PWD/.venv/bin/dbs-mpi nor one on PATH (make install, or load the site's module)"
}

job_run_id() {      # RUN_ID, kept where a requeue of this job finds it again; RESTART=1 after one
    RESTART=0
    if [[ $SCHED == slurm && -n ${SLURM_JOB_ID:-} ]]; then
        local job comment
        job=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null)
        comment=$(grep -o 'dbs-mpi-run=[^ ]*' <<< "$job" | head -1)
        JOB_LOG=$(grep -o 'StdOut=[^ ]*' <<< "$job" | head -1 | cut -d= -f2-)
        if [[ -n $comment ]]; then
            RUN_ID=${comment#dbs-mpi-run=}; RESTART=1
        else
            RUN_ID=slurm-${SLURM_CLUSTER_NAME:-}-${SLURM_JOB_ID}-$(date +%s)-$RANDOM
            scontrol update JobId="$SLURM_JOB_ID" Comment="dbs-mpi-run=$RUN_ID" >/dev/null 2>&1 \
                || echo "dbs-mpi job ${JOB_ID}: note: could not keep the run ID in the job's comment; a requeue will start a new file"
        fi
    elif [[ $SCHED == pbs && -n ${PBS_JOBID:-} ]]; then
        local marker=${RESULTS_DIR:-results}/.dbs-mpi-requeued-${PBS_JOBID}
        if [[ -f $marker ]]; then RUN_ID=$(cat "$marker"); rm -f "$marker"; RESTART=1
        else RUN_ID=pbs-${PBS_JOBID}-$(date +%s)-$RANDOM; fi
    else
        RUN_ID=local-$$-$(date +%s)
    fi
    export DBS_MPI_RUN_ID=$RUN_ID
    ((RESTART)) || job_earlier_log
}

job_earlier_log() { # a new run whose log holds lines already: they are another job's (its ID used again)
    [[ -n $JOB_LOG && -f $JOB_LOG && -s $JOB_LOG ]] || return 0
    local runs
    runs=$(grep -o '; run ID [^ ;,]*' "$JOB_LOG" | cut -c10- | sort -u | paste -sd ' ')
    echo "dbs-mpi job ${JOB_ID}: the lines above belong to an earlier job with the same ID (run ID ${runs:-unknown}); this job, run ID ${RUN_ID}, starts here"
}

job_plan() {        # OUT and RESUME: a new file, this job's own run again, or OUT= given by hand
    local plan ACTION NOTE SPEEDS
    plan=$("$DBS_MPI" job plan --base "$BASE" --run-id "$RUN_ID" ${OUT_GIVEN:+--out "$OUT_GIVEN"} \
        $( ((RESTART)) && echo --restart) --config "${CONFIG:-}" --ntasks "$NTASKS" --extra "${EXTRA_ARGS:-}") || exit 2
    eval "$plan"
    [[ -n $NOTE ]] && echo "dbs-mpi job ${JOB_ID}: $NOTE"
    if [[ $ACTION == done ]]; then exit 0; fi
    RESUME=()
    [[ $ACTION == resume ]] && RESUME=(--resume "$OUT")
    SPEED_ARGS=()
    [[ -n $SPEEDS ]] && SPEED_ARGS=(--speeds "$SPEEDS") && echo "dbs-mpi job ${JOB_ID}: ${NTASKS} ranks: speeds ${SPEEDS} (the config's, cycled: rank i takes speed i mod their number)"
    mkdir -p "$(dirname "$OUT")"
}

job_run() {         # launch, unless cancelled already; signals reach the launcher through job_signal
    if ((CANCELLED)); then
        echo "dbs-mpi job ${JOB_ID}: not launched${RESUME[0]:+; $OUT is left as it was, resumable}"
        rc=3; return
    fi
    OUT_STAMP=$(stat -c %y "$OUT" 2>/dev/null)        # the result file before the launch, if any
    $MPIEXEC -n "$NTASKS" "${HOSTS[@]}" "$DBS_MPI" train "${TRAIN_ARGS[@]}" "${SPEED_ARGS[@]}" --out "$OUT" \
        "${RESUME[@]}" &
    launcher=$!
    rc=127
    while kill -0 "$launcher" 2>/dev/null; do
        if [[ -n $PENDING ]]; then
            job_pass_on; sleep 0.2      # until the ranks can take it (bounded by the launch's start-up limit)
        else
            wait "$launcher"; rc=$?     # returns early on a trapped signal
        fi
    done
    # The launcher's own status, once more (bash keeps a read one, or says 127; never blocks:
    # it has ended): a signal may have interrupted the last wait, or it ended during a sleep.
    wait "$launcher" 2>/dev/null; again=$?
    (( again != 127 )) && rc=$again
    echo "dbs-mpi job ${JOB_ID}: dbs-mpi train exited with status ${rc}"
}

job_lost_nodes() {  # the job's nodes that no longer run a step (Slurm), one per line
    [[ $SCHED == slurm && -n ${SLURM_JOB_NODELIST:-} ]] || return 0
    local node
    for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null); do
        timeout 20 srun --overlap --mem=0 -N1 -n1 -w "$node" true >/dev/null 2>&1 || echo "$node"
    done
}

job_finish() {      # after the launch: name lost nodes, mark a crashed file, requeue on the warning
    [[ -n ${TIMER:-} ]] && kill "$TIMER" 2>/dev/null
    if [[ $rc != 0 && $rc != 3 && -f $OUT ]]; then
        local lost
        lost=$(job_lost_nodes | paste -sd ' ')
        [[ -n $lost ]] && echo "dbs-mpi job ${JOB_ID}: $("$DBS_MPI" job lost "$OUT" $lost)"
        # A launch that ended with every rank killed (a lost node) leaves the file `running`: mark it `failed`.
        "$DBS_MPI" close "$OUT" --exit-status "$rc" || true
    fi
    if [[ $rc == 3 && $WARNED == 1 && $CANCELLED == 0 && ${REQUEUE:-1} == 1 ]]; then
        echo "dbs-mpi job ${JOB_ID}: checkpoint written; requeueing to continue"
        job_requeue && exit 0
        echo "dbs-mpi job ${JOB_ID}: the requeue failed; continue by hand with OUT=$OUT"
    fi
    exit "$rc"
}

job_requeue() {
    case $SCHED in
        slurm) [[ -n ${SLURM_JOB_ID:-} ]] && scontrol requeue "$SLURM_JOB_ID" ;;
        pbs) [[ -n ${PBS_JOBID:-} ]] || return 1
             echo "$RUN_ID" > "${RESULTS_DIR:-results}/.dbs-mpi-requeued-${PBS_JOBID}"
             qrerun "$PBS_JOBID" ;;
        *) return 1 ;;
    esac
}
