"""Training-visible cost of checkpoint saves, per checkpoint.async_mode: train.py's own loop and checkpoints.

    python benchmarks/checkpoint_stall.py --out /tmp/ckstall --gpus 1 2 -- model=1.5b attention=full \
        stage=pretrain_8k train.micro_batch=1 train.compile=true
    python benchmarks/checkpoint_stall.py --cpu --gpus 1 --steps 12 --interval 4 --out /tmp/ck -- model=tiny ...

For every GPU count, async mode and writer-thread count it runs `torchrun train.py` (a fresh run directory,
`--steps` steps, a save every `--interval` steps, one log record per step) and reads metrics.jsonl:
- stall_s: median seconds the loop was blocked per save (`checkpoint/stall_s`), write_s: median time until the
  checkpoint was on disk and latest, gib: its size;
- clean_step_s: median step time with no write in flight (after `--warmup` steps), inflight_step_s: mean step
  time while a background write was in flight (the write competes for host, PCIe and disk);
- window_ratio: tokens/s over the window of `--interval` steps that starts with a save (its stall included)
  divided by tokens/s of the same number of clean steps (target: >= 0.95);
- overhead_at_<I>: the share of wall time lost to saving at `checkpoint.interval=I` (default 100):
  (stall + extra time of the in-flight steps) / (I x clean_step_s).
The final save (the loop waits for it) is not counted. Results: <out>/checkpoint_stall.json and a table.
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
MODES = ("none", "async", "async_pinned")


def summarize(records: list[dict], steps: int, interval: int, warmup: int, at_interval: int) -> dict:
    """Figures of one run from its metrics.jsonl records (one training record per step). The first save is
    also reported apart (`first_*`): async_pinned allocates and pins its host buffers then, later saves reuse
    them, so `later_*` (the saves after the first) is what a long run pays per save."""
    train = {r["step"]: r for r in records if "loss" in r}
    saves = {}  # save step -> (record step where it was reported, figures)
    for r in records:
        if "checkpoint/step" in r and r["checkpoint/step"] < steps:
            saves[r["checkpoint/step"]] = (r["step"], r)
    inflight = {}  # save step -> the steps that ran while its write was in flight
    for s, (reported, _) in saves.items():
        inflight[s] = [t for t in range(s + 1, reported + 1) if t in train]
    busy_steps = {t for ts in inflight.values() for t in ts}
    clean = [train[s]["step_time_s"] for s in train if s > warmup and s not in busy_steps and s not in saves]
    if not saves or not clean:
        raise ValueError("no save or no clean step: raise --steps or lower --interval / --warmup")
    clean_s = statistics.median(clean)

    def figures(group: list[int]) -> dict:
        busy = [train[t]["step_time_s"] for s in group for t in inflight[s]]
        windows = []
        for s in group:
            w = [train[t]["step_time_s"] for t in range(s + 1, s + 1 + interval) if t in train]
            if len(w) == interval:
                windows.append(interval * clean_s / (saves[s][1]["checkpoint/stall_s"] + sum(w)))
        extra = statistics.mean(saves[s][1]["checkpoint/stall_s"] for s in group) + sum(
            max(0.0, train[t]["step_time_s"] - clean_s) for s in group for t in inflight[s]) / len(group)
        return {"stall_s": statistics.median(saves[s][1]["checkpoint/stall_s"] for s in group),
                "inflight_step_s": statistics.mean(busy) if busy else clean_s,
                "window_ratio": min(windows) if windows else float("nan"),
                f"overhead_at_{at_interval}": extra / (at_interval * clean_s)}

    order = sorted(saves)
    first = figures(order[:1])
    later = figures(order[1:]) if len(order) > 1 else {k: float("nan") for k in first}
    return {"saves": len(saves), **figures(order),
            "write_s": statistics.median(r["checkpoint/write_s"] for _, r in saves.values()),
            "gib": max(r["checkpoint/gib"] for _, r in saves.values()), "clean_step_s": clean_s,
            **{f"first_{k}": v for k, v in first.items()}, **{f"later_{k}": v for k, v in later.items()}}


def format_table(rows: list[dict], at_interval: int) -> str:
    head = (f"| GPUs | async_mode | writer threads | stall: first save / later saves | write / save | GiB | "
            f"step (clean) | step (write in flight): first / later | window tok/s vs clean: first / later | "
            f"overhead at interval {at_interval}: first / later |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    o = f"overhead_at_{at_interval}"
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['mode']} | {r['threads']} | {r['first_stall_s']:.2f} / "
                     f"{r['later_stall_s']:.2f} s | {r['write_s']:.1f} s | {r['gib']:.1f} | {r['clean_step_s']:.3f} s | "
                     f"{r['first_inflight_step_s']:.3f} / {r['later_inflight_step_s']:.3f} s | "
                     f"{100 * r['first_window_ratio']:.1f}% / {100 * r['later_window_ratio']:.1f}% | "
                     f"{100 * r['first_' + o]:.1f}% / {100 * r['later_' + o]:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--writer-threads", type=int, nargs="+", default=[4])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=10, help="steps between saves in the benchmark runs")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the clean step time")
    ap.add_argument("--at-interval", type=int, default=100, help="checkpoint.interval the overhead is stated for")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="CPU processes over gloo")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = ap.parse_args(argv)
    if args.interval < 1 or args.steps < 2 * args.interval:
        ap.error("--interval must be >= 1 and --steps >= 2 x --interval")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.gpus:
        for mode in args.modes:
            for threads in args.writer_threads:
                name = f"gpus{n}_{mode}_t{threads}"
                run_dir = out / name
                shutil.rmtree(run_dir, ignore_errors=True)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                       str(ROOT / "train.py"), *args.overrides, f"train.steps={args.steps}",
                       f"checkpoint.interval={args.interval}", f"checkpoint.async_mode={mode}",
                       f"checkpoint.writer_threads={threads}", "checkpoint.keep=2", "logging.interval=1",
                       "logging.progress_bar=false", "logging.heatmap_interval=100000", "eval.interval=0",
                       f"run.dir={run_dir}", *(["parallel.device=cpu"] if args.cpu else [])]
                print("$ " + " ".join(cmd[2:]), flush=True)
                env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if args.cpu else {})}
                p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
                (out / f"{name}.log").write_text(p.stdout + p.stderr)
                if p.returncode != 0:
                    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
                    print(f"error: {name} exited {p.returncode} (log: {out / f'{name}.log'}):\n{tail}", file=sys.stderr)
                    return 1
                records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
                rows.append({"gpus": n, "mode": mode, "threads": threads,
                             **summarize(records, args.steps, args.interval, args.warmup, args.at_interval)})
                print(format_table(rows[-1:], args.at_interval).splitlines()[-1], flush=True)
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    result = {"overrides": args.overrides, "steps": args.steps, "interval": args.interval,
              "device": "cpu" if args.cpu else "cuda", "runs": rows}
    (out / "checkpoint_stall.json").write_text(json.dumps(result, indent=1))
    print(format_table(rows, args.at_interval))
    print(f"wrote {out / 'checkpoint_stall.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
