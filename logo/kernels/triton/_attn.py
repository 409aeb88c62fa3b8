"""Host side of the Triton kernels for LoGo's two attention ops (query-sparse global, sliding-window local).

One family of kernels (`_kernels.py`) serves both ops and dense causal attention. A "range attention" problem
is: packed query rows, dense packed keys/values, and per sequence the offsets cu_q / cu_k; query row r sees
the keys first[r] .. last[r] of its own sequence:

- query-sparse global attention: q = the selected rows with their real positions q_pos (ascending inside
  each sequence); last = cu_k[seq] + q_pos, first = cu_k[seq];
- sliding-window attention: q = every row (`DENSE_Q`), last = r, first = max(seq start, r - window + 1);
- dense causal attention: every row, no window.

Forward and dQ kernels run one program per (block of BM packed query rows, head). Each row finds its sequence
by a binary search over cu_seqlens inside the kernel (no block maps built on the host, no host sync); a
block may straddle sequences. The smallest/largest `first` and `last` of the block split its key range into
  masked head | unmasked middle (every row sees every key: no predicate) | masked diagonal,
so only blocks that can hold a masked element pay for the mask, and keys after the block's largest `last`
are never touched (paper App. B). The dK/dV kernel runs one program per (KV block, head) and walks the query
rows that can see the block: masked head blocks, then unmasked blocks, then the masked tail. For sparse
queries the first row at/after the block's first and last key come from one `torch.searchsorted` over the
rows' key indices (on the GPU, no host sync); for dense queries they are arithmetic.

dQ has two strategies (`dq_mode`): "separate" recomputes P and dP in a dQ kernel that mirrors the forward
(7 matmuls per tile pair in the backward, deterministic); "atomic" adds dS K into an fp32 buffer from the
dK/dV kernel (5 matmuls plus atomic traffic; summation order varies run to run).

All accumulation is float32; scores use exp2 with log2(e) folded into the scale; the log-sum-exp is kept in
base 2, (H, Nq) float32, between forward and backward.
"""
from __future__ import annotations

import math
import os

import torch
import triton

from logo.kernels.triton._kernels import _delta_kernel, _dkdv_kernel, _dq_kernel, _fwd_kernel

_LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cfg(D: int, dtype: torch.dtype, window: int, device: torch.device) -> dict:
    """Launch parameters per kernel, (BM, BN, warps, stages), and the dQ strategy. CONFIG_OVERRIDE wins."""
    if INTERPRET or device.type != "cuda":
        c = dict(fwd=(16, 16, 4, 1), dq=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq_mode="separate")
    elif dtype == torch.float32:
        c = dict(fwd=(64, 32, 4, 2), dq=(64, 32, 4, 2), dkdv=(32, 64, 4, 2), dq_mode="separate")
    elif window > 0:  # sliding window: small tiles waste the fewest masked keys (sweep on H100, w=128, D=128)
        c = dict(fwd=(64, 32, 4, 3), dq=(64, 32, 4, 3), dkdv=(32, 64, 4, 3), dq_mode="separate")
    elif D <= 64:
        c = dict(fwd=(128, 64, 4, 3), dq=(128, 64, 4, 3), dkdv=(64, 128, 4, 3), dq_mode="separate")
    else:  # global / causal, D=128: best of the H100 sweep in docs/benchmarks.md
        c = dict(fwd=(128, 128, 8, 3), dq=(128, 64, 8, 3), dkdv=(64, 128, 8, 3), dq_mode="separate")
    kind = "window" if window > 0 else "global"
    for key in ((kind, D, dtype), (kind, D), (kind,)):
        if key in CONFIG_OVERRIDE:
            return {**c, **CONFIG_OVERRIDE[key]}
    return c


# (kind, D, dtype) / (kind, D) / (kind,) -> {"fwd": (BM, BN, warps, stages), ..., "dq_mode": ...}; kind is
# "global" (no window: query-sparse and causal) or "window". Used by benchmarks and tuning.
CONFIG_OVERRIDE: dict = {}


