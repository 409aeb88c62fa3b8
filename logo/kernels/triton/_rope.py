"""Triton kernels for the LoGo layer's branch inputs: RoPE of the local q (or k) and of its per-head global
transform, and the global v, in one pass over the rows (the reference is
`logo.kernels.reference.rope_transform_forward`).

    x_rot = RoPE(x)          y_rot = RoPE(x A_h)          x (N, H, D), A (H, D, D), angles of row n: n mod T
    v^G = v A_h              (values are not rotated)

for x = q (with A_q), x = k (with A_k) and v (with A_v) in one launch (a third grid axis picks the tensor, so
the host issues one launch for the three).

Unfused, these are a batched matmul (read x, write y), RoPE of y (read, write) and RoPE of x (read, write), each
memory-bound, and the backward repeats the pattern (plus a second batched matmul for dA and an add). Here the
forward reads x once and writes
both outputs; the backward reads both incoming gradients once and writes dx and y's unrotated gradient g, from
which a split-K reduction over the rows gives dA = x^T g (see `_transform_grads`). v joins the same launch (a
separate cuBLAS batched matmul fits few heads poorly in its dA). v runs q's and k's code with its rotation masked to the identity (its angles load as
cos 1, sin 0) and its RoPE(x) store and gradient load masked off: masked accesses touch no memory.

RoPE rotates pairs (x[2i], x[2i+1]); the kernels load a row block as (BM, D/2, 2) and split it in registers, and
multiply x by A's even and odd columns separately (two (BM, D) @ (D, D/2) dots; A is loaded whole and split the
same way: reading every other column from memory is much slower), so y's pairs come out split already.
Products run on tensor cores in the input dtype with float32 accumulation (the unfused path rounded y to the
input dtype before rotating it; here the rotation reads the float32 product).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from logo.kernels.triton._attn import INTERPRET, _check_dims, _prec
from logo.kernels.triton._kernels import _dot
from logo.kernels.triton._launch import launch


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
def _transform_cols(A, D: tl.constexpr, HALF: tl.constexpr, dtype: tl.constexpr):
    """A's even and odd columns, (D, HALF) each, in `dtype` (A is one contiguous (D, D) matrix, any float type)."""
    a = tl.load(A + tl.arange(0, D)[:, None] * D + tl.arange(0, D)[None, :]).to(dtype)
    return tl.split(tl.reshape(a, (D, HALF, 2)))


@triton.jit
def _pick(t, for_q, for_k, for_v):
    """The argument for the program's tensor t (0: q, 1: k, 2: v)."""
    if t == 0:
        r = for_q
    elif t == 1:
        r = for_k
    else:
        r = for_v
    return r


@triton.jit
def _program_input(Q, K, V, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h):
    """This program's head h (of H), tensor t (0: q, 1: k, 2: v; grid axis 2), and that tensor with its row and
    head strides."""
    h = tl.program_id(1)
    t = tl.program_id(2)
    return h, tl.num_programs(1), t, _pick(t, Q, K, V), _pick(t, sq_n, sk_n, sv_n), _pick(t, sq_h, sk_h, sv_h)


@triton.jit
def _rotated_rows(t, N):
    """How many rows tensor t rotates: all N of q and k, none of v (a row bound, not a scalar mask: the CPU
    interpreter rejects a block mask and-ed with a scalar one)."""
    return tl.where(t < 2, N, 0)


