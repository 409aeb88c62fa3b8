"""Triton kernels for LoGo's two attention ops (query-sparse global, sliding-window local), fwd and bwd.

One family of kernels serves both ops. A "range attention" problem is: packed query rows with real positions
`q_pos` (ascending inside each sequence), dense packed keys/values, and per sequence the offsets cu_q / cu_k.
Query at position p sees keys max(0, p - W + 1) .. p of its own sequence (W = 0: no window, i.e. 0 .. p).

- Query-sparse global attention: q = the selected rows, W = 0.
- Sliding-window attention: q = every row (q_pos = position, cu_q = cu_k: `DENSE_Q`), W = window.

Forward and dQ kernels run one program per (query block, head). A query block never straddles sequences;
its smallest/largest real positions (read in the kernel from q_pos) split the key range into
  masked prefix (window only) | unmasked middle (every row sees every key) | masked diagonal,
so only the blocks that can contain a masked element pay for the mask, and keys after the largest
position are never touched.

The dK/dV kernel runs one program per (KV block, head). For each KV block the first query row that can see
it, the first row that sees all of it, the last row that sees all of it and the end of the rows that see any
of it come from one torch.searchsorted over the sorted global positions (precomputed on the GPU, no host
sync); the kernel walks masked query blocks, then unmasked ones, then the masked tail (window only).

All accumulation is float32; scores use exp2 with log2(e) folded into the scale; the log-sum-exp is kept in
base 2 (H, Nq) float32 between forward and backward.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, pos, k_base, v_base, sk_n, sv_n, start, end, hi, qk_scale,
               WINDOW: tl.constexpr, MASK: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               PREC: tl.constexpr):
    offs_nb = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for n0 in range(start, end, BN):
        offs_n = n0 + offs_nb
        if MASK:
            kin = offs_n < hi
            kt = tl.load(k_base + offs_n[None, :] * sk_n + offs_d[:, None], mask=kin[None, :], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * sv_n + offs_d[None, :], mask=kin[:, None], other=0.0)
        else:
            kt = tl.load(k_base + offs_n[None, :] * sk_n + offs_d[:, None])
            v = tl.load(v_base + offs_n[:, None] * sv_n + offs_d[None, :])
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        if MASK:
            vis = offs_n[None, :] <= pos[:, None]
            if WINDOW > 0:
                vis = vis & (offs_n[None, :] > pos[:, None] - WINDOW)
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_split(pmin, pmax, WINDOW: tl.constexpr, BN: tl.constexpr):
    """Key-block boundaries for a query block with positions in [pmin, pmax] (see module docstring)."""
    hi = pmax + 1
    if WINDOW > 0:
        lo = tl.maximum(pmin - WINDOW + 1, 0)
        lo = (lo // BN) * BN
        full_lo = ((tl.maximum(pmax - WINDOW + 1, 0) + BN - 1) // BN) * BN
        full_lo = tl.maximum(full_lo, lo)
    else:
        lo = 0
        full_lo = 0
    full_hi = tl.maximum(((pmin + 1) // BN) * BN, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, QPOS, CU_Q, CU_K, BMAP, NB, NQ,
                sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_n, so_h, qk_scale,
                WINDOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                PREC: tl.constexpr):
    pid = NB - 1 - tl.program_id(0)  # later (longer) blocks first
    h = tl.program_id(1)
    qs = tl.load(BMAP + NB + pid)
    if qs < 0:
        return
    seq = tl.load(BMAP + pid)
    qe = tl.load(CU_Q + seq + 1)
    ks = tl.load(CU_K + seq).to(tl.int64)
    offs_m = qs + tl.arange(0, BM)
    row_ok = offs_m < qe
    pos = tl.load(QPOS + offs_m, mask=row_ok, other=0)
    pmax = tl.max(pos, 0)
    pos = tl.where(row_ok, pos, pmax)
    pmin = tl.min(pos, 0)
    offs_d = tl.arange(0, D)
    offs_m64 = offs_m.to(tl.int64)
    q = tl.load(Q + offs_m64[:, None] * sq_n + h * sq_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = K + ks * sk_n + h * sk_h
    v_base = V + ks * sv_n + h * sv_h
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    lo, full_lo, full_hi, hi = _key_split(pmin, pmax, WINDOW, BN)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, pos, k_base, v_base, sk_n, sv_n, lo, full_lo, hi, qk_scale,
                               WINDOW, True, BN, D, PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, pos, k_base, v_base, sk_n, sv_n, full_lo, full_hi, hi,
                               qk_scale, WINDOW, False, BN, D, PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, pos, k_base, v_base, sk_n, sv_n, full_hi, hi, hi, qk_scale,
                               WINDOW, True, BN, D, PREC)
    o = acc / l_i[:, None]
    tl.store(O + offs_m64[:, None] * so_n + h * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + h * NQ + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


# ----------------------------------------------------------------------------------------------------------
# backward: delta = rowsum(dO * O)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _delta_kernel(O, DO, DELTA, NQ, so_n, so_h, sdo_n, sdo_h, BM: tl.constexpr, D: tl.constexpr):
    h = tl.program_id(1)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    ok = offs_m < NQ
    offs_m64 = offs_m.to(tl.int64)
    offs_d = tl.arange(0, D)
    o = tl.load(O + offs_m64[:, None] * so_n + h * so_h + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + offs_m64[:, None] * sdo_n + h * sdo_h + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(DELTA + h * NQ + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


# ----------------------------------------------------------------------------------------------------------
# backward: dQ (one program per query block and head; mirrors the forward traversal)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _dq_inner(dq, q, do, pos, lse, delta, k_base, v_base, sk_n, sv_n, start, end, hi, qk_scale,
              WINDOW: tl.constexpr, MASK: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    offs_nb = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for n0 in range(start, end, BN):
        offs_n = n0 + offs_nb
        if MASK:
            kin = offs_n < hi
            k = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :], mask=kin[:, None], other=0.0)
            vt = tl.load(v_base + offs_n[None, :] * sv_n + offs_d[:, None], mask=kin[None, :], other=0.0)
        else:
            k = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :])
            vt = tl.load(v_base + offs_n[None, :] * sv_n + offs_d[:, None])
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASK:
            vis = offs_n[None, :] <= pos[:, None]
            if WINDOW > 0:
                vis = vis & (offs_n[None, :] > pos[:, None] - WINDOW)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, QPOS, CU_Q, CU_K, BMAP, NB, NQ,
               sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sdo_n, sdo_h, sdq_n, sdq_h, qk_scale, scale,
               WINDOW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    pid = NB - 1 - tl.program_id(0)
    h = tl.program_id(1)
    qs = tl.load(BMAP + NB + pid)
    if qs < 0:
        return
    seq = tl.load(BMAP + pid)
    qe = tl.load(CU_Q + seq + 1)
    ks = tl.load(CU_K + seq).to(tl.int64)
    offs_m = qs + tl.arange(0, BM)
    row_ok = offs_m < qe
    pos = tl.load(QPOS + offs_m, mask=row_ok, other=0)
    pmax = tl.max(pos, 0)
    pos = tl.where(row_ok, pos, pmax)
    pmin = tl.min(pos, 0)
    offs_d = tl.arange(0, D)
    offs_m64 = offs_m.to(tl.int64)
    q = tl.load(Q + offs_m64[:, None] * sq_n + h * sq_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + offs_m64[:, None] * sdo_n + h * sdo_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + h * NQ + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + h * NQ + offs_m, mask=row_ok, other=0.0)
    k_base = K + ks * sk_n + h * sk_h
    v_base = V + ks * sv_n + h * sv_h
    dq = tl.zeros([BM, D], tl.float32)
    lo, full_lo, full_hi, hi = _key_split(pmin, pmax, WINDOW, BN)
    dq = _dq_inner(dq, q, do, pos, lse, delta, k_base, v_base, sk_n, sv_n, lo, full_lo, hi, qk_scale,
                   WINDOW, True, BN, D, PREC)
    dq = _dq_inner(dq, q, do, pos, lse, delta, k_base, v_base, sk_n, sv_n, full_lo, full_hi, hi, qk_scale,
                   WINDOW, False, BN, D, PREC)
    dq = _dq_inner(dq, q, do, pos, lse, delta, k_base, v_base, sk_n, sv_n, full_hi, hi, hi, qk_scale,
                   WINDOW, True, BN, D, PREC)
    tl.store(DQ + offs_m64[:, None] * sdq_n + h * sdq_h + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------
# backward: dK, dV (one program per KV block and head)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_inner(dk, dv, k, v, offs_n, Q, DO, LSE, DELTA, QPOS, h, NQ, qe, sq_n, sq_h, sdo_n, sdo_h,
                start, end, qk_scale, WINDOW: tl.constexpr, MASK: tl.constexpr, BM: tl.constexpr,
                D: tl.constexpr, PREC: tl.constexpr):
    offs_mb = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    for m0 in range(start, end, BM):
        offs_m = m0 + offs_mb
        offs_m64 = offs_m.to(tl.int64)
        if MASK:
            rin = offs_m < qe
            qt = tl.load(Q + offs_m64[None, :] * sq_n + h * sq_h + offs_d[:, None], mask=rin[None, :], other=0.0)
            do = tl.load(DO + offs_m64[:, None] * sdo_n + h * sdo_h + offs_d[None, :], mask=rin[:, None],
                         other=0.0)
            lse = tl.load(LSE + h * NQ + offs_m, mask=rin, other=0.0)
            delta = tl.load(DELTA + h * NQ + offs_m, mask=rin, other=0.0)
            pos = tl.load(QPOS + offs_m, mask=rin, other=0)
        else:
            qt = tl.load(Q + offs_m64[None, :] * sq_n + h * sq_h + offs_d[:, None])
            do = tl.load(DO + offs_m64[:, None] * sdo_n + h * sdo_h + offs_d[None, :])
            lse = tl.load(LSE + h * NQ + offs_m)
            delta = tl.load(DELTA + h * NQ + offs_m)
        st = tl.dot(k, qt, input_precision=PREC) * qk_scale  # (BN, BM)
        pt = tl.math.exp2(st - lse[None, :])
        if MASK:
            vis = (offs_n[:, None] <= pos[None, :]) & rin[None, :]
            if WINDOW > 0:
                vis = vis & (offs_n[:, None] > pos[None, :] - WINDOW)
            pt = tl.where(vis, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PREC)
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, QPOS, CU_Q, CU_K, BMAP, QSPLIT, NB, NQ,
                 sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sdo_n, sdo_h, sdk_n, sdk_h, sdv_n, sdv_h, qk_scale, scale,
                 WINDOW: tl.constexpr, DENSE_Q: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 D: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    n0 = tl.load(BMAP + NB + pid)
    if n0 < 0:
        return
    seq = tl.load(BMAP + pid)
    ks = tl.load(CU_K + seq)
    ke = tl.load(CU_K + seq + 1)
    qb0 = tl.load(CU_Q + seq)
    qe = tl.load(CU_Q + seq + 1)
    n0 = n0 - ks  # KV block start, relative to its sequence
    offs_n = n0 + tl.arange(0, BN)
    kin = offs_n < ke - ks
    offs_d = tl.arange(0, D)
    ks64 = ks.to(tl.int64)
    k = tl.load(K + (ks64 + offs_n)[:, None] * sk_n + h * sk_h + offs_d[None, :], mask=kin[:, None], other=0.0)
    v = tl.load(V + (ks64 + offs_n)[:, None] * sv_n + h * sv_h + offs_d[None, :], mask=kin[:, None], other=0.0)
    # query-row boundaries (global row indices): first row seeing the block, first seeing all of it,
    # end of rows seeing all of it, end of rows seeing any of it
    if DENSE_Q:
        nq = qe - qb0
        qa = qb0 + tl.minimum(n0, nq)
        qm1 = qb0 + tl.minimum(n0 + BN - 1, nq)
        if WINDOW > 0:
            qm2 = qb0 + tl.minimum(n0 + WINDOW, nq)
            qz = qb0 + tl.minimum(n0 + BN - 1 + WINDOW, nq)
        else:
            qm2 = qe
            qz = qe
    else:
        qa = tl.minimum(tl.load(QSPLIT + pid), qe)
        qm1 = tl.minimum(tl.load(QSPLIT + NB + pid), qe)
        if WINDOW > 0:
            qm2 = tl.minimum(tl.load(QSPLIT + 2 * NB + pid), qe)
            qz = tl.minimum(tl.load(QSPLIT + 3 * NB + pid), qe)
        else:
            qm2 = qe
            qz = qe
    u1 = tl.minimum(qa + ((tl.maximum(qm1 - qa, 0) + BM - 1) // BM) * BM, qz)  # end of masked head blocks
    u2 = u1 + (tl.maximum(qm2 - u1, 0) // BM) * BM  # end of unmasked blocks (<= qm2 <= qz)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, Q, DO, LSE, DELTA, QPOS, h, NQ, qe, sq_n, sq_h, sdo_n, sdo_h,
                         qa, u1, qk_scale, WINDOW, True, BM, D, PREC)
    dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, Q, DO, LSE, DELTA, QPOS, h, NQ, qe, sq_n, sq_h, sdo_n, sdo_h,
                         u1, u2, qk_scale, WINDOW, False, BM, D, PREC)
    dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, Q, DO, LSE, DELTA, QPOS, h, NQ, qe, sq_n, sq_h, sdo_n, sdo_h,
                         u2, qz, qk_scale, WINDOW, True, BM, D, PREC)
    tl.store(DK + (ks64 + offs_n)[:, None] * sdk_n + h * sdk_h + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kin[:, None])
    tl.store(DV + (ks64 + offs_n)[:, None] * sdv_n + h * sdv_h + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kin[:, None])


# ----------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------
def _cfg(D: int, dtype: torch.dtype, window: int, device: torch.device):
    """Block sizes and launch parameters (fwd, dq, dkdv) for a problem. Overridable through CONFIG_OVERRIDE."""
    if INTERPRET or device.type != "cuda":
        c = dict(fwd=(16, 16, 4, 1), dq=(16, 16, 4, 1), dkdv=(16, 16, 4, 1))
    elif dtype == torch.float32:
        c = dict(fwd=(64, 32, 4, 2), dq=(64, 32, 4, 2), dkdv=(32, 64, 4, 2))
    elif D <= 64:
        c = dict(fwd=(128, 64, 4, 3), dq=(128, 64, 4, 3), dkdv=(64, 128, 4, 3))
    else:
        c = dict(fwd=(128, 64, 8, 3), dq=(128, 64, 8, 3), dkdv=(64, 128, 8, 3))
    key = ("window" if window > 0 else "global", D, dtype)
    for k in (key, ("window" if window > 0 else "global", D), ("window" if window > 0 else "global",)):
        if k in CONFIG_OVERRIDE:
            c = {**c, **CONFIG_OVERRIDE[k]}
            break
    return c


# (kind, D, dtype) / (kind, D) / (kind,) -> {"fwd": (BM, BN, warps, stages), ...}; used by benchmarks/tuning.
CONFIG_OVERRIDE: dict = {}


def block_map(cu: torch.Tensor, n_rows: int, block: int) -> tuple[torch.Tensor, int]:
    """(2*NB,) int32 [seq of each block | first packed row of the block, -1 for unused slots], NB.

    NB = n_rows // block + n_seq is a host-known upper bound on sum(ceil(len_b / block)), so no host sync.
    """
    nseq = cu.shape[0] - 1
    nb = n_rows // block + nseq
    cu64 = cu.long()
    nblk = (cu64[1:] - cu64[:-1] + block - 1) // block
    cum = torch.cumsum(nblk, 0)
    i = torch.arange(nb, device=cu.device)
    seq = torch.searchsorted(cum, i, right=True)
    seqc = seq.clamp_max(nseq - 1)
    start = cu64[seqc] + (i - (cum[seqc] - nblk[seqc])) * block
    start = torch.where(seq < nseq, start, torch.full_like(start, -1))
    return torch.cat([seqc, start]).to(torch.int32), nb


def q_split(q_pos, cu_q, cu_k, kmap, nbk, block_n, window):
    """Per KV block the 4 query-row boundaries for the dK/dV kernel ((4*NB,) int32), by one searchsorted.

    Sorted key: global key index of each selected query (cu_k[seq] + q_pos); ascending since q_pos ascends
    inside each sequence. Values: global key index of the KV block's start, last key, start + W,
    last key + W.
    """
    nq = q_pos.shape[0]
    nseq = cu_q.shape[0] - 1
    seq_q = torch.searchsorted(cu_q[1:].long(), torch.arange(nq, device=q_pos.device), right=True)
    gpos = cu_k.long()[seq_q.clamp_max(nseq - 1)] + q_pos.long()
    n0 = kmap[nbk:].long().clamp_min(0)  # global start of each KV block (unused slots: 0, never read)
    offs = [0, block_n - 1] + ([window, block_n - 1 + window] if window > 0 else [])
    vals = torch.stack([n0 + o for o in offs])
    return torch.searchsorted(gpos, vals).to(torch.int32).reshape(-1)


def _prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_dims(q):
    D = q.shape[-1]
    if D < 16 or D > 256 or (D & (D - 1)) != 0:
        raise ValueError(f"Triton attention supports head dims 16..256 that are powers of two, got {D}")


def _rowmajor(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def attn_forward(q, k, v, q_pos, cu_q, cu_k, scale, window, dense_q):
    """Returns o (Nq, H, D) in q's dtype and lse2 (H, Nq) float32 (base-2 log-sum-exp of scaled scores)."""
    nq, H, D = q.shape
    c = _cfg(D, q.dtype, window, q.device)
    BM, BN, warps, stages = c["fwd"]
    o = torch.empty_like(q)
    lse = torch.empty(H, nq, device=q.device, dtype=torch.float32)
    bmap, nb = block_map(cu_q, nq, BM)
    _fwd_kernel[(nb, H)](q, k, v, o, lse, q_pos, cu_q, cu_k, bmap, nb, nq,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         o.stride(0), o.stride(1), scale * _LOG2E,
                         WINDOW=window, BM=BM, BN=BN, D=D, PREC=_prec(q.dtype), num_warps=warps, num_stages=stages)
    return o, lse


