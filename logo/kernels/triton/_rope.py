"""Triton kernels for the LoGo layer's branch inputs: RoPE of the local q (or k) and of its per-head global
transform, in one pass over the rows (the reference is `logo.kernels.reference.rope_transform_forward`).

    x_rot = RoPE(x)          y_rot = RoPE(x A_h)          x (N, H, D), A (H, D, D), angles of row n: n mod T

Unfused, these are a batched matmul (read x, write y), RoPE of y (read, write) and RoPE of x (read, write), each
memory-bound, and the backward repeats the pattern (plus a second batched matmul for dA and an add): at 1.5B/8k
the transforms and RoPEs of both branches were ~14 ms of a 225 ms step. Here the forward reads x once and writes
both outputs; the backward reads both incoming gradients once and writes dx and y's unrotated gradient g, from
which one batched matmul (split over row chunks when heads are few) gives dA = x^T g.

RoPE rotates pairs (x[2i], x[2i+1]); the kernels load a row block as (BM, D/2, 2) and split it, and multiply
x by A's even and odd columns separately (two (BM, D) @ (D, D/2) dots), so y's pairs come out split already;
the host hands the kernels A with its columns reordered even-then-odd, so every load is contiguous.
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
    """A_h's even and odd columns, (D, HALF) each, from A with its columns reordered even-then-odd on the host
    (`_even_odd_cols`: contiguous loads; reading every other column of A directly was 5x slower)."""
    base = A + h * sa_h + tl.arange(0, D)[:, None] * D + tl.arange(0, HALF)[None, :]
    return tl.load(base), tl.load(base + HALF)


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
def _rope_transform_bwd_kernel(GX, GY, A, COS, SIN, DX, G, N, T, sgx_n, sgx_h, sgy_n, sgy_h, sa_h,
                               BM: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    """One program per (block of BM rows, head). With g = RoPE^T(gy) (the inverse rotation of y's gradient):
    dx = RoPE^T(gx) + g A_h^T into DX, and g itself into G (both contiguous (N, H, D) in x's dtype), from which
    the host takes dA_h = x^T g with one batched matmul. (Reducing dA here as well kept two (D, D/2) float32
    accumulators per program live across a loop over rows: 3.5x slower than this kernel plus the matmul.)"""
    HALF: tl.constexpr = D // 2
    h = tl.program_id(1)
    H = tl.num_programs(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, D)
    c, s = _angles(COS, SIN, rows, T, rmask, HALF)
    gxe, gxo = _pairs(GX + rows64[:, None] * sgx_n + h * sgx_h + offs_d[None, :], rmask[:, None], BM, HALF)
    gye, gyo = _pairs(GY + rows64[:, None] * sgy_n + h * sgy_h + offs_d[None, :], rmask[:, None], BM, HALF)
    ge = (gye * c + gyo * s).to(DX.dtype.element_ty)  # y's gradient, rounded like the unfused path's
    go = (gyo * c - gye * s).to(DX.dtype.element_ty)
    ae, ao = _transform_cols(A, h, sa_h, D, HALF)  # (D, HALF)
    dx = _interleave(gxe * c + gxo * s, gxo * c - gxe * s, BM, D)
    dx += _dot(ge, tl.trans(ae), PREC) + _dot(go, tl.trans(ao), PREC)
    out = rows64[:, None] * (H * D) + h * D + offs_d[None, :]
    tl.store(DX + out, dx.to(DX.dtype.element_ty), mask=rmask[:, None])
    tl.store(G + out, _interleave(ge, go, BM, D), mask=rmask[:, None])


def _prec(dtype: torch.dtype) -> str:
    from logo.kernels.triton._attn import INTERPRET
    if dtype == torch.float32:
        return "ieee"
    return "up" if INTERPRET else "tf32"


# (rows per block, warps) of each kernel on a GPU; benchmarks/rope_transform.py sweeps them.
CONFIG = {"fwd": (64, 4), "bwd": (64, 4)}


def _launch(kind: str, device: torch.device, D: int) -> tuple[int, int]:
    from logo.kernels.triton._attn import INTERPRET
    if INTERPRET or device.type != "cuda":
        return 16, 4
    bm, warps = CONFIG[kind]
    return bm, warps


def _even_odd_cols(A: torch.Tensor) -> torch.Tensor:
    """A (H, D, D) with its columns reordered: even ones (0, 2, ...) first, then odd ones."""
    return torch.cat((A[..., 0::2], A[..., 1::2]), dim=-1).contiguous()


def _interleave_cols(a: torch.Tensor) -> torch.Tensor:
    """Inverse of `_even_odd_cols`."""
    return torch.stack(a.chunk(2, dim=-1), dim=-1).flatten(-2)


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
    A, cos, sin = _even_odd_cols(A), cos.contiguous(), sin.contiguous()
    BM, warps = _launch("fwd", x.device, D)
    _rope_transform_fwd_kernel[(triton.cdiv(N, BM), H)](
        x, A, cos, sin, xr, yr, N, cos.shape[0], x.stride(0), x.stride(1), A.stride(0),
        BM=BM, D=D, PREC=_prec(x.dtype), num_warps=warps)
    return xr, yr


def _transform_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """dA_h = x_h^T g_h (H, D, D) float32, for x, g (N, H, D). Split over S chunks of rows (a batch of H*S
    products, then a float32 sum): with few heads one product per head leaves most of the GPU idle."""
    N, H, D = x.shape
    S = max(1, min(64 // H, N // 1024))
    while N % S:
        S -= 1
    part = torch.einsum("snhd,snhe->shde", x.view(S, N // S, H, D), g.view(S, N // S, H, D))
    return part.float().sum(0)


def rope_transform_backward(gx, gy, x, A, cos, sin):
    """dx (N, H, D) in x's dtype and dA (H, D, D) float32 of `rope_transform_forward`, from the gradients
    gx of RoPE(x) and gy of RoPE(x A)."""
    N, H, D = x.shape
    dx = torch.empty((N, H, D), device=x.device, dtype=x.dtype)
    if N == 0:
        return dx, torch.zeros((H, D, D), device=x.device, dtype=torch.float32)
    g = torch.empty_like(dx)
    A, cos, sin = _even_odd_cols(A), cos.contiguous(), sin.contiguous()
    BM, warps = _launch("bwd", x.device, D)
    _rope_transform_bwd_kernel[(triton.cdiv(N, BM), H)](
        gx, gy, A, cos, sin, dx, g, N, cos.shape[0], gx.stride(0), gx.stride(1), gy.stride(0), gy.stride(1),
        A.stride(0), BM=BM, D=D, PREC=_prec(x.dtype), num_warps=warps)
    return dx, _transform_grad(x, g)
