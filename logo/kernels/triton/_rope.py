"""Triton kernels for the LoGo layer's branch inputs: RoPE of the local q (or k) and of its per-head global
transform, in one pass over the rows (the reference is `logo.kernels.reference.rope_transform_forward`).

    x_rot = RoPE(x)          y_rot = RoPE(x A_h)          x (N, H, D), A (H, D, D), angles of row n: n mod T

Unfused, these are a batched matmul (read x, write y), RoPE of y (read, write) and RoPE of x (read, write), each
memory-bound, and the backward repeats the pattern (plus a second batched matmul for dA and an add): at 1.5B/8k
the transforms and RoPEs of both branches were ~14 ms of a 225 ms step. Here the forward reads x once and writes
both outputs; the backward reads x and both incoming gradients once, writes dx, and reduces dA per chunk of rows
(partials (C, H, D, D) float32, summed on the host side: deterministic, no atomics).

RoPE rotates pairs (x[2i], x[2i+1]); the kernels load a row block as (BM, D/2, 2) and split it, and multiply
x by A's even and odd columns separately (two (BM, D) @ (D, D/2) dots), so y's pairs come out split already.
Products run on tensor cores in the input dtype with float32 accumulation (the unfused path rounded y to the
input dtype before rotating it; here the rotation reads the float32 product).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from logo.kernels.triton._kernels import _dot


@triton.jit
def _pairs(ptrs, mask, BM: tl.constexpr, HALF: tl.constexpr):
    """Load a (BM, 2*HALF) tile and split it into its even and odd columns, float32 (BM, HALF) each."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, (BM, HALF, 2)))


@triton.jit
def _interleave(even, odd, BM: tl.constexpr, D: tl.constexpr):
    return tl.reshape(tl.join(even, odd), (BM, D))


@triton.jit
def _angles(COS, SIN, rows, T, rmask, HALF: tl.constexpr):
    offs = (rows % T)[:, None] * HALF + tl.arange(0, HALF)[None, :]
    return tl.load(COS + offs, mask=rmask[:, None], other=1.0), tl.load(SIN + offs, mask=rmask[:, None], other=0.0)


@triton.jit
def _transform_cols(A, h, sa_h, D: tl.constexpr, HALF: tl.constexpr):
    """A_h's even and odd columns, (D, HALF) each, in A's dtype."""
    base = A + h * sa_h + tl.arange(0, D)[:, None] * D + 2 * tl.arange(0, HALF)[None, :]
    return tl.load(base), tl.load(base + 1)


