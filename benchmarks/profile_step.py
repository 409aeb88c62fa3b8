"""Where a training step's time goes: train.py's own loop under torch.profiler, and a step breakdown.

    python benchmarks/profile_step.py --out /tmp/prof -- experiment=scaling/1.5b_full train.compile=true
    torchrun --standalone --nproc_per_node=2 benchmarks/profile_step.py --out /tmp/prof -- <same overrides>

Everything after `--` is a train.py override (any preset, attention kind, batch split). The script runs
`logo.train.trainer.train` itself (the same loop, data, FSDP, logging as train.py, no final checkpoint), skips
`--warmup` steps (compilation, allocator warm-up), then records `--steps` steps; `--fixed-routing` makes every
LoGo step route rho (`weak_scaling.py`: a short run's untrained gates otherwise give any ratio). Per rank it writes
`trace_rank<r>.json` (chrome://tracing / perfetto) and `summary_rank<r>.json`; rank 0 prints its breakdown.

The breakdown divides each instant of the recorded steps into one bucket, so the rows add up to the step time:
- GPU: `compute <phase>` when a non-NCCL kernel or copy runs (its phase = the `logo/<phase>` range of
  logo/train/step.py and trainer.py open on the host when it was launched: forward, backward, clip,
  optimizer, controller, h2d, ...); else `exposed <collective>` when only NCCL kernels run (all-gather,
  reduce-scatter, all-reduce not hidden under compute); else `GPU idle, host in <phase>` (the host was busy
  elsewhere: data, log/sync, checkpoint, Python between the phases = `between`).
- CPU (no GPU; the summary says "cpu"): `comm <collective>` while a gloo collective runs on the host, else
  `host <phase>`.
Host syncs (cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize / synchronous cudaMemcpy,
e.g. `.item()`, `float(t)`, a blocking copy) are counted with the time the host waited and the phase they
happened in.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def collective_kind(name: str):
    """all_gather / reduce_scatter / all_reduce / other_collective for an NCCL kernel or c10d/gloo op name."""
    n = name.lower().replace("_", "")
    if not ("nccl" in n or "c10d" in n or "gloo" in n):
        return None
    for kind, keys in (("all_gather", ("allgather",)), ("reduce_scatter", ("reducescatter",)),
                       ("all_reduce", ("allreduce",)), ("broadcast", ("broadcast",))):
        if any(k in n for k in keys):
            return kind
    return "other_collective"


def host_segments(annotations: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Non-overlapping (start, end, innermost phase) from properly nested (start, end, phase) ranges."""
    events = sorted([(s, 1, -(e - s), p) for s, e, p in annotations] + [(e, 0, 0, p) for s, e, p in annotations])
    out, stack, t_prev = [], [], None
    for t, is_start, _, p in events:
        if stack and t_prev is not None and t > t_prev:
            out.append((t_prev, t, stack[-1]))
        if is_start:
            stack.append(p)
        elif p in stack:
            stack.reverse()
            stack.remove(p)  # the innermost open range of that name
            stack.reverse()
        t_prev = t
    return out