def _prec(dtype):
    if dtype == torch.float32:
        return "ieee"
    return "up" if INTERPRET else "tf32"  # 16-bit operands: tensor-core bf16/fp16 dot (the flag is moot)


def _empty(*shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Every kernel output is allocated here (tests swap in a NaN-filled allocator to catch unwritten rows)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


def _steps(cu: torch.Tensor) -> tuple[int, int]:
    """(number of sequences, binary-search steps over them): host-known shapes, no sync."""
    nseq = cu.shape[0] - 1
    return nseq, max(nseq - 1, 0).bit_length()


def _check_dims(q):
    D = q.shape[-1]
    if D < 16 or D > 256 or (D & (D - 1)) != 0:
        raise ValueError(f"Triton attention supports head dims 16..256 that are powers of two, got {D}")


def _rowmajor(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def attn_forward(q, k, v, q_pos, cu_q, cu_k, scale, window, dense_q):
    """Returns o (Nq, H, D) in q's dtype and lse2 (H, Nq) float32 (base-2 log-sum-exp of scaled scores).
    With dense_q, q_pos is not read (every row is a query at its own position)."""
    nq, H, D = q.shape
    BM, BN, warps, stages = _cfg(D, q.dtype, window, q.device)["fwd"]
    o = _empty(*q.shape, like=q)
    lse = _empty(H, nq, like=q, dtype=torch.float32)
    nseq, steps = _steps(cu_q)
    _fwd_kernel[(triton.cdiv(nq, BM), H)](
        q, k, v, o, lse, q_pos, cu_q, cu_k, nq, nseq, steps, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        scale * _LOG2E, WINDOWED=window > 0, DENSE_Q=dense_q, BM=BM, BN=BN, D=D, PREC=_prec(q.dtype),
        num_warps=warps, num_stages=stages)
    return o, lse


def key_rows_and_split(q_pos, cu_q, cu_k, nk, block_n):
    """Sparse queries: each row's packed key row (cu_k[seq] + q_pos, ascending) and, per KV block, the first
    row at or after its first key and its last key ((2*NB,) int32), by one searchsorted on the GPU."""
    nq = q_pos.shape[0]
    seq = torch.searchsorted(cu_q[1:], torch.arange(nq, device=q_pos.device, dtype=torch.int32), right=True)
    kidx = cu_k[seq.clamp_max(cu_q.shape[0] - 2)] + q_pos
    starts = torch.arange(0, nk, block_n, device=q_pos.device, dtype=torch.int32)
    bounds = torch.cat([starts, (starts + block_n - 1).clamp_max(nk - 1)])
    return kidx, torch.searchsorted(kidx, bounds).to(torch.int32)


def attn_backward(do, q, k, v, o, lse, q_pos, cu_q, cu_k, scale, window, dense_q):
    nq, H, D = q.shape
    nk = k.shape[0]
    c = _cfg(D, q.dtype, window, q.device)
    prec = _prec(q.dtype)
    do = _rowmajor(do)
    delta = _empty(H, nq, like=q, dtype=torch.float32)
    _delta_kernel[(triton.cdiv(nq, 64), H)](o, do, delta, nq, o.stride(0), o.stride(1), do.stride(0), do.stride(1),
                                            BM=64, D=D, num_warps=4)
    nseq, steps = _steps(cu_q)
    atomic = c["dq_mode"] == "atomic"
    if atomic:
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    else:
        dq = _empty(*q.shape, like=q)
        BM, BN, warps, stages = c["dq"]
        _dq_kernel[(triton.cdiv(nq, BM), H)](
            q, k, v, do, dq, lse, delta, q_pos, cu_q, cu_k, nq, nseq, steps, window,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
            dq.stride(0), dq.stride(1), scale * _LOG2E, scale,
            WINDOWED=window > 0, DENSE_Q=dense_q, BM=BM, BN=BN, D=D, PREC=prec, num_warps=warps, num_stages=stages)
    dk = _empty(*k.shape, like=k)
    dv = _empty(*v.shape, like=v)
    BM, BN, warps, stages = c["dkdv"]
    nbk = triton.cdiv(nk, BN)
    kidx, split = (cu_k, cu_k) if dense_q else key_rows_and_split(q_pos, cu_q, cu_k, nk, BN)
    _dkdv_kernel[(nbk, H)](
        q, k, v, do, dk, dv, dq, lse, delta, kidx, split, cu_q, cu_k, nq, nk, nbk, nseq, steps, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), dq.stride(0), dq.stride(1), scale * _LOG2E, scale,
        WINDOWED=window > 0, DENSE_Q=dense_q, ATOMIC_DQ=atomic, BM=BM, BN=BN, D=D, PREC=prec,
        num_warps=warps, num_stages=stages)
    if atomic:
        dq = (dq * scale).to(q.dtype)
    return dq, dk, dv


class _RangeAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, cu_q, cu_k, scale, window, dense_q):
        o, lse = attn_forward(q, k, v, q_pos, cu_q, cu_k, scale, window, dense_q)
        ctx.save_for_backward(q, k, v, o, lse, q_pos, cu_q, cu_k)
        ctx.cfg = (scale, window, dense_q)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, q_pos, cu_q, cu_k = ctx.saved_tensors
        scale, window, dense_q = ctx.cfg
        dq, dk, dv = attn_backward(do, q, k, v, o, lse, q_pos, cu_q, cu_k, scale, window, dense_q)
        return dq, dk, dv, None, None, None, None, None, None