def attn_backward(do, q, k, v, o, lse, q_pos, cu_q, cu_k, scale, window, dense_q):
    nq, H, D = q.shape
    nk = k.shape[0]
    c = _cfg(D, q.dtype, window, q.device)
    do = _rowmajor(do)
    delta = torch.empty(H, nq, device=q.device, dtype=torch.float32)
    _delta_kernel[(triton.cdiv(nq, 64), H)](o, do, delta, nq, o.stride(0), o.stride(1), do.stride(0), do.stride(1),
                                            BM=64, D=D, num_warps=4)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    prec = _prec(q.dtype)
    BM, BN, warps, stages = c["dq"]
    bmap, nb = block_map(cu_q, nq, BM)
    _dq_kernel[(nb, H)](q, k, v, do, dq, lse, delta, q_pos, cu_q, cu_k, bmap, nb, nq,
                        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), scale * _LOG2E, scale,
                        WINDOW=window, BM=BM, BN=BN, D=D, PREC=prec, num_warps=warps, num_stages=stages)
    BM, BN, warps, stages = c["dkdv"]
    kmap, nbk = block_map(cu_k, nk, BN)
    split = kmap if dense_q else q_split(q_pos, cu_q, cu_k, kmap, nbk, BN, window)
    _dkdv_kernel[(nbk, H)](q, k, v, do, dk, dv, lse, delta, q_pos, cu_q, cu_k, kmap, split, nbk, nq,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                           scale * _LOG2E, scale,
                           WINDOW=window, DENSE_Q=dense_q, BM=BM, BN=BN, D=D, PREC=prec,
                           num_warps=warps, num_stages=stages)
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
    if q_pos.shape != (q.shape[0],):
        raise ValueError(f"q_pos must be ({q.shape[0]},), got {tuple(q_pos.shape)}")
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q {tuple(cu_q.shape)} and cu_seqlens_k {tuple(cu_k.shape)} must be (B+1,)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of float16/bfloat16/float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_dims(q)


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