def sweep(window: tuple[float, float], compute: list, comm: list, host: list, gpu: bool) -> dict[str, float]:
    """Microseconds per bucket over the window (see the module docstring for the buckets)."""
    lo, hi = window
    bounds = {lo, hi}
    marks = []
    for layer, ivs in (("compute", compute), ("comm", comm)):
        for s, e, label in ivs:
            s, e = max(s, lo), min(e, hi)
            if e > s:
                marks += [(s, 1, layer, label), (e, -1, layer, label)]
                bounds |= {s, e}
    for s, e, _ in host:
        for t in (s, e):
            if lo < t < hi:
                bounds.add(t)
    marks.sort(key=lambda m: m[0])
    host = sorted(host)
    active = {"compute": defaultdict(int), "comm": defaultdict(int)}
    out: dict[str, float] = defaultdict(float)
    points = sorted(bounds)
    mi = hi_i = 0
    for a, b in zip(points, points[1:]):
        while mi < len(marks) and marks[mi][0] <= a:
            _, d, layer, label = marks[mi]
            active[layer][label] += d
            mi += 1
        while hi_i < len(host) and host[hi_i][1] <= a:
            hi_i += 1
        hp = host[hi_i][2] if hi_i < len(host) and host[hi_i][0] <= a < host[hi_i][1] else "between"
        busy = [k for k, v in active["compute"].items() if v > 0]
        talk = [k for k, v in active["comm"].items() if v > 0]
        if gpu:
            key = (f"compute {min(busy, key=_phase_rank)}" if busy else
                   f"exposed {sorted(talk)[0]}" if talk else f"GPU idle, host in {hp}")
        else:
            key = f"comm {sorted(talk)[0]}" if talk else f"host {hp}"
        out[key] += b - a
    return dict(out)


PHASE_ORDER = ["forward", "backward", "clip", "optimizer", "controller", "h2d", "data", "stop_check", "sync", "log",
               "checkpoint", "gc", "between"]  # which phase an instant counts for when kernels of several overlap


def _phase_rank(phase: str) -> int:
    return PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)


