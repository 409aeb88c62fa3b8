#!/usr/bin/env bash
# Submit a family of presets (conf/experiment/<family>/*.yaml) or one preset to SLURM as array jobs, with the
# resources of each preset's `launch:` block; context-extension stages wait for their parent task (aftercorr).
#
#   launch/sweep.sh scaling -- data=shards data.path=/data/corpus            # the scaling grid
#   launch/sweep.sh controlled_1.5b --throttle 4 -- data=shards data.path=/data/corpus
#   launch/sweep.sh scaling --seeds 0,1,2 -- data=shards data.path=/data/corpus   # runs/<run name>-seed<k>
#   launch/sweep.sh controlled_1.5b/logo --runs-dir /scratch/runs -- data=shards data.path=/data/corpus
#   SBATCH_ARGS="--partition=gpu --account=me" launch/sweep.sh ratio_sweep -- ...
#
# Everything after `--` is passed to every train.py. Prints one line per task:
# <array job>_<task> <preset> [seed=<k>] <run dir> [after <parent array job>_<task>]. See launch/sweep.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" launch/sweep.py "$@"
