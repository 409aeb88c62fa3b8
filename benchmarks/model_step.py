"""Whole-model training step of every attention kind, same settings, one GPU, one run.

    python benchmarks/model_step.py --out /tmp/model_step.json
    python benchmarks/model_step.py --shapes 1.5b-8k --compile on --out /tmp/model_step_compiled.json
    python benchmarks/model_step.py --shapes tiny --kinds full,logo --steps 2 --warmup 0 --out /tmp/s.json  # CPU
    python benchmarks/model_step.py --shapes 1.5b-8k --kinds logo --backends triton

Shapes (`--shapes`): 1.5b-8k (1.5B, 1 x 8192 tokens), 1.5b-32k (1.5B, 1 x 32768 tokens, activation
checkpointing on), 1.5b-128k (1.5B, 1 x 131072 tokens, activation checkpointing on: the `ctx_128k` stage's
sequence as one document on one GPU), small (dim 256, 8 layers, 4 heads, vocab 512, 32 x 1024 tokens), tiny (CPU
smoke test).
Kinds (`--kinds`): full, local, inter_layer, intra_layer, logo (the conf/attention presets; LoGo without
P-mask and with `attention.budget_control=quantile`: each threshold follows the (1 - rho) quantile of the last
step's gate values, so after the warm-up steps about rho = 0.5 of the rows go global, whatever the untrained
gate's offset; the realized ratio is reported). The learning rate is 0 (the fused AdamW step still does all
its work): with the weights moving, untrained gates shift between steps faster than the quantile of the last
step follows; with them fixed every step after the first routes rho.

Every (shape, kind) runs in a fresh subprocess, so the peak memory is that run's own; a CUDA out-of-memory is
reported as "oom", a crash as "crash". Each run builds its model and step from the project's own code:
`logo.run.config.compose` (the train.py config), the meta-device `Transformer`, `logo.parallel.parallelize`
(train.compile, activation checkpointing), fused AdamW and `logo.train.step.train_step` / `optimizer_step` with
train.loss, bf16 autocast on GPU. Data: random tokens, every row one document.
Python's automatic garbage collection is off during the steps and generations 0-1 are collected every
`train.gc_interval` steps, as in the trainer (`--set train.gc_interval=0` keeps automatic GC).
Per run: ms/step (median over --steps steps after --warmup steps, host-synchronised), tokens/s, MFU
(`logo.model.flops.mfu`, the trainer's formula: 6 x (non-embedding + LM-head parameters) + attention FLOPs by
kind, the realized ratio of the LoGo layers, over the GPU's dense bf16 peak) and the peak allocated memory.
Writes the JSON to --out and prints one markdown table per shape. `--repeats R` runs R rounds of every kind
(each run a fresh process; rows carry their round as "repeat"): the table then shows the median and range of
ms/step and the median of each round's ratio to full attention (the small shape's step under CUDA graphs varies
between processes of the same code, so compare rounds).
`--profile N` times N more steps under torch.profiler (back to back, no sync between them) and adds per step: GPU
busy time, the top kernels and host ops, the GPU's idle time and its largest idle gaps by the kernels on either side
(where a host-bound stretch makes the GPU wait), each split into the part before the host's launch call of the next
kernel returned (host-bound) and the rest. `--host-timing` adds, without a profiler, the medians of the host's issue
time of the forward and of the whole step against the GPU's finish times (is the step host-paced?).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KINDS = ("full", "local", "inter_layer", "intra_layer", "logo")
SHAPES = {  # name: (train.py overrides, seq_len, sequences per step, activation checkpointing by default)
    "1.5b-8k": (["model=1.5b"], 8192, 1, False),
    "1.5b-32k": (["model=1.5b"], 32768, 1, True),
    "1.5b-128k": (["model=1.5b"], 131072, 1, True),
    "small": (["model=small", "model.n_layers=8", "model.vocab_size=512"], 1024, 32, False),
    "tiny": (["model=tiny", "model.n_layers=2", "model.vocab_size=512", "attention.window=16"], 64, 2, False),
}
DEFAULT_SHAPES = ("1.5b-8k", "1.5b-32k", "small")


def overrides(shape: str, kind: str, compile_: bool, ac: bool, loss: str, extra_overrides=()) -> list[str]:
    extra, T, B, _ = SHAPES[shape]
    out = [*extra, f"attention={kind}", f"stage.seq_len={T}", f"stage.global_batch_tokens={T * B}",
           f"train.micro_batch={B}", "train.steps=1", f"train.compile={str(compile_).lower()}",
           f"train.activation_checkpointing={str(ac).lower()}", f"train.loss={loss}"]
    if kind == "logo":  # no P-mask; thresholds at the gate's (1 - rho) quantile of the last step: ratio ~ rho
        out += ["attention.pmask=false", "attention.budget_control=quantile"]
    return out + list(extra_overrides)


def measure(shape: str, kind: str, compile_: bool, ac: bool, loss: str, warmup: int, steps: int,
            extra_overrides=(), profile_steps: int = 0, host_timing: bool = False) -> dict:
    """One (shape, kind) run in this process -> its figures (raises on failure)."""
    import torch

    from data.loader import Batch, StepData
    from logo.model import BudgetController, Transformer
    from logo.model.flops import mfu, param_counts, peak_bf16_flops, realized_ratios
    from logo.model.lm_head import resolve_loss_impl
    from logo.parallel import parallelize
    from logo.run.config import compose
    from logo.train.step import DivergenceMonitor, make_optimizer, optimizer_step, train_step

    cfg, _, _ = compose(overrides(shape, kind, compile_, ac, loss, extra_overrides))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    T, B = cfg.stage.seq_len, cfg.train.micro_batch
    loss_impl = resolve_loss_impl(cfg.train.loss, device, B * T * cfg.model.padded_vocab_size)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    total, non_emb = param_counts(model)
    model.to_empty(device=device)
    model.init_weights()
    parallelize(model, None, torch.bfloat16 if cuda else torch.float32, ac, compile_,
                compile_mode=cfg.train.compile_mode)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    # lr 0: AdamW does all of its work but the weights stay put, so every step routes the same rows (training
    # moved the untrained gates faster than any threshold rule follows: realized ratios of 0.1-0.9 per step).
    opt = make_optimizer(model, 0.0, (0.9, 0.95), 1e-8, 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ctrl, monitor = BudgetController(model), DivergenceMonitor(device)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g)
    data = StepData([Batch(tok[:, :-1], tok[:, 1:], None, torch.ones(B, T, dtype=torch.bool))], B * T)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    def step(i: int):
        out = train_step(model, data, device=device, autocast=autocast, ctrl=ctrl, grad_clip=1.0, world=1,
                         data_parallel=False, loss_impl=loss_impl)
        optimizer_step(opt, sched, ctrl, out, monitor, i + 1)
        return out

    timing = HostTiming(model, cuda) if host_timing else None
    times = []
    gc_interval = cfg.train.gc_interval
    if gc_interval:  # as the trainer does: no automatic GC pauses inside steps, generations 0-1 every interval
        gc.collect()
        gc.disable()
    try:
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            if timing:
                timing.start()
            out = step(i)
            if timing:
                timing.issued()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                if timing:
                    timing.record()
            if gc_interval and (i + 1) % gc_interval == 0:
                gc.collect(1)
        kernels = profile_kernels(lambda i: step(warmup + steps + i), profile_steps) if profile_steps else None
    finally:
        gc.enable()
    step_s = statistics.median(times)
    tokens_per_s = B * T / step_s
    ratios = realized_ratios(ctrl.metrics())
    peak = peak_bf16_flops(torch.cuda.get_device_name()) if cuda else None
    return {
        "status": "ok", "ms_per_step": 1e3 * step_s, "ms_min": 1e3 * min(times), "ms_max": 1e3 * max(times),
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(cfg.model, T, non_emb, tokens_per_s, peak, ratios) if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "loss": float(out.loss), "realized_ratio": (sum(ratios.values()) / len(ratios)) if ratios else None,
        "params_total": total, "params_non_embedding": non_emb, "seq_len": T, "sequences": B,
        "loss_impl": loss_impl, **({"profile": kernels} if kernels else {}),
        **({"host_timing": timing.summary()} if timing else {}),
    }


class HostTiming:
    """--host-timing: per measured step, when the host has issued the forward (the model's forward returned: the
    loss is computed inside it) and the whole step, against when the GPU finished each (CUDA events), without a
    profiler. A forward whose host issue time is close to its GPU time is host-paced: the GPU waits wherever the
    host's per-layer work runs longer than the layer's kernels."""

    def __init__(self, model, cuda: bool):
        import torch
        self.torch, self.cuda, self.rows, self.host, self.events = torch, cuda, [], {}, {}
        model.register_forward_hook(lambda *_: self._mark("fwd"))

    def _mark(self, name: str):
        self.host[name] = time.perf_counter()
        if self.cuda:
            self.events[name] = self.torch.cuda.Event(enable_timing=True)
            self.events[name].record()

    def start(self):
        self.host, self.events = {}, {}
        self._mark("start")

    def issued(self):
        self._mark("step")

    def record(self):
        """After the step's sync: its host-issue and GPU-finish times, ms from the step's start."""
        row = {f"host_{k}_ms": 1e3 * (self.host[k] - self.host["start"]) for k in ("fwd", "step") if k in self.host}
        if self.cuda:
            row |= {f"gpu_{k}_ms": self.events["start"].elapsed_time(self.events[k]) for k in ("fwd", "step")
                    if k in self.events}
        self.rows.append(row)

    def summary(self) -> dict:
        """The median of each figure over the measured steps."""
        return {k: round(statistics.median(r[k] for r in self.rows), 3) for k in self.rows[0]} if self.rows else {}


def profile_kernels(step, n: int, top: int = 40) -> dict:
    """n more steps under torch.profiler -> GPU kernel time per step (busy), the host-measured step time under
    the profiler, the `top` kernels by time per step (name, ms, calls per step; none on CPU) and the `top` host
    ops by self time (where a launch-bound step spends its host time)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    torch.cuda.synchronize() if cuda else None
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(n):
            step(i)
        torch.cuda.synchronize() if cuda else None
        wall = (time.perf_counter() - t0) / n
    rows = []
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA or e.key.startswith(("logo/", "Optimizer.", "ProfilerStep")):
            continue  # kernels only (record_function ranges show on the GPU as spans, idle time included)
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        rows.append((e.key, us / 1e3 / n, e.count / n))
    rows.sort(key=lambda r: -r[1])
    host = sorted(((e.key, e.self_cpu_time_total / 1e3 / n, e.count / n) for e in prof.key_averages()
                   if e.device_type == DeviceType.CPU), key=lambda r: -r[1])
    return {"steps": n, "wall_ms_per_step": 1e3 * wall, "gpu_busy_ms_per_step": sum(r[1] for r in rows),
            "top_kernels": [{"name": k[:160], "ms": round(ms, 3), "calls": c} for k, ms, c in rows[:top]],
            "top_host_ops": [{"name": k[:160], "self_ms": round(ms, 3), "calls": c} for k, ms, c in host[:top]],
            **(idle_gaps(prof, n, top // 2) if cuda else {})}


def idle_gaps(prof, n: int, top: int) -> dict:
    """Where the GPU waits between the profiled steps' kernels: the idle time per step (gaps between consecutive
    kernels, copies and memsets on the GPU timeline) and the `top` (kernel before, kernel after) pairs by the idle
    time between them (a host-bound stretch shows as many short gaps before the same kernels). Each gap is split by
    when the host's launch call of the kernel after it returned: the part before that is host-bound (the GPU had
    run out of queued work), the rest queued (the kernel was issued in time: launch latency on the GPU, or a wait
    on something else). The profiler's own per-launch host time inflates the host-bound part."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    issued = {e["args"]["correlation"]: e["ts"] + e.get("dur", 0) for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "?"), e.get("args", {}).get("correlation"))
                 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e)
    pairs: dict = {}
    total = host_bound = 0.0
    end = gpu[0][1] if gpu else 0.0
    prev = gpu[0][2] if gpu else ""
    for start, stop, name, corr in gpu[1:]:
        gap = start - end
        if gap > 0:
            waited = min(max(issued.get(corr, end) - end, 0.0), gap)  # idle before the host had issued it
            total += gap
            host_bound += waited
            key = (prev[:60], name[:60])
            t, h, c = pairs.get(key, (0.0, 0.0, 0))
            pairs[key] = (t + gap, h + waited, c + 1)
        if stop >= end:
            end, prev = stop, name
    worst = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gpu_idle_ms_per_step": total / 1e3 / n, "gpu_idle_host_bound_ms_per_step": host_bound / 1e3 / n,
            "idle_gaps": [{"before": a, "after": b, "ms": round(t / 1e3 / n, 4),
                           "host_bound_ms": round(h / 1e3 / n, 4), "gaps": c / n} for (a, b), (t, h, c) in worst]}


def worker(args) -> None:
    """--worker: one run; writes {"status": ok | oom | error, ...} to --result."""
    import torch
    try:
        res = measure(args.shape, args.kind, args.compile == "on", args.ac == "on", args.loss, args.warmup,
                      args.steps, args.set, args.profile, args.host_timing)
    except torch.OutOfMemoryError as e:
        res = {"status": "oom", "error": str(e).splitlines()[0]}
    except Exception as e:  # noqa: BLE001 - reported in the table, the other runs go on
        res = {"status": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
               "traceback": traceback.format_exc()[-4000:]}
    Path(args.result).write_text(json.dumps(res))


def run_one(shape: str, kind: str, compile_: str, ac: str, args, backend: str = "auto") -> dict:
    """One (shape, kind) in a fresh subprocess with attention.backend=backend; a run that dies without a result is
    a crash."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--shape", shape, "--kind", kind,
               "--compile", compile_, "--ac", ac, "--loss", args.loss, "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--profile", str(args.profile), "--result", str(result),
               *(["--host-timing"] if args.host_timing else []),
               *(f"--set={o}" for o in args.set), f"--set=attention.backend={backend}"]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"no result after {args.timeout} s"}
        if result.exists():
            return json.loads(result.read_text())
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"status": "crash", "error": f"exit {p.returncode}: " + " | ".join(tail),
                "traceback": (p.stderr or p.stdout)[-4000:]}


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (kind, compile), in first-seen order, over its repeats: the runs, the ok ones, the median
    run (ms/step closest to the median) and `vs_full`, the median over repeats of ms/step divided by the same
    repeat's full-attention run with the same compile setting (a paired ratio: runs of one round are neighbours
    in time, so the ratio cancels what drifts between rounds)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["kind"], r["compile"], r.get("backend", "auto")), []).append(r)
    full_ms = {(r["compile"], r.get("backend", "auto"), r.get("repeat", 0)): r["ms_per_step"] for r in rows
               if r["kind"] == "full" and r["status"] == "ok"}
    out = []
    for (kind, comp, backend), runs in groups.items():
        ok = [r for r in runs if r["status"] == "ok"]
        entry = {"kind": kind, "compile": comp, "backend": backend, "runs": runs, "ok": ok, "median_run": None,
                 "vs_full": None}
        if ok:
            mid = statistics.median(r["ms_per_step"] for r in ok)
            entry["median_run"] = min(ok, key=lambda r: abs(r["ms_per_step"] - mid))
            entry["ms_median"] = mid
            ratios = [r["ms_per_step"] / full_ms[(comp, backend, r.get("repeat", 0))] for r in ok
                      if (comp, backend, r.get("repeat", 0)) in full_ms]
            entry["vs_full"] = statistics.median(ratios) if ratios else None
        out.append(entry)
    return out


