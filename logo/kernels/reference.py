"""Pure-PyTorch reference of the attention ops LoGo needs (the CPU path and the kernels' test oracle).

Static-shape contract (shared with `logo.kernels.triton` and the custom ops in `logo.kernels.ops`):

- ``query_sparse_attention(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale=None) -> o (N, H, D)``
  q (N, H, D): a query for every packed row (only selected rows are read); k, v (Nk, H, D): every key/value,
  packed; q_pos (N,) int32: each row's position inside its sequence; rows (N,) int32: a permutation of the
  rows, the selected ones first, in sequence then position order (slot i < n_sel holds a selected row);
  cu_seqlens_q (S+1,) int32: offsets of each sequence's selected rows among the slots (its last entry is
  n_sel, which stays on the device); cu_seqlens_k (S+1,) int32 offsets of the keys. A selected row r of
  sequence b attends keys 0..q_pos[r] of sequence b; unselected rows of o are zero.
- ``sliding_window_attention(q, k, v, cu_seqlens, window, scale=None) -> o``: (N, H, D) packed; token t
  attends keys max(0, t-window+1)..t of its own sequence.

Both are exact softmax attention. They run over query chunks with an online-softmax-free two-pass scheme
(forward keeps only o and the log-sum-exp; backward recomputes the probabilities chunk by chunk), so
memory stays O(chunk x keys-in-reach) rather than O(T^2) per head, and they are differentiable in q, k, v.
Computation happens in float32 (float64 inputs stay float64); outputs have the input dtype.
`attn_forward` / `attn_backward` are the op pair behind the custom ops (same signatures as the Triton host
functions); this reference reads n_sel on the host, the kernels do not.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

# Upper bound on the (H, chunk, keys) score block, in elements (64 MiB of float32).
_BLOCK_ELEMS = 16 * 1024 * 1024


def check_inputs(q, k, v, q_pos, rows, cu_q, cu_k):
    """Shape checks of the op contract, on shapes only (no host sync): a one-line ValueError naming the value."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (N, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, t in (("q_pos", q_pos), ("rows", rows)):
        if t is not None and t.shape != (q.shape[0],):
            raise ValueError(f"{name} must be ({q.shape[0]},), got {tuple(t.shape)}")
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q {tuple(cu_q.shape)} and cu_seqlens_k {tuple(cu_k.shape)} must be (B+1,)")


def _check_values(q, k, rows, cu_q, cu_k):
    """Value checks (host reads: the reference only)."""
    if int(cu_q[-1]) > q.shape[0] or int(cu_k[-1]) != k.shape[0]:
        raise ValueError(f"cu_seqlens end at {int(cu_q[-1])}/{int(cu_k[-1])} but q/k have "
                         f"{q.shape[0]}/{k.shape[0]} rows")
    if rows is not None and not torch.equal(rows.long().sort().values, torch.arange(q.shape[0], device=rows.device)):
        raise ValueError("rows must be a permutation of the packed rows (selected rows first)")


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


