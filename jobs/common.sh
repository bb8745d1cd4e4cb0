# Shared by the batch scripts in jobs/: launch one mpitrain command inside a
# SLURM allocation and stop it cleanly when SLURM asks.
#
# Environment (all optional):
#   MPITRAIN_HOME      the checkout (default: the directory sbatch was run from)
#   MPITRAIN_PYTHON    its interpreter (default: $MPITRAIN_HOME/.venv/bin/python)
#   MPITRAIN_RESULTS   results directory (default: $MPITRAIN_HOME/results)
#   MPITRAIN_LAUNCHER  mpirun (default) or srun
#   MPITRAIN_SRUN_MPI  srun's MPI plugin (default: the one of the MPI that
#                      MPITRAIN_PYTHON's mpi4py loads: pmix for Open MPI, pmi2 for MPICH)
#   MPITRAIN_DATA_DIR  MNIST location, passed to every rank
#
#   MPITRAIN_MAX_RESTARTS  restarts from the last checkpoint after a failure (default 3)
#   MPITRAIN_LAUNCH_ARGS   more options for mpitrain launch, e.g. "-np 2:4": start on the
#                      allocation's nodes that answer, leave out one that fails and take
#                      it back when it answers again (submit with sbatch --no-kill, or
#                      SLURM ends the job when a node fails)
#
# Launcher: `mpitrain launch` (the default) runs mpirun inside the allocation
# (the nodes and the task count come from SLURM: no hostfile, which would fight
# the allocation) and, when the job fails (a rank or a node lost), restarts it
# with --resume from its last checkpoint, up to MPITRAIN_MAX_RESTARTS times.
# MPITRAIN_LAUNCHER=srun runs the tasks with srun once instead, without restarts:
# `srun --mpi=pmix` for Open MPI 4.1 and 5 (under pmi2, 4.1 fails to start and 5's
# ranks each run alone), `--mpi=pmi2` for MPICH (it refuses PMIx), and
# --kill-on-bad-exit, so that a rank that fails alone ends the step at once.
#
# Stopping: with #SBATCH --signal=B:TERM@60, SLURM sends the batch shell SIGTERM
# 60 s before the time limit; `scancel --batch --signal=TERM <job>` does the same
# by hand. The trap turns it into SIGUSR1 for the launcher, which mpirun forwards
# to every rank and then waits: every rank stops at the same step, rank 0 writes
# a checkpoint and the results, and the job ends with exit code 143 (resume with
# --resume). (SIGTERM straight to mpirun would kill the ranks a second later.)

MPITRAIN_HOME=${MPITRAIN_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
MPITRAIN_PYTHON=${MPITRAIN_PYTHON:-$MPITRAIN_HOME/.venv/bin/python}
MPITRAIN_RESULTS=${MPITRAIN_RESULTS:-$MPITRAIN_HOME/results}
MPITRAIN_LAUNCHER=${MPITRAIN_LAUNCHER:-mpirun}  # mpirun: through mpitrain launch
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
[ -n "${MPITRAIN_DATA_DIR:-}" ] && export MPITRAIN_DATA_DIR

mpitrain_run() {
    # mpitrain_run ARGS...  -- runs `python -m mpitrain ARGS` on every task of the job
    cd "$MPITRAIN_HOME" || exit 1
    case "$MPITRAIN_LAUNCHER" in
        # shellcheck disable=SC2086  # (MPITRAIN_LAUNCH_ARGS: words)
        mpirun) "$MPITRAIN_PYTHON" -m mpitrain launch --max-restarts \
                    "${MPITRAIN_MAX_RESTARTS:-3}" ${MPITRAIN_LAUNCH_ARGS:-} "$@" \
                    --results-dir "$MPITRAIN_RESULTS" & ;;
        srun) local plugin=${MPITRAIN_SRUN_MPI:-$("$MPITRAIN_PYTHON" -m mpitrain.launch.dialect srun-mpi)}
              srun --mpi="${plugin:-pmix}" --kill-on-bad-exit=1 "$MPITRAIN_PYTHON" -m mpitrain \
                  "$@" --results-dir "$MPITRAIN_RESULTS" & ;;
        *) echo "mpitrain job: MPITRAIN_LAUNCHER must be mpirun or srun" >&2; exit 2 ;;
    esac
    local launcher=$!
    trap 'echo "mpitrain job: stop requested, checkpointing" >&2; kill -USR1 '"$launcher" TERM INT
    local code
    while true; do  # `wait` returns early when a trapped signal arrives
        wait "$launcher"
        code=$?
        kill -0 "$launcher" 2>/dev/null || break
    done
    trap - TERM INT
    return "$code"
}
