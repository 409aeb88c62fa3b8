"""Pure-PyTorch reference of the two attention ops LoGo needs (the CPU path and the kernels' test oracle).

Varlen contract (shared with `logo.kernels.triton`):

- ``query_sparse_attention(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale=None) -> o``
  q (Nq, H, D): the selected queries of all sequences, packed in sequence order; k, v (Nk, H, D): every
  key/value, packed; q_pos (Nq,) int32: each query's position inside its sequence; cu_seqlens_q,
  cu_seqlens_k (B+1,) int32 offsets. Query i of sequence b attends keys 0..q_pos[i] of sequence b.
- ``sliding_window_attention(q, k, v, cu_seqlens, window, scale=None) -> o``: (N, H, D) packed; token t
  attends keys max(0, t-window+1)..t of its own sequence.

Both are exact softmax attention. They run over query chunks with an online-softmax-free two-pass scheme
(forward keeps only o and the log-sum-exp; backward recomputes the probabilities chunk by chunk), so
memory stays O(chunk x keys-in-reach) rather than O(T^2) per head, and they are differentiable in q, k, v.
Computation happens in float32 (float64 inputs stay float64); outputs have the input dtype.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

# Upper bound on the (H, chunk, keys) score block, in elements (64 MiB of float32).
_BLOCK_ELEMS = 16 * 1024 * 1024


def _check(q, k, v, q_pos, cu_q, cu_k):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (N, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_pos.shape != (q.shape[0],):
        raise ValueError(f"q_pos must be ({q.shape[0]},), got {tuple(q_pos.shape)}")
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_q.shape)} and cu_seqlens_k {tuple(cu_k.shape)} must be (B+1,)")
    if int(cu_q[-1]) != q.shape[0] or int(cu_k[-1]) != k.shape[0]:
        raise ValueError(f"cu_seqlens end at {int(cu_q[-1])}/{int(cu_k[-1])} but q/k have "
                         f"{q.shape[0]}/{k.shape[0]} rows")


def _key_ranges(q_pos, cu_q, cu_k, window: Optional[int]):
    """Per query, the inclusive packed-key range [lo, hi] it may attend to."""
    nq = q_pos.shape[0]
    seq = torch.searchsorted(cu_q[1:].long(), torch.arange(nq, device=q_pos.device), right=True)
    k_start = cu_k.long()[seq]
    k_len = (cu_k.long()[1:] - cu_k.long()[:-1])[seq]
    pos = q_pos.long()
    if nq and (bool((pos < 0).any()) or bool((pos >= k_len).any())):
        raise ValueError("q_pos holds a position outside its sequence's keys")
    lo = pos - (window - 1) if window is not None else torch.zeros_like(pos)
    return k_start + lo.clamp_min(0), k_start + pos


def _chunks(lo, hi, heads):
    """Yield (q0, q1, k0, k1): query blocks and the packed key span [k0, k1) they reach.

    The block size keeps the (H, block, span) score tile near _BLOCK_ELEMS elements.
    """
    n = lo.shape[0]
    span = int((hi - lo).max()) + 1
    block = max(1, min(256, _BLOCK_ELEMS // max(1, heads * (span + 256))))
    starts = list(range(0, n, block))
    k0s = [int(x) for x in torch.stack([lo[i:i + block].min() for i in starts]).tolist()]
    k1s = [int(x) for x in torch.stack([hi[i:i + block].max() for i in starts]).tolist()]
    for i, k0, k1 in zip(starts, k0s, k1s):
        yield i, min(i + block, n), k0, k1 + 1


def _scores(qc, kc, lo_c, hi_c, k0, scale):
    s = torch.einsum("qhd,khd->hqk", qc, kc) * scale  # (H, Cq, Ck)
    kidx = torch.arange(k0, k0 + kc.shape[0], device=qc.device)
    allowed = (kidx[None, :] >= lo_c[:, None]) & (kidx[None, :] <= hi_c[:, None])  # (Cq, Ck)
    return s.masked_fill(~allowed[None], float("-inf"))


class _RangeAttention(torch.autograd.Function):
    """Softmax attention where query i sees the contiguous packed key range [lo[i], hi[i]]."""

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, scale):
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf, vf = q.to(cdt), k.to(cdt), v.to(cdt)
        out = torch.empty_like(qf)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=cdt, device=q.device)  # (H, Nq)
        for q0, q1, k0, k1 in _chunks(lo, hi, q.shape[1]):
            s = _scores(qf[q0:q1], kf[k0:k1], lo[q0:q1], hi[q0:q1], k0, scale)
            m = s.amax(dim=-1, keepdim=True)
            p = torch.exp(s - m)
            denom = p.sum(dim=-1, keepdim=True)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", p / denom, vf[k0:k1])
            lse[:, q0:q1] = (m + torch.log(denom)).squeeze(-1)
        ctx.save_for_backward(q, k, v, lo, hi, out, lse)
        ctx.scale = scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lo, hi, out, lse = ctx.saved_tensors
        scale = ctx.scale
        cdt = out.dtype
        qf, kf, vf, do = q.to(cdt), k.to(cdt), v.to(cdt), dout.to(cdt)
        dq = torch.zeros_like(qf)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        delta = (do * out).sum(-1).transpose(0, 1)  # (H, Nq)
        for q0, q1, k0, k1 in _chunks(lo, hi, q.shape[1]):
            s = _scores(qf[q0:q1], kf[k0:k1], lo[q0:q1], hi[q0:q1], k0, scale)
            p = torch.exp(s - lse[:, q0:q1, None])  # (H, Cq, Ck)
            doc = do[q0:q1]
            dv[k0:k1] += torch.einsum("hqk,qhd->khd", p, doc)
            dp = torch.einsum("qhd,khd->hqk", doc, vf[k0:k1])
            ds = p * (dp - delta[:, q0:q1, None]) * scale
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, kf[k0:k1])
            dk[k0:k1] += torch.einsum("hqk,qhd->khd", ds, qf[q0:q1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def query_sparse_attention(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale: Optional[float] = None):
    """Causal attention for a packed subset of query rows over dense keys/values. Returns (Nq, H, D)."""
    _check(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.shape[0] == 0:  # no row selected: empty output that still joins the graph
        return q * 0.0
    lo, hi = _key_ranges(q_pos, cu_seqlens_q, cu_seqlens_k, None)
    return _RangeAttention.apply(q, k, v, lo, hi, scale)


def sliding_window_attention(q, k, v, cu_seqlens, window: int, scale: Optional[float] = None):
    """Causal sliding-window attention over packed sequences. Returns (N, H, D)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    pos = positions_in_sequence(cu_seqlens, q.shape[0])
    _check(q, k, v, pos, cu_seqlens, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.shape[0] == 0:
        return q * 0.0
    lo, hi = _key_ranges(pos, cu_seqlens, cu_seqlens, window)
    return _RangeAttention.apply(q, k, v, lo, hi, scale)


def positions_in_sequence(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int32 position of each packed row inside its sequence."""
    idx = torch.arange(n, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), idx, right=True)
    return (idx - cu_seqlens.long()[seq]).to(torch.int32)