def analyze(trace: dict, steps: int, device: str, world: int, rank: int) -> dict:
    """The step breakdown of a Kineto chrome trace of `steps` recorded training steps."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    step_ranges = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "user_annotation"
                   and e["name"].startswith("ProfilerStep#")]
    if not step_ranges:
        raise SystemExit("error: the trace has no ProfilerStep ranges (did the recorded steps run?)")
    window = (min(s for s, _ in step_ranges), max(e for _, e in step_ranges))
    n_steps = len(step_ranges)
    ann = [(e["ts"], e["ts"] + e["dur"], e["name"][5:]) for e in ev
           if e.get("cat") == "user_annotation" and e["name"].startswith("logo/")]
    host = host_segments(ann)
    phase_at = _phase_lookup(host)

    gpu = any(e.get("cat") in GPU_CATS for e in ev)
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in ev
                 if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    compute, comm, comm_total = [], [], defaultdict(float)
    if gpu:
        for e in ev:
            if e.get("cat") not in GPU_CATS:
                continue
            s, t = e["ts"], e["ts"] + e["dur"]
            kind = collective_kind(e["name"])
            if kind:
                comm.append((s, t, kind))
                comm_total[kind] += max(0.0, min(t, window[1]) - max(s, window[0]))
            else:
                corr = e.get("args", {}).get("correlation")
                compute.append((s, t, phase_at(launch_ts.get(corr, s))))
    else:  # CPU: collectives block the host; count the outermost c10d/gloo op of each call
        ops = sorted((e["ts"], e["ts"] + e["dur"], collective_kind(e["name"])) for e in ev
                     if e.get("cat") == "cpu_op" and collective_kind(e["name"]))
        end = -1.0
        for s, t, kind in ops:
            if s >= end:
                comm.append((s, t, kind))
                comm_total[kind] += t - s
                end = t
    buckets = sweep(window, compute, comm, host, gpu)

    syncs = defaultdict(lambda: [0, 0.0])
    for e in ev:
        if e.get("cat") in LAUNCH_CATS and e["name"] in SYNC_CALLS and window[0] <= e["ts"] <= window[1]:
            rec = syncs[phase_at(e["ts"])]
            rec[0] += 1
            rec[1] += e["dur"]
    per = 1e3 * n_steps  # us over all steps -> ms per step
    step_ms = (window[1] - window[0]) / per
    exposed = sum(v for k, v in buckets.items() if k.startswith("exposed "))
    total_comm = sum(comm_total.values())
    return {
        "device": device, "world_size": world, "rank": rank, "steps": n_steps, "step_ms": step_ms,
        "breakdown_ms": {k: v / per for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])},
        "communication_ms": {k: v / per for k, v in comm_total.items()},
        "communication_hidden_fraction": (1 - exposed / total_comm) if gpu and total_comm else None,
        "host_syncs": {"per_step": sum(c for c, _ in syncs.values()) / n_steps,
                       "wait_ms": sum(t for _, t in syncs.values()) / per,
                       "by_phase": {p: {"per_step": c / n_steps, "wait_ms": t / per} for p, (c, t) in syncs.items()}},
        "host_phase_ms": _host_phase_ms(host, window, per),
        "top_kernels_ms": _top_kernels(ev, window, per),
        "host_threads": _host_threads(ev, window, per),
    }


def _host_threads(ev, window, per) -> dict:
    """Per host thread (by its most frequent top-level op's name, then thread id): ms per step inside its
    top-level torch ops, CUDA API calls per step and their mean duration in us. Two ranks that launch the same
    work with different host times show here whether each launch is slower (a contended core, another thread
    holding the GIL) or there are more of them."""
    ops, calls = defaultdict(list), defaultdict(list)
    for e in ev:
        if not window[0] <= e["ts"] <= window[1]:
            continue
        if e.get("cat") == "cpu_op":
            ops[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e.get("cat") in LAUNCH_CATS:
            calls[e.get("tid")].append(e["dur"])
    out = {}
    for tid in set(ops) | set(calls):
        busy, end, names = 0.0, -1.0, defaultdict(float)
        for s, t, name in sorted(ops.get(tid, [])):
            if s >= end:  # a top-level op of this thread
                busy += t - s
                names[name] += t - s
                end = t
        durations = calls.get(tid, [])
        top = max(names, key=names.get) if names else "cuda api only"
        out[f"{top[:60]} (tid {tid})"] = {
            "op_ms": busy / per, "api_calls": len(durations) * 1e3 / per,
            "api_mean_us": sum(durations) / len(durations) if durations else 0.0}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["op_ms"] - kv[1]["api_calls"] * 1e-3)[:6])


def _top_kernels(ev, window, per, n: int = 25) -> dict:
    """The n GPU kernels (by name, first 90 characters) with the most time per step inside the window."""
    tot, count = defaultdict(float), defaultdict(int)
    for e in ev:
        if e.get("cat") == "kernel" and window[0] <= e["ts"] <= window[1]:
            name = e["name"][:90]
            tot[name] += e["dur"]
            count[name] += 1
    top = sorted(tot.items(), key=lambda kv: -kv[1])[:n]
    return {k: {"ms": v / per, "calls": count[k] * 1e3 / per} for k, v in top}


def _phase_lookup(host):
    starts = [s for s, _, _ in host]

    def phase_at(t: float) -> str:
        import bisect
        i = bisect.bisect_right(starts, t) - 1
        return host[i][2] if i >= 0 and host[i][0] <= t < host[i][1] else "between"
    return phase_at


def _host_phase_ms(host, window, per) -> dict:
    out = defaultdict(float)
    for s, e, p in host:
        s, e = max(s, window[0]), min(e, window[1])
        if e > s:
            out[p] += e - s
    covered = sum(out.values())
    out["between"] = (window[1] - window[0]) - covered
    return {k: v / per for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def format_summary(s: dict) -> str:
    lines = [f"step breakdown: {s['device']}, rank {s['rank']} of {s['world_size']}, {s['steps']} steps, "
             f"{s['step_ms']:.1f} ms per step"]
    for k, v in s["breakdown_ms"].items():
        lines.append(f"  {k:<34} {v:9.2f} ms  {100 * v / s['step_ms']:5.1f}%")
    if s["communication_ms"]:
        comm = ", ".join(f"{k} {v:.2f} ms" for k, v in s["communication_ms"].items())
        hidden = s["communication_hidden_fraction"]
        lines.append(f"  communication in total: {comm}" +
                     (f" ({100 * hidden:.0f}% hidden under compute)" if hidden is not None else " (blocking)"))
    hs = s["host_syncs"]
    if s["device"].startswith("cuda"):
        by = ", ".join(f"{p} {v['per_step']:.1f} ({v['wait_ms']:.2f} ms)" for p, v in hs["by_phase"].items())
        lines.append(f"  host syncs: {hs['per_step']:.1f} per step, host waited {hs['wait_ms']:.2f} ms"
                     + (f"; by phase: {by}" if by else ""))
    else:
        lines.append("  host syncs: none on CPU (no device queue)")
    hp = ", ".join(f"{k} {v:.1f}" for k, v in s["host_phase_ms"].items())
    lines.append(f"  host time by phase (ms per step): {hp}")
    for name, h in s.get("host_threads", {}).items():
        lines.append(f"  host thread {name}: {h['op_ms']:.1f} ms in torch ops, {h['api_calls']:.0f} CUDA API calls "
                     f"of {h['api_mean_us']:.1f} us on average per step")
    if s.get("top_kernels_ms"):
        lines.append("  GPU kernels with the most time (ms per step, calls per step):")
        for k, v in s["top_kernels_ms"].items():
            lines.append(f"    {v['ms']:8.2f} ms {v['calls']:6.0f}x  {k}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for traces, summaries and the run directory")
    ap.add_argument("--warmup", type=int, default=3,
                    help="steps before recording (compilation, warm-up); replicated data parallelism: 10 or more "
                         "(DDP times its first ten iterations with host syncs)")
    ap.add_argument("--steps", type=int, default=3, help="steps recorded")
    ap.add_argument("--fixed-routing", action="store_true",
                    help="weights held still and LoGo thresholds at the gates' quantile: every step routes rho "
                         "(weak_scaling.py's option of the same name)")
    ap.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        ap.error(f"--warmup must be >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    import torch
    import torch.distributed as dist

    from data.format import DataError
    from logo.config import ConfigError
    from logo.run.checkpoint import CheckpointError
    from logo.run.config import compose
    from logo.train.trainer import TrainingDiverged, train
    from weak_scaling import FIXED_ROUTING

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    total = args.warmup + 1 + args.steps + 1  # + the profiler's own warm-up step, + one after recording
    try:
        # held-out evaluation off unless the overrides turn it on (it would run inside the recorded steps)
        overrides = [*args.overrides, *(FIXED_ROUTING if args.fixed_routing else [])]
        cfg, resolved, attention = compose(["eval.interval=0", *overrides, f"train.steps={total}",
                                            "logging.progress_bar=false",
                                            f"run.dir={out / 'run'}", "checkpoint.resume=false",
                                            f"checkpoint.interval={10**9}"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and cfg.parallel.device != "cpu"
    if cuda:  # before the profiler and any CUDA call, so that no rank makes a context on GPU 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = f"cuda ({torch.cuda.get_device_name()})" if cuda else "cpu"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    out.mkdir(parents=True, exist_ok=True)
    summary = {}

    def on_trace(prof):
        path = out / f"trace_rank{rank}.json"
        prof.export_chrome_trace(str(path))
        summary.update(analyze(json.loads(path.read_text()), args.steps, device, world, rank))
        (out / f"summary_rank{rank}.json").write_text(json.dumps(summary, indent=1))

    sched = torch.profiler.schedule(skip_first=args.warmup, wait=0, warmup=1, active=args.steps, repeat=1)
    try:
        with torch.profiler.profile(activities=acts, schedule=sched, on_trace_ready=on_trace) as prof:
            train(cfg, resolved, attention, on_step_end=lambda step: prof.step(), save_final=False)
    except (ConfigError, DataError, CheckpointError, TrainingDiverged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if not summary:
        print("error: the profiler recorded nothing", file=sys.stderr)
        return 1
    if rank == 0:
        print(format_summary(summary))
        print(f"wrote {out}/trace_rank*.json and {out}/summary_rank*.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
