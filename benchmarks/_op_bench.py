"""Shared driver of the fused-op microbenchmarks (`rope_transform.py`, `context_fuse.py`): medians of
`triton.testing.do_bench`, shapes given as NxHxD, a sweep of each kernel's launch config with the other kernel at
its default, JSON out."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import triton


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main(doc: str, name: str, measure: Callable, config: dict, sweep_configs) -> None:
    """measure(n, H, D, rows, label="") appends a row per call; config: the module's {"fwd": cfg, "bwd": cfg},
    swept over sweep_configs with --sweep (restored afterwards)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default="8192x16x128,32768x4x64",
                    help="comma list of NxHxD (1.5B at 8k; the small shape's 32 x 1024 rows)")
    args = ap.parse_args()
    rows: list[dict] = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for n, H, D in shapes:
        measure(n, H, D, rows)
    if args.sweep:
        default = dict(config)
        for kind in ("fwd", "bwd"):
            for cfg in sweep_configs:
                config.update(default)
                config[kind] = cfg
                for n, H, D in shapes:
                    try:
                        measure(n, H, D, rows, label=f"{kind}{cfg}")
                    except Exception as e:  # noqa: BLE001 (a config out of registers or shared memory)
                        rows.append(dict(name=f"{name} {kind}{cfg}", N=n, H=H, D=D, error=str(e)[:200]))
                        print(rows[-1], flush=True)
        config.update(default)
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