@triton.jit
def _rope_transform_fwd_kernel(Q, K, V, A, COS, SIN, QR, KR, QYR, KYR, VY, N, T, sq_n, sq_h, sk_n, sk_h, sv_n,
                               sv_h, BM: tl.constexpr, RB: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    """One program per (RB blocks of BM rows, head, tensor q, k or v): RoPE(x) into QR | KR and RoPE(x A_t) into
    QYR | KYR, or v A_2 (not rotated) into VY (five contiguous (N, H, D) tensors); A is (3, H, D, D). A_t,h is
    loaded once per program and used for RB row blocks (a (D, D) float32 matrix is as many bytes as 4 bf16 row
    blocks of 64)."""
    HALF: tl.constexpr = D // 2
    h, H, t, X, sx_n, sx_h = _program_input(Q, K, V, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h)
    n_rot = _rotated_rows(t, N)
    XR = _pick(t, QR, KR, QR)  # v has no RoPE(x) output: its store is masked off
    YR = _pick(t, QYR, KYR, VY)
    offs_d = tl.arange(0, D)
    ae, ao = _transform_cols(A + (t * H + h) * D * D, D, HALF, X.dtype.element_ty)
    for b in range(RB):
        rows = (tl.program_id(0) * RB + b) * BM + tl.arange(0, BM)
        rmask = rows < N
        rot = rows < n_rot
        rows64 = rows.to(tl.int64)
        c, s = _angles(COS, SIN, rows, T, rot, HALF)  # (BM, HALF) float32; cos 1, sin 0 for v
        x = tl.load(X + rows64[:, None] * sx_n + h * sx_h + offs_d[None, :], mask=rmask[:, None], other=0.0)
        xe, xo = tl.split(tl.reshape(x.to(tl.float32), (BM, HALF, 2)))
        out = rows64[:, None] * (H * D) + h * D + offs_d[None, :]
        xr = _interleave(xe * c - xo * s, xe * s + xo * c, BM, D)
        tl.store(XR + out, xr.to(QR.dtype.element_ty), mask=rot[:, None])
        ye = _dot(x, ae, PREC)  # (BM, HALF) float32: columns 0, 2, 4, ... of x A_h
        yo = _dot(x, ao, PREC)
        yr = _interleave(ye * c - yo * s, ye * s + yo * c, BM, D)
        tl.store(YR + out, yr.to(QR.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _rope_transform_bwd_kernel(GQ, GK, GQY, GKY, GVY, GV, A, COS, SIN, DQ, DK, DV, G, N, T, BM: tl.constexpr,
                               RB: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, HAS_GV: tl.constexpr):
    """One program per (RB blocks of BM rows, head, tensor t: q, k or v). With gx, gy the gradients of RoPE(x),
    RoPE(x A_t) (GQ | GK, GQY | GKY) and g = RoPE^T(gy) (the inverse rotation): dx = RoPE^T(gx) + g A_t,h^T into
    DQ | DK, and g into G[t]; for v, g = gy (GVY, not rotated) and dv = g A_2,h^T into DV, plus v's own gradient
    from elsewhere (GV, not rotated: the local branch reads v itself) when HAS_GV. Every tensor contiguous,
    (N, H, D) (G: (3, N, H, D)).
    dA_h = x^T g is a separate split-K reduction (`_transform_grads`): reducing it here as well kept two (D, D/2)
    float32 accumulators per program live across a loop over rows, slower than this kernel plus the reduction.
    """
    HALF: tl.constexpr = D // 2
    h = tl.program_id(1)
    H = tl.num_programs(1)
    t = tl.program_id(2)
    n_rot = _rotated_rows(t, N)
    if HAS_GV:  # v's own gradient loads as v's gx (its angles are cos 1, sin 0: added unrotated)
        n_gx = N
    else:  # v has no RoPE(x) output: its load is masked off (zero)
        n_gx = n_rot
    GX = _pick(t, GQ, GK, GV)
    GY = _pick(t, GQY, GKY, GVY)
    DX = _pick(t, DQ, DK, DV)
    dt = DQ.dtype.element_ty
    offs_d = tl.arange(0, D)
    ae, ao = _transform_cols(A + (t * H + h) * D * D, D, HALF, dt)  # (D, HALF)
    aet, aot = tl.trans(ae), tl.trans(ao)  # (HALF, D), once per program
    for b in range(RB):
        rows = (tl.program_id(0) * RB + b) * BM + tl.arange(0, BM)
        rmask = rows < N
        rot = rows < n_rot
        rows64 = rows.to(tl.int64)
        c, s = _angles(COS, SIN, rows, T, rot, HALF)  # cos 1, sin 0 for v
        offs = rows64[:, None] * (H * D) + h * D + offs_d[None, :]
        gxe, gxo = _pairs(GX + offs, (rows < n_gx)[:, None], BM, HALF)
        gye, gyo = _pairs(GY + offs, rmask[:, None], BM, HALF)
        ge = (gye * c + gyo * s).to(dt)  # y's gradient, rounded like the unfused path's
        go = (gyo * c - gye * s).to(dt)
        dx = _interleave(gxe * c + gxo * s, gxo * c - gxe * s, BM, D)
        dx += _dot(ge, aet, PREC) + _dot(go, aot, PREC)
        tl.store(DX + offs, dx.to(dt), mask=rmask[:, None])
        tl.store(G + t.to(tl.int64) * N * (H * D) + offs, _interleave(ge, go, BM, D), mask=rmask[:, None])


# (rows per block, blocks per program, warps) of each kernel on a GPU, for 2-byte inputs with D <= 128;
# benchmarks/rope_transform.py sweeps them (docs/benchmarks.md, "Fused glue ops"). Wider rows get fewer rows per
# block (see `_launch_config`).
CONFIG = {"fwd": (64, 1, 4), "bwd": (64, 2, 4)}
TILE_BYTES = 64 * 128 * 2  # a row block holds at most this many bytes: float32 at D=128 needs half the rows


def _launch_config(kind: str, x: torch.Tensor) -> tuple[int, int, int]:
    """(BM, RB, warps) for rows like x's. The row-block loop is software-pipelined, so shared memory grows
    with the block's bytes: float32 blocks of 64 rows at D=128 need 232 KiB, over an H100's 227."""
    if INTERPRET or x.device.type != "cuda":
        return 16, 2, 4
    bm, rb, warps = CONFIG[kind]
    row_bytes = x.shape[-1] * x.element_size()
    return max(16, min(bm, TILE_BYTES // row_bytes)), rb, warps


def validate(x: torch.Tensor):
    """What the kernels support beyond the op's shape contract: a head dim that is a power of two in 16..256."""
    _check_dims(x, "the fused RoPE + transform kernel")


def _strides(*xs) -> list[int]:
    """The row and head strides of each (N, H, D) tensor, in order."""
    return [s for x in xs for s in x.stride()[:2]]


def rope_transform_forward(q, k, v, A, cos, sin):
    """RoPE(q), RoPE(k), RoPE(q A_0), RoPE(k A_1), v A_2: five contiguous (N, H, D) tensors in q's dtype. q, k, v
    (N, H, D) with contiguous last dims, equal shapes and one dtype, A (3, H, D, D) contiguous (any float dtype;
    rounded to q's dtype for the products), cos/sin (T, D/2) float32 contiguous with T dividing N."""
    N, H, D = q.shape
    outs = [torch.empty((N, H, D), device=q.device, dtype=q.dtype) for _ in range(5)]
    if N == 0:
        return tuple(outs)
    BM, RB, warps = _launch_config("fwd", q)
    launch(_rope_transform_fwd_kernel, (triton.cdiv(N, BM * RB), H, 3), q, k, v, A, cos, sin, *outs, N, cos.shape[0],
        *_strides(q, k, v), BM=BM, RB=RB, D=D, PREC=_prec(q.dtype), num_warps=warps)
    return tuple(outs)


@triton.jit
def _transform_grad_kernel(Q, K, V, G, P, N, ROWS_PER, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, BK: tl.constexpr,
                           D: tl.constexpr, PREC: tl.constexpr):
    """One program per (chunk of ROWS_PER rows, head, tensor t: q, k or v): the chunk's share of dA_t,h = x^T g,
    P[chunk, t, h] = sum over its rows of x[n, h]^T g[t, n, h], (D, D) float32. x is read through its strides,
    G is the contiguous (3, N, H, D) buffer of the backward kernel."""
    c = tl.program_id(0)
    h, H, t, X, sx_n, sx_h = _program_input(Q, K, V, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D, D], tl.float32)
    start = c * ROWS_PER
    for r0 in range(start, tl.minimum(start + ROWS_PER, N), BK):
        rows = r0 + tl.arange(0, BK)
        rmask = (rows < N)[:, None]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * sx_n + h * sx_h + offs_d[None, :], mask=rmask, other=0.0)
        g = tl.load(G + (t * N + rows64[:, None]) * (H * D) + h * D + offs_d[None, :], mask=rmask, other=0.0)
        acc += _dot(tl.trans(x), g, PREC)
    tl.store(P + ((c * 3 + t) * H + h) * (D * D) + offs_d[:, None] * D + offs_d[None, :], acc)


# Programs the dA reduction aims for: each (head, tensor) pair's rows are split into chunks until about this many
# programs run (four per SM of an H100). cuBLAS's batched matmul over the heads runs the (H, D, D) output as a few
# tiles, each reducing all N rows, which leaves most SMs idle when there are few heads.
DA_PROGRAMS = 528


def _transform_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """dA (3, H, D, D) float32: dA_t,h = x_t,h^T g_t,h for x = q, k, v (N, H, D) with contiguous last dims (any
    row and head strides) and g (3, N, H, D) contiguous. Split-K over the rows: each program sums its chunk in
    float32 into a partial, and the host adds the partials (no atomics: the same sum every run)."""
    N, H, D = q.shape
    BK, warps = (16, 4) if INTERPRET or q.device.type != "cuda" else (64, 8 if D >= 128 else 4)
    chunks = max(1, min(triton.cdiv(N, BK), triton.cdiv(DA_PROGRAMS, 3 * H)))
    rows_per = triton.cdiv(triton.cdiv(N, chunks), BK) * BK
    chunks = triton.cdiv(N, rows_per)
    part = torch.empty((chunks, 3, H, D, D), device=q.device, dtype=torch.float32)
    launch(_transform_grad_kernel, (chunks, H, 3), q, k, v, g, part, N, rows_per, *_strides(q, k, v), BK=BK, D=D,
        PREC=_prec(q.dtype), num_warps=warps)
    return part.sum(0) if chunks > 1 else part[0]


def rope_transform_backward(gq, gk, gqy, gky, gvy, q, k, v, A, cos, sin, gv=None):
    """dq, dk, dv (N, H, D) in q's dtype and dA (3, H, D, D) float32 of `rope_transform_forward`, from the
    gradients of its five outputs (contiguous); gv (contiguous, optional): a gradient of v from elsewhere, added
    into dv before its one rounding."""
    N, H, D = q.shape
    dq, dk, dv = torch.empty_like(gq), torch.empty_like(gk), torch.empty_like(gvy)
    if N == 0:
        return dq, dk, dv, torch.zeros((3, H, D, D), device=q.device, dtype=torch.float32)
    g = torch.empty((3, N, H, D), device=q.device, dtype=q.dtype)
    BM, RB, warps = _launch_config("bwd", q)
    gv_ = gq if gv is None else gv
    launch(_rope_transform_bwd_kernel, (triton.cdiv(N, BM * RB), H, 3), gq, gk, gqy, gky, gvy, gv_, A, cos, sin, dq,
        dk, dv, g, N, cos.shape[0], BM=BM, RB=RB, D=D, PREC=_prec(q.dtype), HAS_GV=gv is not None, num_warps=warps)
    return dq, dk, dv, _transform_grads(q, k, v, g)
