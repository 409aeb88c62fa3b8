#!/usr/bin/env bash
# Submit a family of paper presets (conf/experiment/<family>/*.yaml) as SLURM jobs, one job per preset.
# A context-extension preset (*_ctx32k, *_ctx128k) waits for the job of the stage it starts from
# (--dependency=afterok), so a family's stages run as a chain; preempted jobs requeue and resume on their own
# (launch/slurm_train.sbatch), and `afterok` holds until the requeued job really finishes.
#
#   launch/sweep.sh scaling -- data=shards data.path=/data/corpus
#   launch/sweep.sh controlled_1.5b -- data=shards data.path=/data/corpus
#   SBATCH_ARGS="--partition=gpu --account=me" launch/sweep.sh ratio_sweep
#
# Everything after `--` is passed to every train.py. Prints one line per job: <job id> <preset> [after <id>].
set -euo pipefail
cd "$(dirname "$0")/.."
family="${1:?usage: launch/sweep.sh <family: $(ls conf/experiment | tr '\n' ' ')> [-- overrides...]}"
shift
[ "${1:-}" = "--" ] && shift
dir="conf/experiment/$family"
[ -d "$dir" ] || { echo "error: no experiment family '$family' (choose from: $(ls conf/experiment | tr '\n' ' '))" >&2; exit 2; }

declare -A job
submit() {  # preset [dependency job id]
    local dep=()
    [ -n "${2:-}" ] && dep=(--dependency="afterok:$2")
    # shellcheck disable=SC2086
    job[$1]=$(sbatch --parsable ${SBATCH_ARGS:-} "${dep[@]}" --job-name="logo-${1//\//-}" \
        launch/slurm_train.sbatch "experiment=$1" "${overrides[@]}")
    job[$1]="${job[$1]%%;*}"  # --parsable prints "id" or "id;cluster"
    echo "${job[$1]} $1${2:+ after $2}"
}

overrides=("$@")
# pretraining presets first, then each 32k stage after its 8k run, then each 128k stage after its 32k run
for suffix in "" _ctx32k _ctx128k; do
    for f in "$dir"/*.yaml; do
        name="$(basename "$f" .yaml)"
        case "$suffix" in
            "") [[ "$name" == *_ctx32k || "$name" == *_ctx128k ]] && continue; prev="" ;;
            _ctx32k) [[ "$name" == *_ctx32k ]] || continue; prev="$family/${name%_ctx32k}" ;;
            _ctx128k) [[ "$name" == *_ctx128k ]] || continue; prev="$family/${name%_ctx128k}_ctx32k" ;;
        esac
        submit "$family/$name" "${prev:+${job[$prev]:-}}"
    done
done
