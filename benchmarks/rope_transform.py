"""The fused RoPE + LP transform op (`logo::rope_transform_fwd/bwd`) against the unfused path it replaces, one GPU.

    python benchmarks/rope_transform.py --out benchmarks/results/h100_rope_transform.json
    python benchmarks/rope_transform.py --sweep      # (rows per block, warps) of both kernels

Per call, for one of q or k of a LoGo layer (1.5B at 8k: N=8192 rows, 16 heads of 128, bf16): forward
(RoPE(x), RoPE(x A)) and backward (dx, dA), as medians of `triton.testing.do_bench`. The unfused baseline is the
model's formula (batched matmul, then RoPE of both) under torch.compile, as the compiled LoGo layer runs it.
A copy ceiling (read + write one (N, H, D) tensor) puts the numbers in memory-pass units: the fused forward
moves 3 passes (read x, write two), the backward kernel 4 (read two gradients, write dx and y's unrotated
gradient g), then the dA matmul reads x and g.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logo.kernels import ops  # noqa: E402
from logo.kernels.triton import _rope  # noqa: E402
from logo.model.layers import apply_rope, rope_cos_sin  # noqa: E402


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def problem(n, H, D, dtype=torch.bfloat16):
    x = torch.randn(n, H, D, device="cuda", dtype=dtype, requires_grad=True)
    A = (torch.eye(D, device="cuda") + 0.05 * torch.randn(H, D, D, device="cuda")).requires_grad_()
    cos, sin = rope_cos_sin(n, D, 10000.0, "cuda")
    g = [torch.randn(n, H, D, device="cuda", dtype=dtype) for _ in range(2)]
    return x, A, cos, sin, g


def unfused(x, A, cos, sin):
    y = torch.einsum("nhd,hde->nhe", x, A.to(x.dtype))
    return apply_rope(x, cos, sin, 1), apply_rope(y, cos, sin, 1)


def measure(n, H, D, rows, label=""):
    x, A, cos, sin, g = problem(n, H, D)
    xd = x.detach()
    copy = bench(lambda: xd.clone())
    fwd = bench(lambda: ops.rope_transform_fwd(xd, A.detach(), cos, sin, True))
    bwd = bench(lambda: ops.rope_transform_bwd(g[0], g[1], xd, A.detach(), cos, sin, True))
    comp = torch.compile(unfused)

    def fused_step():
        out = ops.rope_transform(x, A, cos, sin, use_triton=True)
        torch.autograd.backward(out, g)

    def unfused_step():
        out = comp(x, A, cos, sin)
        torch.autograd.backward(out, g)

    both = bench(fused_step)
    base = bench(unfused_step)
    row = dict(name=f"rope_transform {label}".strip(), N=n, H=H, D=D, config=dict(_rope.CONFIG),
               copy_ms=copy, fwd_ms=fwd, bwd_ms=bwd, fwd_passes=fwd / copy * 2, bwd_passes=bwd / copy * 2,
               fused_fwd_bwd_ms=both, unfused_compiled_fwd_bwd_ms=base, speedup=base / both)
    rows.append(row)
    print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default="8192x16x128,32768x4x64",
                    help="comma list of NxHxD (1.5B at 8k; the small shape's 32 x 1024 rows)")
    args = ap.parse_args()
    rows: list[dict] = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for n, H, D in shapes:
        measure(n, H, D, rows)
    if args.sweep:  # each kernel's (rows per block, warps), the other kernel at its default
        default = dict(_rope.CONFIG)
        for kind in ("fwd", "bwd"):
            for cfg in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8)):
                _rope.CONFIG.update(default)
                _rope.CONFIG[kind] = cfg
                for n, H, D in shapes:
                    try:
                        measure(n, H, D, rows, label=f"{kind}{cfg}")
                    except Exception as e:  # noqa: BLE001 (a config out of registers or shared memory)
                        rows.append(dict(name=f"rope_transform {kind}{cfg}", N=n, H=H, D=D, error=str(e)[:200]))
                        print(rows[-1], flush=True)
        _rope.CONFIG.update(default)
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
