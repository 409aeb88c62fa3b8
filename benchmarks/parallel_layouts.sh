#!/usr/bin/env bash
# 1.5B at T=32768 on 2 GPUs: cp=2, tp=2 and dp=2 against one GPU, the same global batch (2 sequences) and
# steps; prints tokens/s, peak memory and per-step losses of each (docs/training.md "Parallelism").
# Usage: bash benchmarks/parallel_layouts.sh [attention] [extra overrides...]   (default attention: logo)
set -euo pipefail
cd "$(dirname "$0")/.."
ATTN=${1:-logo}; shift || true
OUT=${OUT:-/tmp/parallel_layouts}
COMMON=(model=1.5b attention="$ATTN" stage.seq_len=32768 stage.global_batch_tokens=65536 train.micro_batch=1
        train.steps=8 train.activation_checkpointing=true attention.gamma=0.01 logging.interval=1
        logging.progress_bar=false eval.interval=0 checkpoint.interval=100000 "$@")
run() {  # name nproc overrides...
  local name=$1 n=$2; shift 2
  rm -rf "$OUT/$name"
  if [ "$n" = 1 ]; then python train.py "${COMMON[@]}" "$@" run.dir="$OUT/$name" > "$OUT/$name.log" 2>&1
  else torchrun --standalone --nproc_per_node="$n" train.py "${COMMON[@]}" "$@" run.dir="$OUT/$name" > "$OUT/$name.log" 2>&1; fi \
    || { echo "$name failed: see $OUT/$name.log"; tail -20 "$OUT/$name.log"; }
}
mkdir -p "$OUT"
run one_gpu 1
run cp2 2 parallel.cp=2
run tp2 2 parallel.tp=2
run dp2 2
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for name in ("one_gpu", "cp2", "tp2", "dp2"):
    f = out / name / "metrics.jsonl"
    rows[name] = [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.exists() else []
print(f"{'layout':8} {'tokens/s (steps 3+)':>20} {'peak GiB':>9}  losses")
for name, r in rows.items():
    if not r:
        print(f"{name:8} (no metrics)"); continue
    tps = [x["tokens_per_s"] for x in r[2:]] or [r[-1]["tokens_per_s"]]
    print(f"{name:8} {sum(tps) / len(tps):20.0f} {max(x['memory_gib'] for x in r):9.1f}  "
          + " ".join(f"{x['loss']:.4f}" for x in r))
PY
