"""Triton kernels for the LoGo layer's ContextNorms and weighted fusion (the reference is
`logo.kernels.reference.context_fuse_forward`):

    o_t = (1 - p_t) Norm^L(O^L_t) + p_t Norm^G(O^G_t)   selected rows (additive fusion: without the 1 - p)
        = Norm^L(O^L_t)                                 other rows          Norm = head-wise RMSNorm, weight (H, D)

Memory-bound: the forward reads O^L and O^G once and writes o; the backward reads dO, O^L and O^G once and writes
their gradients, plus partial sums that the host adds up (a few MB; no atomics, so the result is deterministic):
the gate's gradient per head and both norms' weight gradients per block of rows. One program per (block of rows,
head).
Roundings follow the PyTorch module: each norm's output is rounded to the input dtype before the fusion, and the
gradient entering each norm is rounded like autograd's dtype casts round it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from logo.kernels.triton._attn import INTERPRET, _check_dims
from logo.kernels.triton._launch import launch


@triton.jit
def _rows_of(P, Z, N, BM: tl.constexpr, D: tl.constexpr, WEIGHTED: tl.constexpr):
    """The program's (BM rows, head): rows, their mask, the offsets of the head's (BM, D) tile in an (N, H, D)
    tensor, and per row p, z and the local branch's weight a = 1 - p (weighted) or 1 (additive), (BM, 1) each."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < N
    offs = rows.to(tl.int64)[:, None] * (tl.num_programs(1) * D) + h * D + tl.arange(0, D)[None, :]
    p = tl.load(P + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    z = (tl.load(Z + rows, mask=rmask, other=0) != 0)[:, None]
    a = 1.0 - p if WEIGHTED else tl.full((BM, 1), 1.0, tl.float32)
    return h, rows, rmask, offs, p, z, a


@triton.jit
def _norm_rows(X, W, offs, rmask, h, eps, D: tl.constexpr, dt: tl.constexpr):
    """x (BM, D) float32, its rsqrt(mean(x^2) + eps) (BM,), the head's weight (D,) float32 and the norm's output
    (x r) w rounded to dt, back in float32."""
    x = tl.load(X + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(W + h * D + tl.arange(0, D)).to(tl.float32)
    return x, r, w, ((x * r[:, None]) * w[None, :]).to(dt).to(tl.float32)


@triton.jit
def _context_fuse_fwd_kernel(OL, OG, P, Z, WL, WG, OUT, N, eps, BM: tl.constexpr, D: tl.constexpr,
                             WEIGHTED: tl.constexpr):
    """One program per (BM rows, head): OUT = where(z, a Norm^L(O^L) + p Norm^G(O^G), Norm^L(O^L))."""
    dt = OUT.dtype.element_ty
    h, rows, rmask, offs, p, z, a = _rows_of(P, Z, N, BM, D, WEIGHTED)
    _, _, _, nl = _norm_rows(OL, WL, offs, rmask, h, eps, D, dt)
    _, _, _, ng = _norm_rows(OG, WG, offs, rmask, h, eps, D, dt)
    tl.store(OUT + offs, tl.where(z, a * nl + p * ng, nl).to(dt), mask=rmask[:, None])


@triton.jit
def _norm_backward(gy, x, r, w, D: tl.constexpr):
    """RMSNorm y = (x r) w: dx (BM, D) and this block's weight gradient (D,), float32."""
    u = gy * w[None, :]
    dx = r[:, None] * u - x * (r * r * r * tl.sum(u * x, 1) / D)[:, None]
    return dx, tl.sum(gy * (x * r[:, None]), 0)


@triton.jit
def _context_fuse_bwd_kernel(GO, OL, OG, P, Z, WL, WG, DOL, DOG, DP, DWL, DWG, N, eps, BM: tl.constexpr,
                             D: tl.constexpr, WEIGHTED: tl.constexpr):
    """One program per (BM rows, head): DOL, DOG (N, H, D), this head's share of the gate gradient DP[h] (H, N)
    and the block's weight-gradient partial sums DWL[pid, h], DWG[pid, h] (NB, H, D), all float32 partials."""
    dt = DOL.dtype.element_ty
    h, rows, rmask, offs, p, z, a = _rows_of(P, Z, N, BM, D, WEIGHTED)
    go = tl.load(GO + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    xl, rl, wl, nl = _norm_rows(OL, WL, offs, rmask, h, eps, D, dt)
    xg, rg, wg, ng = _norm_rows(OG, WG, offs, rmask, h, eps, D, dt)
    dn = ng - nl if WEIGHTED else ng  # d(fused)/dp
    tl.store(DP + h * N + rows, tl.sum(tl.where(z, go * dn, 0.0), 1), mask=rmask)
    gl = tl.where(z, (a * go).to(dt).to(tl.float32), go)  # gradient of Norm^L's output, as autograd rounds it
    gg = tl.where(z, (p * go).to(dt).to(tl.float32), 0.0)
    dxl, dwl = _norm_backward(gl, xl, rl, wl, D)
    dxg, dwg = _norm_backward(gg, xg, rg, wg, D)
    tl.store(DOL + offs, dxl.to(dt), mask=rmask[:, None])
    tl.store(DOG + offs, dxg.to(dt), mask=rmask[:, None])
    part = (tl.program_id(0) * tl.num_programs(1) + h) * D + tl.arange(0, D)  # this block's (pid, h) row
    tl.store(DWL + part, dwl)
    tl.store(DWG + part, dwg)


# Rows per program and warps on a GPU (one head per program).
CONFIG = {"fwd": (32, 4), "bwd": (32, 4)}


def _launch_config(kind: str, x: torch.Tensor) -> tuple[int, int]:
    if INTERPRET or x.device.type != "cuda":
        return 8, 4
    return CONFIG[kind]


def validate(x: torch.Tensor):
    """What the kernels support beyond the op's shape contract: a head dim that is a power of two in 16..256."""
    _check_dims(x, "the fused ContextNorm kernel")


def context_fuse_forward(o_local, o_global, p, z, w_local, w_global, eps: float, weighted: bool):
    """o (N, H, D) contiguous in o_local's dtype; every tensor contiguous, z (N,) bool."""
    N, H, D = o_local.shape
    out = torch.empty((N, H, D), device=o_local.device, dtype=o_local.dtype)
    if N == 0:
        return out
    BM, warps = _launch_config("fwd", o_local)
    launch(_context_fuse_fwd_kernel, (triton.cdiv(N, BM), H), o_local, o_global, p, z.view(torch.uint8), w_local,
        w_global, out, N, eps, BM=BM, D=D, WEIGHTED=weighted, num_warps=warps)
    return out


def context_fuse_backward(grad, o_local, o_global, p, z, w_local, w_global, eps: float, weighted: bool):
    """d o_local, d o_global (N, H, D) in their dtype, dp (N,) in p's, d w_local, d w_global (H, D) float32."""
    N, H, D = o_local.shape
    d_local, d_global = (torch.empty((N, H, D), device=o_local.device, dtype=o_local.dtype) for _ in range(2))
    if N == 0:
        zero = torch.zeros((H, D), device=o_local.device, dtype=torch.float32)
        return d_local, d_global, torch.zeros_like(p), zero, zero.clone()
    BM, warps = _launch_config("bwd", o_local)
    nb = triton.cdiv(N, BM)
    dp = torch.empty((H, N), device=p.device, dtype=torch.float32)  # per-head partial sums
    dw = torch.empty((2, nb, H, D), device=o_local.device, dtype=torch.float32)  # per-block partial sums
    launch(_context_fuse_bwd_kernel, (nb, H), grad, o_local, o_global, p, z.view(torch.uint8), w_local, w_global,
        d_local, d_global, dp, dw[0], dw[1], N, eps, BM=BM, D=D, WEIGHTED=weighted, num_warps=warps)
    return d_local, d_global, dp.sum(0).to(p.dtype), dw[0].sum(0), dw[1].sum(0)
