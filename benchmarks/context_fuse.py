"""The fused ContextNorm + fusion op (`logo::context_fuse_fwd/bwd`) against the compiled PyTorch expression it
replaces, one GPU.

    python benchmarks/context_fuse.py --out /tmp/context_fuse.json
    python benchmarks/context_fuse.py --sweep      # (rows per program, warps) of both kernels

Per call, one LoGo layer's branch outputs (1.5B at 8k: N=8192 rows, 16 heads of 128, bf16; half the rows
selected): the two kernels alone, then forward + backward through autograd, against the layer's unfused
expression (`LoGoAttention.fuse` on the reference backend) under torch.compile, as the compiled layer runs it.
Medians of `triton.testing.do_bench`. A copy ceiling (read + write one (N, H, D) tensor) puts the kernel times in
memory-pass units: the forward moves 3 passes (read both branches, write o), the backward 5 (read dO and both
branches, write both gradients).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _op_bench import bench, main  # noqa: E402
from logo.config import AttentionConfig, ModelConfig  # noqa: E402
from logo.kernels import ops  # noqa: E402
from logo.kernels.triton import _fuse  # noqa: E402
from logo.model.logo_attention import LoGoAttention  # noqa: E402

EPS = 1e-5


def measure(n, H, D, rows, label=""):
    gen = torch.Generator("cuda").manual_seed(0)
    o_l, o_g = (torch.randn(n, H, D, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    p = torch.rand(n, device="cuda", generator=gen).requires_grad_()
    z = p.detach() > 0.5
    cfg = ModelConfig(dim=H * D, n_heads=H, n_layers=1,
                      attention=AttentionConfig(kind="logo", backend="reference")).validate()
    layer = LoGoAttention(cfg).cuda()
    layer.init_weights(0.02, 0.02)
    w_l, w_g = layer.norm_local.weight, layer.norm_global.weight
    g = torch.randn(n, H, D, device="cuda", generator=gen).bfloat16()
    args = [t.detach() for t in (o_l, o_g, p)] + [z, w_l.detach(), w_g.detach()]
    copy = bench(lambda: o_l.detach().clone())
    fwd = bench(lambda: _fuse.context_fuse_forward(*args, EPS, True))
    bwd = bench(lambda: _fuse.context_fuse_backward(g, *args, EPS, True))
    row = dict(name=f"context_fuse {label}".strip(), N=n, H=H, D=D, config=dict(_fuse.CONFIG), copy_ms=copy,
               fwd_ms=fwd, bwd_ms=bwd, fwd_passes=fwd / copy * 2, bwd_passes=bwd / copy * 2)
    if not label:  # the op through autograd against the compiled expression (the sweep times the kernels only)
        comp = torch.compile(layer.fuse)

        def fused_step():
            ops.context_fuse(o_l, o_g, p, z, w_l, w_g, EPS, True, use_triton=True).backward(g)

        def unfused_step():
            comp(o_l, o_g, p, z).backward(g)

        both, base = bench(fused_step), bench(unfused_step)
        row.update(fused_fwd_bwd_ms=both, unfused_compiled_fwd_bwd_ms=base, speedup=base / both)
    rows.append(row)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(__doc__, "context_fuse", measure, _fuse.CONFIG, ((8, 2), (8, 4), (16, 8), (32, 4), (32, 8), (64, 8)))
