"""Weak scaling of data-parallel training: train.py on 1 and N GPUs back to back, the same work per GPU.

    python benchmarks/weak_scaling.py --gpus 1 2 --micro-batch 1 --accum 2 --steps 16 --out /tmp/ws \\
        -- experiment=scaling/1.5b_full train.compile=true

Each run is `torchrun --standalone --nproc_per_node=n train.py OVERRIDES` with the global batch set to
n x micro-batch x accumulation sequences (so every GPU does the same work in every run), `logging.interval=1`
(`--log-interval K`: K, a record of the mean step time of every K steps; the loop syncs with the GPU only at
logging steps, so K > 1 is what a training run with the default interval does) and no checkpoint
(`checkpoint.enable=false`; with --keep-checkpoints, one at the end); `--numa-binding MODE` is torchrun's (each
rank's threads on the CPUs near its GPU).
`--fixed-routing` holds the weights still (learning rate 1e-12; the optimizer still does all of its work) and
gives LoGo layers no P-mask and quantile thresholds, so every step after the first routes rho of the tokens
globally: the steady state of a long run. Without it a short run's untrained gates move faster than any threshold
rule follows, and its LoGo steps do the global work of whatever ratio the gates happen to give (0.1-0.9 per step).
From each run's metrics.jsonl (step times from CUDA events) it reports, over the second half of the records (compilation and warm-up excluded): tokens/s per GPU (median), the efficiency against
the first GPU count, the step-time spread (min and max against the median), MFU (median) and the peak memory
per GPU (the largest over ranks) and, for LoGo models, the realized global ratio (median over the same records of
the layers' mean). Prints a table and writes <out>/weak_scaling.json.
`--cpu` runs the same on CPU processes over gloo (tests; `parallel.device=cpu`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# every step routes rho: weights held still, no P-mask, thresholds at the last step's (1 - rho) gate quantile
FIXED_ROUTING = ["stage.lr=1e-12", "stage.lr_min=1e-12", "attention.pmask=false", "attention.budget_control=quantile"]


def run_overrides(overrides: list[str], n: int, micro: int, accum: int, seq_len: int, steps: int,
                  run_dir: Path, cpu: bool, keep_checkpoints: bool = False, log_interval: int = 1) -> list[str]:
    # held-out evaluation off unless the overrides turn it on: the benchmark times training steps
    return ["eval.interval=0", *overrides, f"stage.global_batch_tokens={n * micro * accum * seq_len}",
            f"train.micro_batch={micro}", f"train.steps={steps}", f"logging.interval={log_interval}",
            "logging.progress_bar=false",
            f"checkpoint.interval={10**9}", f"checkpoint.enable={str(keep_checkpoints).lower()}",
            "checkpoint.resume=false", f"run.dir={run_dir}",
            *(["parallel.device=cpu", "parallel.backend=gloo"] if cpu else [])]


def summarize(records: list[dict], world: int) -> dict:
    """Figures of one run from its metrics records (the second half of them)."""
    steps = [r for r in records if "step_time_s" in r]
    if len(steps) < 2:
        raise SystemExit(f"error: the run logged {len(steps)} steps with timings; run at least 2 (--steps)")
    half = steps[len(steps) // 2:]
    times = [r["step_time_s"] for r in half]
    med = statistics.median(times)
    out = {"world_size": world, "steps_used": [half[0]["step"], half[-1]["step"]],
           "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s"] / world for r in half),
           "step_time_median_s": med, "step_time_min_vs_median": min(times) / med - 1,
           "step_time_max_vs_median": max(times) / med - 1,
           "peak_memory_gib_per_gpu": max(r["memory_gib"] for r in steps), "loss_last": steps[-1]["loss"]}
    if "mfu" in half[0]:
        out["mfu_median"] = statistics.median(r["mfu"] for r in half)
    if "logo/ratio_mean" in half[0]:
        out["global_ratio_median"] = statistics.median(r["logo/ratio_mean"] for r in half)
    return out


def format_table(rows: list[dict]) -> str:
    head = ("| GPUs | tokens/s per GPU | efficiency | step time (median) | spread min / max | MFU "
            "| peak memory per GPU | global ratio |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{100 * r['mfu_median']:.1f}%" if "mfu_median" in r else "-"
        ratio = f"{r['global_ratio_median']:.3f}" if "global_ratio_median" in r else "-"
        lines.append(f"| {r['world_size']} | {r['tokens_per_s_per_gpu']:,.0f} | {100 * r['efficiency']:.1f}% | "
                     f"{1e3 * r['step_time_median_s']:.1f} ms | {100 * r['step_time_min_vs_median']:+.1f}% / "
                     f"{100 * r['step_time_max_vs_median']:+.1f}% | {mfu} | {r['peak_memory_gib_per_gpu']:.2f} GiB | "
                     f"{ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="GPU (process) counts, the first is the base")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per GPU per step")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="CPU processes over gloo")
    ap.add_argument("--keep-checkpoints", action="store_true", help="save a checkpoint at the end of each run")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--log-interval", type=int, default=1, help="steps per metrics record (logging.interval)")
    ap.add_argument("--fixed-routing", action="store_true",
                    help="weights held still and LoGo thresholds at the gates' quantile: every step routes rho")
    ap.add_argument("--numa-binding", choices=["node", "socket", "exclusive", "core-complex"],
                    help="torchrun's --numa-binding for every run")
    ap.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = ap.parse_args(argv)
    if min(args.gpus) < 1 or args.micro_batch < 1 or args.accum < 1 or args.log_interval < 1:
        ap.error("--gpus, --micro-batch, --accum and --log-interval must be >= 1")
    if args.steps < 2 * args.log_interval:
        ap.error(f"--steps must give at least 2 records of --log-interval={args.log_interval} steps")
    from logo.config import ConfigError
    from logo.run.config import compose
    overrides = [*args.overrides, *(FIXED_ROUTING if args.fixed_routing else [])]
    try:
        seq_len = compose(overrides)[0].stage.seq_len
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.gpus:
        run_dir = out / f"gpus_{n}"
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a fresh run, not a resume of an older one
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               *([f"--numa-binding={args.numa_binding}"] if args.numa_binding else []),
               str(ROOT / "train.py"), *run_overrides(overrides, n, args.micro_batch, args.accum, seq_len,
                                                      args.steps, run_dir, args.cpu, args.keep_checkpoints,
                                                      args.log_interval)]
        print("$ " + " ".join(cmd[2:]), flush=True)
        env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if args.cpu else {})}
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        (out / f"gpus_{n}.log").write_text(p.stdout + p.stderr)
        if p.returncode != 0:
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
            print(f"error: the {n}-GPU run exited {p.returncode} (log: {out / f'gpus_{n}.log'}):\n{tail}",
                  file=sys.stderr)
            return 1
        plan = json.loads((run_dir / "plan.json").read_text())
        if (plan["world_size"], plan["micro_batch"], plan["grad_accum"]) != (n, args.micro_batch, args.accum):
            print(f"error: the {n}-GPU run used micro-batch {plan['micro_batch']} x accumulation "
                  f"{plan['grad_accum']} x {plan['world_size']} ranks, not {args.micro_batch} x {args.accum} x {n}",
                  file=sys.stderr)
            return 1
        records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        rows.append({**summarize(records, n), "run_dir": str(run_dir)})
    base = rows[0]["tokens_per_s_per_gpu"]
    for r in rows:
        r["efficiency"] = r["tokens_per_s_per_gpu"] / base
    result = {"overrides": overrides, "micro_batch": args.micro_batch, "accum": args.accum,
              "seq_len": seq_len, "steps": args.steps, "log_interval": args.log_interval,
              "numa_binding": args.numa_binding, "device": "cpu" if args.cpu else "cuda", "runs": rows}
    (out / "weak_scaling.json").write_text(json.dumps(result, indent=1))
    print(format_table(rows))
    print(f"wrote {out / 'weak_scaling.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
