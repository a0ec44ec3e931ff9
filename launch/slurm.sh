#!/bin/bash
# SLURM batch script for `moejax train` (docs/LAUNCH.md): one process per host, requeue on preemption.
# Submit from the repository root:  sbatch launch/slurm.sh   (tests/test_launch.py runs it with stubs)
#SBATCH --job-name=moejax-hero
#SBATCH --nodes=176
#SBATCH --ntasks-per-node=1            # one process per host; it drives the host's 4 GPUs
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --signal=TERM@300              # SIGTERM 5 min before the time limit: checkpoint and exit 75
#SBATCH --requeue
#SBATCH --segment=16                   # keep 16 consecutive hosts on one NVLink domain (rack), if supported
#SBATCH --output=logs/%x-%j-%t.out

set -euo pipefail
MOEJAX=${MOEJAX:-.venv/bin/moejax}
PRESET=${PRESET:-hero}
RUN_DIR=${RUN_DIR:-/shared/runs/hero}
PORT=${PORT:-8476}
EXIT_PREEMPTED=75                      # moejax: saved after SIGTERM (or stopped before its first step)

# Rack-major host order: process ids 0..15 on rack 0, 16..31 on rack 1, ... Process 0's host is the
# coordinator. (`sed -n 1p` reads all of its input: `head -n1` could end the pipe early and, under
# pipefail, turn scontrol's SIGPIPE into a failed script.)
COORD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p):$PORT
export MOEJAX PRESET RUN_DIR COORD

# Under `set -e` a bare `srun` returning 75 would end the script right here, before the requeue:
# capture its status instead.
rc=0
srun --kill-on-bad-exit=1 bash -c '
  exec "$MOEJAX" train --preset "$PRESET" --run-dir "$RUN_DIR" \
      --coordinator "$COORD" --num-processes "$SLURM_NTASKS" --process-id "$SLURM_PROCID" \
      --wandb offline
' || rc=$?

if [ "$rc" -eq "$EXIT_PREEMPTED" ]; then
  # Preempted: requeue this job; the same command resumes from the newest complete checkpoint.
  echo "moejax exited $rc (preempted): requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$rc"
