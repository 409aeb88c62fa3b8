"""Decode attention: one query per row over that row's key/value cache, split over the keys (FlashDecoding).

`decode_attention(q, k, v, lengths, active, scale)`, the same op as `logo.kernels.reference.decode_attention`:
q (B, H, D); k, v (B, H, S, D) the static caches; row b sees its keys 0..lengths[b]-1; rows with active[b] False
are not computed (zeros). Two launches, static grids (a CUDA graph replays them with new lengths and rows):

- `_partial_kernel`, one program per (row, head, split of CHUNK keys): a program whose row is inactive, or whose
  split starts past the row's length, reads nothing and ends at once (its partial sums are never combined), so
  the work follows the active rows and their lengths; the others keep a running max, sum and weighted value sum
  over their keys (exp2, fp32);
- `_combine_kernel`, one program per (row, head): the splits' partial sums rescaled to one maximum, or zeros for
  an inactive or empty row.
The score is an elementwise product and a row sum (one query: the tensor cores' smallest tile would waste 15 of
16 rows); reading the cache is the cost.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from logo.kernels.triton._launch import launch

_LOG2E = 1.4426950408889634
TARGET_PROGRAMS = 4096  # (row, head, split) programs to aim for: many short ones, so time follows the work done
MIN_CHUNK = 256  # keys per split at least (shorter splits cost more in the combine than they save)
MAX_SPLITS = 128  # splits per (row, head) at most (the combine holds them all at once)


@triton.jit(do_not_specialize=["S", "CHUNK", "NSPLIT"])
def _partial_kernel(Q, K, V, LEN, ACTIVE, M, L, ACC, S, CHUNK, NSPLIT, H, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h,
                    sv_s, scale_log2, D: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = split * CHUNK
    n = tl.where(tl.load(ACTIVE + b) != 0, tl.load(LEN + b), 0)  # an inactive row has no keys to read
    end = tl.maximum(tl.minimum(start + CHUNK, n), start)  # a split past the row's length: an empty loop
    d = tl.arange(0, D)
    q = tl.load(Q + b * sq_b + h * sq_h + d).to(tl.float32)
    m_i = tl.full([], -float("inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for k0 in range(start, end, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        inside = keys < end
        kt = tl.load(K + b * sk_b + h * sk_h + keys[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0)
        s = tl.where(inside, tl.sum(kt.to(tl.float32) * q[None, :], 1) * scale_log2, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        vt = tl.load(V + b * sv_b + h * sv_h + keys[:, None] * sv_s + d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    slot = bh * NSPLIT + split
    tl.store(M + slot, m_i)
    tl.store(L + slot, l_i)
    tl.store(ACC + slot * D + d, acc)


@triton.jit(do_not_specialize=["CHUNK", "NSPLIT"])
def _combine_kernel(M, L, ACC, LEN, ACTIVE, O, CHUNK, NSPLIT, H, so_b, so_h, D: tl.constexpr, BLOCK_S: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    n = tl.load(LEN + b)
    used = tl.where(tl.load(ACTIVE + b) != 0, (n + CHUNK - 1) // CHUNK, 0)  # splits that ran for this row
    out = tl.zeros([D], dtype=tl.float32)
    if used > 0:
        sp = tl.arange(0, BLOCK_S)
        ran = sp < used
        m = tl.load(M + bh * NSPLIT + sp, mask=ran, other=-float("inf"))
        l = tl.load(L + bh * NSPLIT + sp, mask=ran, other=0.0)
        w = tl.where(ran, tl.exp2(m - tl.max(m, 0)), 0.0)
        acc = tl.load(ACC + (bh * NSPLIT + sp[:, None]) * D + d[None, :], mask=ran[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
    tl.store(O + b * so_b + h * so_h + d, out.to(O.dtype.element_ty))


def splits(batch: int, heads: int, capacity: int, block_n: int) -> tuple[int, int]:
    """(CHUNK keys per split, number of splits) for a cache of `capacity` positions: about TARGET_PROGRAMS
    programs over all rows and heads (each a short, equal piece of work, so skipped rows and short rows shorten the
    step), chunks of MIN_CHUNK..capacity keys and a multiple of block_n, at most MAX_SPLITS. From shapes only."""
    want = max(1, TARGET_PROGRAMS // max(batch * heads, 1))
    chunk = max(MIN_CHUNK, triton.cdiv(capacity, want), triton.cdiv(capacity, MAX_SPLITS))
    chunk = triton.cdiv(chunk, block_n) * block_n
    return chunk, triton.cdiv(capacity, chunk)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     active: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, D) in q's dtype; see the module docstring. k, v may be any (B, H, S, D) view with a contiguous D;
    lengths (B,) any integer dtype, active (B,) bool (read as they are: no conversion kernels)."""
    B, H, D = q.shape
    S = k.shape[2]
    block_n = 64 if D <= 128 else 32
    chunk, nsplit = splits(B, H, S, block_n)
    m = torch.empty(B * H * nsplit, device=q.device, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = torch.empty(B * H * nsplit, D, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    launch(_partial_kernel, (B * H, nsplit), q, k, v, lengths, active, m, l_sum, acc, S, chunk, nsplit, H,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           scale * _LOG2E, D=D, BLOCK_N=block_n, num_warps=4)
    launch(_combine_kernel, (B * H,), m, l_sum, acc, lengths, active, out, chunk, nsplit, H, out.stride(0),
           out.stride(1), D=D, BLOCK_S=triton.next_power_of_2(nsplit), num_warps=4)
    return out