def _validate(q, k, v, q_pos, cu_q, cu_k):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (N, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_pos is not None and q_pos.shape != (q.shape[0],):
        raise ValueError(f"q_pos must be ({q.shape[0]},), got {tuple(q_pos.shape)}")
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q {tuple(cu_q.shape)} and cu_seqlens_k {tuple(cu_k.shape)} must be (B+1,)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of float16/bfloat16/float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_dims(q)


@torch.compiler.disable  # compile boundary: torch.compile fuses the glue around the kernels, not them
def query_sparse_attention(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale=None):
    """Causal attention for packed selected query rows over dense keys/values: (Nq, H, D).

    Same contract as `logo.kernels.reference.query_sparse_attention`; q_pos must ascend inside each sequence
    (selected rows packed in sequence order). No host synchronisation.
    """
    _validate(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[0] == 0:
        return q * 0.0
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    return _RangeAttn.apply(q, k, v, q_pos.to(torch.int32).contiguous(), cu_seqlens_q.to(torch.int32).contiguous(),
                            cu_seqlens_k.to(torch.int32).contiguous(), scale, 0, False)


@torch.compiler.disable
def sliding_window_attention(q, k, v, cu_seqlens, window: int, scale=None):
    """Causal sliding-window attention over packed sequences: (N, H, D). Same contract as the reference."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return _every_row_a_query(q, k, v, cu_seqlens, int(window), scale)


@torch.compiler.disable
def causal_attention(q, k, v, cu_seqlens, scale=None):
    """Dense causal attention inside each packed sequence (every row a query): (N, H, D)."""
    return _every_row_a_query(q, k, v, cu_seqlens, 0, scale)


def _every_row_a_query(q, k, v, cu_seqlens, window: int, scale):
    """The dense-query problems (window > 0: sliding window; 0: causal): row r is a query at key row r."""
    cu = cu_seqlens.to(torch.int32).contiguous()
    n = q.shape[0]
    _validate(q, k, v, None, cu, cu)
    if k.shape[0] != n:
        raise ValueError(f"q and k must have the same rows when every row is a query, got {n} and {k.shape[0]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if n == 0:
        return q * 0.0
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    return _RangeAttn.apply(q, k, v, cu, cu, cu, scale, window, True)
