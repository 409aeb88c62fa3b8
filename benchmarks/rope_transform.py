"""The fused RoPE + LP transform op (`logo::rope_transform_fwd/bwd`) against the unfused path it replaces, one GPU.

    python benchmarks/rope_transform.py --out benchmarks/results/h100_rope_transform.json
    python benchmarks/rope_transform.py --sweep      # (rows per block, blocks per program, warps) of both

Per call, for q, k and v of a LoGo layer (1.5B at 8k: N=8192 rows, 16 heads of 128, bf16): forward (RoPE and
RoPE of the transform, of q and k; v's transform) and backward (dq, dk, dv, dA), as medians of
`triton.testing.do_bench`. On the GPU machine's slow host, times of a few tens of microseconds include launch
gaps: read kernel times from a profile.
The unfused baseline is the model's formula (batched matmul, then RoPE of q's and k's; v's batched matmul) under
torch.compile, as the compiled LoGo layer runs it.
A copy ceiling (read + write one (N, H, D) tensor) puts the numbers in memory-pass units: the fused forward
moves 8 passes (read q, k, v, write five), the backward kernel 11 (read five gradients, write dq, dk, dv and the
three unrotated gradients g), then the dA reduction reads q, k, v and g.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _op_bench import bench, main  # noqa: E402
from logo.kernels import ops  # noqa: E402
from logo.kernels.triton import _rope  # noqa: E402
from logo.kernels.rope import apply_rope  # noqa: E402
from logo.model.layers import rope_cos_sin  # noqa: E402


def problem(n, H, D, dtype=torch.bfloat16):
    q, k, v = (torch.randn(n, H, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    A = (torch.eye(D, device="cuda") + 0.05 * torch.randn(3, H, D, D, device="cuda")).requires_grad_()
    cos, sin = rope_cos_sin(n, D, 10000.0, "cuda")
    g = [torch.randn(n, H, D, device="cuda", dtype=dtype) for _ in range(5)]
    return q, k, v, A, cos, sin, g


def unfused(q, k, v, A, cos, sin):
    qg, kg, vg = (torch.einsum("nhd,hde->nhe", x, a.to(x.dtype)) for x, a in zip((q, k, v), A))
    return (*(apply_rope(t, cos, sin, 1) for t in (q, k, qg, kg)), vg)


def measure(n, H, D, rows, label=""):
    """q, k and v of one layer: the fused op's kernels alone, then forward + backward through autograd."""
    q, k, v, A, cos, sin, g = problem(n, H, D)
    xd, Ad = (q.detach(), k.detach(), v.detach()), A.detach()
    copy = bench(lambda: xd[0].clone())
    fwd = bench(lambda: _rope.rope_transform_forward(*xd, Ad, cos, sin))
    bwd = bench(lambda: _rope.rope_transform_backward(*g, *xd, Ad, cos, sin))
    comp = torch.compile(unfused)

    def fused_step():
        torch.autograd.backward(ops.rope_transform(q, k, v, A, cos, sin, use_triton=True), g)

    def unfused_step():
        torch.autograd.backward(comp(q, k, v, A, cos, sin), g)

    both = bench(fused_step)
    base = bench(unfused_step)
    row = dict(name=f"rope_transform {label}".strip(), N=n, H=H, D=D, config=dict(_rope.CONFIG),
               copy_ms=copy, fwd_ms=fwd, bwd_ms=bwd, fwd_passes=fwd / copy * 2, bwd_passes=bwd / copy * 2,
               fused_fwd_bwd_ms=both, unfused_compiled_fwd_bwd_ms=base, speedup=base / both)
    rows.append(row)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(__doc__, "rope_transform", measure, _rope.CONFIG,
         ((64, 1, 4), (64, 4, 4), (64, 8, 4), (128, 2, 8), (128, 4, 8)))
