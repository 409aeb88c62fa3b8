"""train.py's full-attention step against torchtitan's own Llama3 recipe on the same shape, one GPU, one run.

    python benchmarks/trainer_anchor.py --anchor PATH/torchtitan_llama3.py [--seq 8192] [--steps 12] [--out F]

The anchor is torchtitan 0.2.2's Llama3 recipe (`torchtitan_llama3.py`, kept outside this repository; its docstring
says what it builds) on logo's 1.5B shape with micro-batch 1 and 2 accumulation steps; train.py runs
`model=1.5b attention=full` with the same tokens per step (stage.global_batch_tokens = 2 x seq, micro-batch 1),
train.compile=true, on the embedded corpus. Both report tokens/s as the median over the second half of the steps
(torchtitan: its printed figure; train.py: the per-step `tokens_per_s` of metrics.jsonl) and the peak allocated
memory. Prints both and their ratios; writes them to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_anchor(anchor: Path, seq: int, steps: int, timeout: int) -> dict:
    env = {**os.environ, "MB": "1", "ACC": "2", "SEQ": str(seq), "STEPS": str(steps), "AC": "none"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                        str(anchor)], env=env, capture_output=True, text=True, timeout=timeout)
    m = re.search(r"tok/s=(\d+).*mem=([\d.]+)GiB", p.stdout)
    if p.returncode or not m:
        raise RuntimeError(f"torchtitan anchor failed (exit {p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
    return {"tokens_per_s": float(m.group(1)), "peak_gib": float(m.group(2)), "last_line": m.group(0)}


def run_train(seq: int, steps: int, timeout: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "train.py"), "model=1.5b", "attention=full", "stage=pretrain_8k",
               f"stage.seq_len={seq}", f"stage.global_batch_tokens={2 * seq}", "train.micro_batch=1",
               "train.compile=true", f"train.steps={steps}", "logging.interval=1", "logging.progress_bar=false",
               "eval.interval=0", "checkpoint.interval=1000000", f"run.dir={tmp}/run", *extra]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "WANDB_MODE": "disabled"})
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        rows = [r for r in rows if "tokens_per_s" in r]
        if p.returncode or len(rows) < 2:
            raise RuntimeError(f"train.py failed (exit {p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
        late = rows[len(rows) // 2:]
        plan = json.loads((Path(tmp) / "run" / "plan.json").read_text())
        return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in late),
                "peak_gib": max(r["memory_gib"] for r in rows), "attention_kernels": plan.get("attention_kernels")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchor", required=True, help="path of torchtitan_llama3.py")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a train.py override")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    anchor = Path(a.anchor)
    if not anchor.is_file():
        ap.error(f"--anchor {anchor}: no such file")
    titan = run_anchor(anchor, a.seq, a.steps, a.timeout)
    ours = run_train(a.seq, a.steps, a.timeout, a.set)
    res = {"seq": a.seq, "steps": a.steps, "torchtitan": titan, "train_py": ours,
           "tokens_per_s_ratio": ours["tokens_per_s"] / titan["tokens_per_s"],
           "memory_ratio": ours["peak_gib"] / titan["peak_gib"]}
    print(f"torchtitan recipe: {titan['tokens_per_s']:,.0f} tok/s, {titan['peak_gib']:.1f} GiB | train.py "
          f"({ours['attention_kernels']}): {ours['tokens_per_s']:,.0f} tok/s, {ours['peak_gib']:.1f} GiB | "
          f"tokens/s {res['tokens_per_s_ratio']:.3f}x, memory {res['memory_ratio']:.3f}x", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