def table(rows: list[dict], shape: str) -> str:
    """Markdown table of one shape's runs; the last column is the step time relative to full attention with the
    same compile setting and attention backend. With --repeats, ms/step is the median over the repeats (range and
    count beside it), the other columns are the median run's, and "vs full" is the median of the per-repeat ratios."""
    lines = [f"### {shape}", "", "| kind | compile | backend | ms/step | tokens/s | MFU | peak GiB | ratio | vs full |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in summarize(rows):
        if not e["ok"]:
            r = e["runs"][0]
            lines.append(f"| {r['kind']} | {r['compile']} | {e['backend']} | **{r['status'].upper()}** | "
                         f"{r.get('error', '')[:80]} | | | | |")
            continue
        r = e["median_run"]
        ms = f"{e['ms_median']:.1f}"
        if len(e["runs"]) > 1:
            lo, hi = min(x["ms_per_step"] for x in e["ok"]), max(x["ms_per_step"] for x in e["ok"])
            ms += f" ({lo:.1f}-{hi:.1f}, {len(e['ok'])}/{len(e['runs'])} runs)"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        ratio = f"{r['realized_ratio']:.3f}" if r["realized_ratio"] is not None else "-"
        vs = f"{e['vs_full']:.2f}x" if e["vs_full"] is not None else "-"
        lines.append(f"| {r['kind']} | {r['compile']} | {e['backend']} | {ms} | {r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{mem} | {ratio} | {vs} |")
    return "\n".join(lines)


def device_info() -> dict:
    import torch
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None, "host": platform.node()}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/model_step.json", help="JSON results path")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {list(KINDS)}")
    ap.add_argument("--compile", default="off", choices=["off", "on", "both"], help="train.compile (both: each)")
    ap.add_argument("--ac", default="auto", choices=["auto", "on", "off"],
                    help="activation checkpointing; auto: the shape's default (on for 1.5b-32k and 1.5b-128k)")
    ap.add_argument("--loss", default="auto", choices=["auto", "liger", "chunked", "plain"], help="train.loss")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="measured steps (the median is reported)")
    ap.add_argument("--repeats", type=int, default=1, metavar="R",
                    help="R rounds of every kind, each run in a fresh process: the table shows the median and range "
                         "of ms/step and the median of the per-round ratios to full attention (for noisy shapes)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="N more steps under torch.profiler: GPU busy and idle time, the top kernels and host ops "
                         "and the largest idle gaps (by the kernels before and after) per step in the JSON")
    ap.add_argument("--host-timing", action="store_true",
                    help="per run: the medians of the host's issue time of the forward and of the step against the "
                         "GPU's finish times (CUDA events; no profiler) in the JSON and a table (is the step "
                         "host-paced?)")
    ap.add_argument("--backends", default="auto",
                    help="comma list of attention.backend values to run each (shape, kind) with (auto, flash, triton)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per (shape, kind) run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a train.py override for every run (repeatable), e.g. train.loss=liger")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.worker:
        for name, allowed in (("shapes", SHAPES), ("kinds", KINDS)):
            bad = [x for x in getattr(args, name).split(",") if x not in allowed]
            if bad:
                ap.error(f"--{name}: unknown {bad}; choose from {list(allowed)}")
        if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
            ap.error("--steps and --repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    shapes, kinds = args.shapes.split(","), args.kinds.split(",")
    compiles = ["off", "on"] if args.compile == "both" else [args.compile]
    info = device_info()
    print(f"# model_step on {info['device']} (torch {info['torch']}), loss={args.loss}, warmup {args.warmup}, "
          f"steps {args.steps}", flush=True)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("compile", "ac", "loss", "warmup", "steps", "set", "repeats",
                                              "host_timing", "backends")}
    for shape in shapes:
        ac = ("on" if SHAPES[shape][3] else "off") if args.ac == "auto" else args.ac
        for comp in compiles:
            for rep in range(args.repeats):  # rounds of every kind, so each round's runs are neighbours in time
                for kind, backend in ((k, b) for k in kinds for b in args.backends.split(",")):
                    t0 = time.time()
                    r = {"shape": shape, "kind": kind, "compile": comp, "ac": ac, "backend": backend, "repeat": rep,
                         **run_one(shape, kind, comp, ac, args, backend), "wall_s": None}
                    r["wall_s"] = round(time.time() - t0, 1)
                    rows.append(r)
                    figure = f"{r['ms_per_step']:.1f} ms/step" if r["status"] == "ok" else r["status"]
                    print(f"  {shape} {kind} compile={comp} ac={ac} backend={backend} repeat {rep}: {figure} "
                          f"({r['wall_s']} s)", flush=True)
                    if r.get("host_timing"):
                        print("    ms from the step's start: " + ", ".join(
                            f"{k[:-3].replace('_', ' ')} {v:.1f}" for k, v in r["host_timing"].items()), flush=True)
                    out.write_text(json.dumps({**info, "settings": settings, "results": rows}, indent=1))
        print("\n" + table([r for r in rows if r["shape"] == shape], shape) + "\n", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