def sliding_window_attention(q, k, v, cu_seqlens, window: int, scale=None):
    """Causal sliding-window attention over packed sequences: (N, H, D). Same contract as the reference."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    cu = cu_seqlens.to(torch.int32).contiguous()
    n = q.shape[0]
    pos = positions(cu, n)
    _validate(q, k, v, pos, cu, cu)
    if k.shape[0] != n:
        raise ValueError(f"q and k must have the same rows for sliding-window attention, got {n} and {k.shape[0]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if n == 0:
        return q * 0.0
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    return _RangeAttn.apply(q, k, v, pos, cu, cu, scale, int(window), True)


def causal_attention(q, k, v, cu_seqlens, scale=None):
    """Dense causal attention inside each packed sequence (every row a query): (N, H, D)."""
    cu = cu_seqlens.to(torch.int32).contiguous()
    pos = positions(cu, q.shape[0])
    _validate(q, k, v, pos, cu, cu)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[0] == 0:
        return q * 0.0
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    return _RangeAttn.apply(q, k, v, pos, cu, cu, scale, 0, True)


def positions(cu: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int32 position of each packed row inside its sequence (GPU, no sync)."""
    idx = torch.arange(n, device=cu.device)
    seq = torch.searchsorted(cu[1:].long(), idx, right=True).clamp_max(cu.shape[0] - 2)
    return (idx - cu.long()[seq]).to(torch.int32)