def _cdt(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _range_forward(q, k, v, lo, hi, scale):
    """Softmax attention where query i sees the packed key range [lo[i], hi[i]]: o (Nq, H, D) in the compute
    dtype and the natural log-sum-exp (H, Nq)."""
    cdt = _cdt(q)
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
    return out, lse


def _range_backward(dout, q, k, v, out, lse, lo, hi, scale):
    """Gradients of `_range_forward` (recomputes the probabilities chunk by chunk): dq, dk, dv."""
    cdt = lse.dtype
    qf, kf, vf, do = q.to(cdt), k.to(cdt), v.to(cdt), dout.to(cdt)
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    delta = (do * out.to(cdt)).sum(-1).transpose(0, 1)  # (H, Nq)
    for q0, q1, k0, k1 in _chunks(lo, hi, q.shape[1]):
        s = _scores(qf[q0:q1], kf[k0:k1], lo[q0:q1], hi[q0:q1], k0, scale)
        p = torch.exp(s - lse[:, q0:q1, None])  # (H, Cq, Ck)
        doc = do[q0:q1]
        dv[k0:k1] += torch.einsum("hqk,qhd->khd", p, doc)
        dp = torch.einsum("qhd,khd->hqk", doc, vf[k0:k1])
        ds = p * (dp - delta[:, q0:q1, None]) * scale
        dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, kf[k0:k1])
        dk[k0:k1] += torch.einsum("hqk,qhd->khd", ds, qf[q0:q1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RangeAttention(torch.autograd.Function):
    """Softmax attention where query i sees the contiguous packed key range [lo[i], hi[i]] (compacted rows)."""

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, scale):
        out, lse = _range_forward(q, k, v, lo, hi, scale)
        ctx.save_for_backward(q, k, v, lo, hi, out, lse)
        ctx.scale = scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lo, hi, out, lse = ctx.saved_tensors
        return (*_range_backward(dout, q, k, v, out, lse, lo, hi, ctx.scale), None, None, None)


_LN2 = math.log(2.0)


def _slots(q, q_pos, rows, cu_q, cu_k, window):
    """Selected rows (n_sel,) int64 in slot order and each one's key range [lo, hi]. rows None: every row a
    query (dense: sliding window / causal)."""
    if rows is None:
        q_pos, rows, cu_q = positions_in_sequence(cu_k, q.shape[0]), torch.arange(q.shape[0]), cu_k
    idx = rows.long()[:int(cu_q[-1])].to(q.device)
    lo, hi = _key_ranges(q_pos.long()[idx], cu_q, cu_k, window)
    return idx, lo, hi


def attn_forward(q, k, v, q_pos, rows, cu_q, cu_k, scale: float, window: int):
    """o (N, H, D) in q's dtype (zero at unselected rows) and lse2 (H, N), the base-2 log-sum-exp of the
    scaled scores per slot (zero past n_sel). window 0: causal; rows None: every row a query."""
    idx, lo, hi = _slots(q, q_pos, rows, cu_q, cu_k, window or None)
    o = q.new_zeros(q.shape)  # contiguous whatever q's strides (the op's fake output)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=_cdt(q), device=q.device)
    if idx.numel():
        out_c, lse_c = _range_forward(q[idx], k, v, lo, hi, scale)
        o[idx] = out_c.to(q.dtype)
        lse[:, :idx.shape[0]] = lse_c / _LN2
    return o, lse


def attn_backward(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, scale: float, window: int):
    """dq (zero at unselected rows), dk, dv of `attn_forward`."""
    idx, lo, hi = _slots(q, q_pos, rows, cu_q, cu_k, window or None)
    dq = q.new_zeros(q.shape)  # outputs contiguous whatever the inputs' strides (the op's fake outputs)
    if not idx.numel():
        return dq, k.new_zeros(k.shape), v.new_zeros(v.shape)
    dqc, dk, dv = _range_backward(do[idx], q[idx], k, v, o[idx], lse[:, :idx.shape[0]] * _LN2, lo, hi, scale)
    dq[idx] = dqc
    return dq, dk.contiguous(), dv.contiguous()


class _StaticAttention(torch.autograd.Function):
    """`attn_forward` with its backward: the reference ops as plain autograd (the kernels' oracle)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, rows, cu_q, cu_k, scale, window):
        o, lse = attn_forward(q, k, v, q_pos, rows, cu_q, cu_k, scale, window)
        ctx.save_for_backward(q, k, v, o, lse, q_pos, rows, cu_q, cu_k)
        ctx.cfg = (scale, window)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, q_pos, rows, cu_q, cu_k = ctx.saved_tensors
        return (*attn_backward(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, *ctx.cfg), *(None,) * 6)


def query_sparse_attention(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale: Optional[float] = None):
    """Causal attention of the selected rows (rows[:cu_seqlens_q[-1]]) over dense keys/values: (N, H, D), zero
    at unselected rows. See the module docstring for the contract."""
    check_inputs(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k)
    _check_values(q, k, rows, cu_seqlens_q, cu_seqlens_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _StaticAttention.apply(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale, 0)


def sliding_window_attention(q, k, v, cu_seqlens, window: int, scale: Optional[float] = None):
    """Causal sliding-window attention over packed sequences. Returns (N, H, D)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    check_inputs(q, k, v, None, None, cu_seqlens, cu_seqlens)
    _check_values(q, k, None, cu_seqlens, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _StaticAttention.apply(q, k, v, None, None, cu_seqlens, cu_seqlens, scale, window)


def causal_attention(q, k, v, cu_seqlens, scale: Optional[float] = None):
    """Dense causal attention inside each packed sequence (every row a query): (N, H, D)."""
    check_inputs(q, k, v, None, None, cu_seqlens, cu_seqlens)
    _check_values(q, k, None, cu_seqlens, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _StaticAttention.apply(q, k, v, None, None, cu_seqlens, cu_seqlens, scale, 0)


def decode_attention(q, k, v, lengths, active, scale: Optional[float] = None) -> torch.Tensor:
    """One query per row over that row's cache (decoding): q (B, H, D); k, v (B, H, S, D) the static caches; row b
    attends its keys 0..lengths[b]-1; rows with active[b] False (and rows with no key) give zeros. (B, H, D) in
    q's dtype, computed in at least fp32 over the whole static capacity (the kernel skips what is masked). Static
    shapes, no host synchronisation (`logo.kernels.triton._decode` is the GPU kernel)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cdt = _cdt(q)
    s = torch.einsum("bhd,bhsd->bhs", q.to(cdt), k.to(cdt)) * scale  # (B, H, S)
    seen = (torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]) & active[:, None]  # (B, S)
    s = s.masked_fill(~seen[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))  # (B, H, S); zero where unseen
    o = torch.einsum("bhs,bhsd->bhd", e, v.to(cdt)) / e.sum(-1, keepdim=True).clamp_min(torch.finfo(cdt).tiny)
    return o.to(q.dtype)


def positions_in_sequence(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int32 position of each packed row inside its sequence."""
    idx = torch.arange(n, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), idx, right=True)
    return (idx - cu_seqlens.long()[seq]).to(torch.int32)


# ----------------------------------------------------------------------------------------------------------
# The LoGo layer's branch inputs: RoPE of x and of its per-head transform x A_h, and v A_h
# (logo::rope_transform_*)
# ----------------------------------------------------------------------------------------------------------
def _rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) of row n rotated by the angles of cos/sin row n mod T: x (N, H, D) in at least
    fp32, cos/sin (T, D/2)."""
    xf = x.unflatten(0, (-1, cos.shape[0])).unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    c, s = cos[:, None, :].to(xf.dtype), sin[:, None, :].to(xf.dtype)  # (T, 1, D/2)
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).flatten(0, 1)


def _transform(x, A):
    """x A_h per head in at least fp32: x (N, H, D), A (H, D, D) rounded to x's dtype first."""
    xf = x.to(_cdt(x))
    return torch.einsum("nhd,hde->nhe", xf, A.to(x.dtype).to(xf.dtype))


def _rope_transform_one(x, A, cos, sin):
    return _rope_rows(x.to(_cdt(x)), cos, sin).to(x.dtype), _rope_rows(_transform(x, A), cos, sin).to(x.dtype)


def rope_transform_forward(q, k, v, A, cos, sin):
    """RoPE(q), RoPE(k), RoPE(q A_0), RoPE(k A_1), v A_2 (not rotated): five (N, H, D) tensors in q's dtype, for
    q, k, v (N, H, D), A (3, H, D, D), cos/sin (T, D/2) with T dividing N (row n has the angles of position n mod
    T). Computed in at least fp32 with A rounded to q's dtype first (as the kernel and the unfused path multiply);
    each output rounded once (v A_2 as the unfused einsum rounds it)."""
    (qr, qy), (kr, ky) = _rope_transform_one(q, A[0], cos, sin), _rope_transform_one(k, A[1], cos, sin)
    vy = _transform(v, A[2]).to(v.dtype)
    return qr.contiguous(), kr.contiguous(), qy.contiguous(), ky.contiguous(), vy.contiguous()


def _unrope_rows(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation (the transpose of `_rope_rows`, by the negated angles): the gradient of x from the
    gradient of RoPE(x)."""
    return _rope_rows(g, cos, -sin)


def _transform_grad(g, x, A):
    """The gradients g A_h^T of x and x^T g of A (summed over the rows) of y = x A_h, given y's gradient g
    (N, H, D) in at least fp32; in g's dtype."""
    return torch.einsum("nhe,hde->nhd", g, A.to(x.dtype).to(g.dtype)), torch.einsum("nhd,nhe->hde", x.to(g.dtype), g)


def _rope_transform_grad_one(gx, gy, x, A, cos, sin):
    cdt = _cdt(x)
    dxy, dA = _transform_grad(_unrope_rows(gy.to(cdt), cos, sin), x, A)
    return (_unrope_rows(gx.to(cdt), cos, sin) + dxy).to(x.dtype), dA


def rope_transform_backward(gq, gk, gqy, gky, gvy, q, k, v, A, cos, sin, gv=None):
    """dq, dk, dv (N, H, D) in q's dtype and dA (3, H, D, D) in at least fp32 of `rope_transform_forward`, given
    the gradients of its five outputs: with g = RoPE^T(gy) for y = x A_i (g = gy for v), dx = RoPE^T(gx) + g A_i^T
    (dv = g A_2^T, plus gv, v's gradient from elsewhere, when given) and dA_i = sum_rows x^T g (explicit: a custom
    op runs below autograd)."""
    dq, dAq = _rope_transform_grad_one(gq, gqy, q, A[0], cos, sin)
    dk, dAk = _rope_transform_grad_one(gk, gky, k, A[1], cos, sin)
    dv, dAv = _transform_grad(gvy.to(_cdt(v)), v, A[2])
    dv = dv if gv is None else dv + gv.to(dv.dtype)
    return dq.contiguous(), dk.contiguous(), dv.to(v.dtype).contiguous(), torch.stack((dAq, dAk, dAv))


# ----------------------------------------------------------------------------------------------------------
# The LoGo layer's ContextNorms and fusion (logo::context_fuse_*)
# ----------------------------------------------------------------------------------------------------------
def _head_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's D channels, x (N, H, D), weight (H, D); computed in at least fp32, rounded to x's
    dtype (as `logo.model.layers.RMSNorm`)."""
    xf = x.to(_cdt(x))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w.to(xf.dtype)).to(x.dtype)


def gated_fusion(n_local, n_global, p, z, weighted: bool):
    """The LoGo fusion rule (paper Eq. 10) of the normalised branch outputs n_local, n_global (N, H, D), p (N,)
    float, z (N,) bool -> (N, H, D) in n_local's dtype: n_local at unselected rows; at selected rows
    (1 - p) n_local + p n_global (weighted) or n_local + p n_global (additive), summed in at least fp32 and rounded
    once. The layer's (`logo.model.logo_attention.LoGoAttention.fuse`) and the fused kernel's reference."""
    cdt = _cdt(n_local)
    p_ = p[:, None, None].to(cdt)  # (N, 1, 1): the gate's only path into the output, through selected rows
    fused = ((1.0 - p_) * n_local.to(cdt) if weighted else n_local.to(cdt)) + p_ * n_global.to(cdt)
    return torch.where(z[:, None, None], fused.to(n_local.dtype), n_local)


def context_fuse_forward(o_local, o_global, p, z, w_local, w_global, eps: float, weighted: bool):
    """Both ContextNorms (head-wise RMSNorm, weights w_* (H, D), eps) of o_local, o_global (N, H, D), then
    `gated_fusion`: (N, H, D) in o_local's dtype."""
    return gated_fusion(_head_rms_norm(o_local, w_local, eps), _head_rms_norm(o_global, w_global, eps), p, z,
                        weighted)


def _head_rms_norm_backward(gy, x, w, eps: float):
    """dx (x's dtype) and dw (at least fp32) of `_head_rms_norm` for the gradient gy of its output."""
    cdt = _cdt(x)
    xf, gy = x.to(cdt), gy.to(cdt)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (N, H, 1)
    u = gy * w.to(cdt)
    dx = r * u - xf * r.pow(3) * (u * xf).mean(-1, keepdim=True)
    return dx.to(x.dtype), (gy * xf * r).sum(0)


def context_fuse_backward(grad, o_local, o_global, p, z, w_local, w_global, eps: float, weighted: bool):
    """Gradients of `context_fuse_forward`: in o_local, o_global (their dtype), p (its dtype), w_local, w_global
    (at least fp32). The gradient entering each norm is rounded to the branch dtype, as autograd's casts round it
    (explicit formulas: a custom op runs below autograd)."""
    dt, cdt = o_local.dtype, _cdt(o_local)
    n_l, n_g = _head_rms_norm(o_local, w_local, eps).to(cdt), _head_rms_norm(o_global, w_global, eps).to(cdt)
    go, p_, sel = grad.to(cdt), p[:, None, None].to(cdt), z[:, None, None]
    a = (1.0 - p_) if weighted else torch.ones_like(p_)
    g_local = torch.where(sel, (a * go).to(dt), grad.to(dt))  # unselected rows: the output is Norm^L itself
    g_global = torch.where(sel, (p_ * go).to(dt), torch.zeros_like(grad, dtype=dt))
    dp = torch.where(sel, go * ((n_g - n_l) if weighted else n_g), 0.0).sum((1, 2)).to(p.dtype)
    d_local, dw_local = _head_rms_norm_backward(g_local, o_local, w_local, eps)
    d_global, dw_global = _head_rms_norm_backward(g_global, o_global, w_global, eps)
    return d_local, d_global, dp, dw_local, dw_global