@triton.jit
def _rope_transform_fwd_kernel(X, A, COS, SIN, XR, YR, N, T, sx_n, sx_h, sa_h,
                               BM: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    """One program per (block of BM rows, head): x_rot and y_rot (contiguous (N, H, D))."""
    HALF: tl.constexpr = D // 2
    h = tl.program_id(1)
    H = tl.num_programs(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, D)
    c, s = _angles(COS, SIN, rows, T, rmask, HALF)  # (BM, HALF) float32
    xptr = X + rows64[:, None] * sx_n + h * sx_h + offs_d[None, :]
    x = tl.load(xptr, mask=rmask[:, None], other=0.0)  # (BM, D) input dtype
    xe, xo = tl.split(tl.reshape(x.to(tl.float32), (BM, HALF, 2)))
    out = rows64[:, None] * (H * D) + h * D + offs_d[None, :]
    xr = _interleave(xe * c - xo * s, xe * s + xo * c, BM, D)
    tl.store(XR + out, xr.to(XR.dtype.element_ty), mask=rmask[:, None])
    ae, ao = _transform_cols(A, h, sa_h, D, HALF)
    ye = _dot(x, ae, PREC)  # (BM, HALF) float32: columns 0, 2, 4, ... of x A_h
    yo = _dot(x, ao, PREC)
    yr = _interleave(ye * c - yo * s, ye * s + yo * c, BM, D)
    tl.store(YR + out, yr.to(YR.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _rope_transform_bwd_kernel(GX, GY, X, A, COS, SIN, DX, DA, N, T, BLOCKS_PER_CHUNK,
                               sgx_n, sgx_h, sgy_n, sgy_h, sx_n, sx_h, sa_h,
                               BM: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    """One program per (chunk of rows, head): dx for its rows, and its partial dA_h (float32) into DA[chunk, h].

    With g = RoPE^T(dy_rot) (the inverse rotation): dx = RoPE^T(dx_rot) + g A_h^T, dA_h = sum_rows x^T g."""
    HALF: tl.constexpr = D // 2
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    offs_d = tl.arange(0, D)
    ae, ao = _transform_cols(A, h, sa_h, D, HALF)  # (D, HALF)
    dae = tl.zeros([D, HALF], tl.float32)
    dao = tl.zeros([D, HALF], tl.float32)
    for b in range(0, BLOCKS_PER_CHUNK):
        rows = (chunk * BLOCKS_PER_CHUNK + b) * BM + tl.arange(0, BM)
        rmask = rows < N
        rows64 = rows.to(tl.int64)
        c, s = _angles(COS, SIN, rows, T, rmask, HALF)
        gxe, gxo = _pairs(GX + rows64[:, None] * sgx_n + h * sgx_h + offs_d[None, :], rmask[:, None], BM, HALF)
        gye, gyo = _pairs(GY + rows64[:, None] * sgy_n + h * sgy_h + offs_d[None, :], rmask[:, None], BM, HALF)
        x = tl.load(X + rows64[:, None] * sx_n + h * sx_h + offs_d[None, :], mask=rmask[:, None], other=0.0)
        ge = (gye * c + gyo * s).to(x.dtype)  # d/dy even, odd columns, rounded like the unfused path's grads
        go = (gyo * c - gye * s).to(x.dtype)
        dxe = gxe * c + gxo * s
        dxo = gxo * c - gxe * s
        dx = _interleave(dxe, dxo, BM, D) + _dot(ge, tl.trans(ae), PREC) + _dot(go, tl.trans(ao), PREC)
        tl.store(DX + rows64[:, None] * (H * D) + h * D + offs_d[None, :], dx.to(DX.dtype.element_ty),
                 mask=rmask[:, None])
        xt = tl.trans(x)  # (D, BM); masked rows are zero
        dae += _dot(xt, ge, PREC)
        dao += _dot(xt, go, PREC)
    da = _interleave(dae, dao, D, D)  # (D, D): column 2j from the even part, 2j+1 from the odd
    tl.store(DA + (chunk * H + h) * D * D + offs_d[:, None] * D + offs_d[None, :], da)


def _prec(dtype: torch.dtype) -> str:
    from logo.kernels.triton._attn import INTERPRET
    if dtype == torch.float32:
        return "ieee"
    return "up" if INTERPRET else "tf32"


def _block(device: torch.device) -> int:
    from logo.kernels.triton._attn import INTERPRET
    return 16 if INTERPRET or device.type != "cuda" else 64


def validate(x: torch.Tensor, A: torch.Tensor, cos: torch.Tensor):
    """What the kernels support: (N, H, D) x with D a power of two >= 16, A (H, D, D), cos (T, D/2) with T | N."""
    N, H, D = x.shape
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"the fused RoPE + transform kernel needs a head dim that is a power of two in 16..256, "
                         f"got {D}")
    if A.shape != (H, D, D):
        raise ValueError(f"transform A must be (H, D, D) = ({H}, {D}, {D}), got {tuple(A.shape)}")
    if cos.dim() != 2 or cos.shape[1] != D // 2 or N % cos.shape[0] != 0:
        raise ValueError(f"cos/sin must be (T, D/2) with T dividing the {N} rows, got {tuple(cos.shape)}")


def rope_transform_forward(x, A, cos, sin):
    """(RoPE(x), RoPE(x A_h)): x (N, H, D) with a contiguous last dim, A (H, D, D) in x's dtype, cos/sin
    (T, D/2) float32 -> two contiguous (N, H, D) tensors in x's dtype."""
    N, H, D = x.shape
    xr = torch.empty((N, H, D), device=x.device, dtype=x.dtype)
    yr = torch.empty_like(xr)
    if N == 0:
        return xr, yr
    A, cos, sin = A.contiguous(), cos.contiguous(), sin.contiguous()
    BM = _block(x.device)
    _rope_transform_fwd_kernel[(triton.cdiv(N, BM), H)](
        x, A, cos, sin, xr, yr, N, cos.shape[0], x.stride(0), x.stride(1), A.stride(0),
        BM=BM, D=D, PREC=_prec(x.dtype), num_warps=4)
    return xr, yr


# Programs of the backward (chunks x heads), about two per SM on an H100: the partial dA it sums is
# chunks x H x D x D float32 (16 MB at 16 heads of 128), far less than one (N, H, D) pass at 8k tokens.
_BWD_PROGRAMS = 264


def rope_transform_backward(gx, gy, x, A, cos, sin):
    """dx (N, H, D) in x's dtype and dA (H, D, D) float32 of `rope_transform_forward`, from the gradients
    gx of RoPE(x) and gy of RoPE(x A)."""
    N, H, D = x.shape
    dx = torch.empty((N, H, D), device=x.device, dtype=x.dtype)
    if N == 0:
        return dx, torch.zeros((H, D, D), device=x.device, dtype=torch.float32)
    A, cos, sin = A.contiguous(), cos.contiguous(), sin.contiguous()
    BM = _block(x.device)
    blocks = triton.cdiv(N, BM)
    per_chunk = triton.cdiv(blocks, max(1, min(blocks, triton.cdiv(_BWD_PROGRAMS, H))))
    chunks = triton.cdiv(blocks, per_chunk)
    partial = torch.empty((chunks, H, D, D), device=x.device, dtype=torch.float32)
    _rope_transform_bwd_kernel[(chunks, H)](
        gx, gy, x, A, cos, sin, dx, partial, N, cos.shape[0], per_chunk,
        gx.stride(0), gx.stride(1), gy.stride(0), gy.stride(1), x.stride(0), x.stride(1), A.stride(0),
        BM=BM, D=D, PREC=_prec(x.dtype), num_warps=8 if D >= 128 else 4)
    return dx, partial.sum(0)
