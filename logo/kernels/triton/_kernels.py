"""Triton kernels of the "range attention" family (the host side and the design notes are in `_attn.py`).

Programs walk query *slots* 0..NQ-1 (NQ = every packed row, a static grid). With sparse queries slot i holds
the row ROWS[i]; the first n_sel = CU_Q[NSEQ] slots are the selected rows (read in the kernel, never on the
host), and blocks past n_sel only write zeros. With DENSE_Q, slot i is row i. A query slot sees the packed keys
first .. last: last = its own key row (cu_k[seq] + QPOS[row], or the row itself with DENSE_Q), first = its
sequence's first key, or last - window + 1 when WINDOWED. Slots look their sequence up with a binary search
over cu_seqlens_q inside the kernel, so no per-call block maps are built on the host.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation. PREC "up" (the CPU interpreter with 16-bit inputs, whose tl.dot mishandles
    bf16) multiplies the upcast operands instead: the same products, exact in fp32."""
    if PREC == "up":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _seq_of(rows, CU, NSEQ, STEPS):
    """Per row, the last sequence b with CU[b] <= row (so empty sequences are skipped). STEPS = ceil(log2 NSEQ)."""
    lo = tl.zeros_like(rows)
    hi = lo + NSEQ
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        go = tl.load(CU + mid) <= rows
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _row_spans(slots, rows, QPOS, CU_Q, CU_K, NSEQ, STEPS, window, WINDOWED: tl.constexpr, DENSE_Q: tl.constexpr):
    """(first, last) packed key rows each query slot (holding packed row `rows`) sees (inclusive)."""
    seq = _seq_of(slots, CU_Q, NSEQ, STEPS)
    first = tl.load(CU_K + seq)
    if DENSE_Q:
        last = rows
    else:
        last = first + tl.load(QPOS + rows)
    if WINDOWED:
        first = tl.maximum(first, last - window + 1)
    return first, last


@triton.jit
def _key_regions(first, last, BN: tl.constexpr):
    """Key blocks of a query block: masked [lo, m_end), unmasked [u0, u1) (every row sees every key), masked
    [u1, hi). Keys after the largest `last` are never visited."""
    lo = (tl.min(first, 0) // BN) * BN
    hi = tl.max(last, 0) + 1
    u0 = tl.maximum(((tl.max(first, 0) + BN - 1) // BN) * BN, lo)
    u1 = tl.maximum(((tl.min(last, 0) + 1) // BN) * BN, u0)
    return lo, tl.minimum(u0, hi), u0, u1, hi


@triton.jit
def _tile(base, n0, offs_n, offs_d, stride, end, MASK: tl.constexpr, TRANS: tl.constexpr):
    """The key/value rows n0 + offs_n starting at `base` (row stride `stride`): (BN, D), or (D, BN) when TRANS.
    With MASK, rows at or after `end` read as zero."""
    if TRANS:
        ptrs = base + offs_n[None, :] * stride + offs_d[:, None]
        row_in = (n0 + offs_n < end)[None, :]
    else:
        ptrs = base + offs_n[:, None] * stride + offs_d[None, :]
        row_in = (n0 + offs_n < end)[:, None]
    if MASK:
        x = tl.load(ptrs, mask=row_in, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _visible(keys, first, last):
    """(rows, keys) mask: key j is visible to query row r iff first[r] <= j <= last[r]."""
    return (keys[None, :] >= first[:, None]) & (keys[None, :] <= last[:, None])


@triton.jit
def _n_queries(CU_Q, NQ, NSEQ, DENSE_Q: tl.constexpr):
    """Number of live query slots: every row (DENSE_Q) or the selected count CU_Q[NSEQ] (device memory)."""
    if DENSE_Q:
        n = NQ
    else:
        n = tl.load(CU_Q + NSEQ)
    return n


@triton.jit
def _slot_rows(ROWS, slots, NQ, DENSE_Q: tl.constexpr):
    """The packed row held by each slot (slots past NQ read row 0; callers mask them)."""
    if DENSE_Q:
        rows = slots
    else:
        rows = tl.load(ROWS + slots, mask=slots < NQ, other=0)
    return rows


@triton.jit
def _program_head_rank(lin, NB, NH, G):
    """(head, rank) of program `lin` in a 1-D grid of NB blocks x NH heads taken in groups of G heads (the last
    group may be smaller): groups one after another, inside a group ranks in order, the group's heads
    interleaved."""
    per_group = G * NB
    g = lin // per_group
    gh = tl.minimum(G, NH - g * G)
    r = lin - g * per_group
    return g * G + r % gh, r // gh


@triton.jit
def _query_block(ROWS, QPOS, CU_Q, CU_K, NQ, NSEQ, STEPS, window, NB, NH, G, WINDOWED: tl.constexpr,
                 DENSE_Q: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's head, query slots, the rows they hold, which are live (< n_sel), their key spans and the
    key regions of the block (all empty when no slot of the block is live).

    Schedule: a 1-D grid of cdiv(NQ, BM) * NH programs taken in groups of G heads; inside a group, program i
    takes rank i // g, head i % g (g = the group's heads), and rank r holds the r-th live block from the end (later
    slots see more keys), then the dead blocks. So the heaviest blocks of G heads start together: with one head
    after another the last head's longest blocks ran alone at the end (8k tokens, 16 heads: ~1.3x the balanced
    time in a simulation of the 132 SMs), while a group small enough for L2 keeps the keys/values it re-reads
    there (the host picks G from their size: `head_group`)."""
    h, rank = _program_head_rank(tl.program_id(0), NB, NH, G)
    nsel = _n_queries(CU_Q, NQ, NSEQ, DENSE_Q)
    nlive = (nsel + BM - 1) // BM
    pid = tl.where(rank < nlive, nlive - 1 - rank, rank)
    slots = pid * BM + tl.arange(0, BM)
    row_ok = slots < nsel
    rows = _slot_rows(ROWS, slots, NQ, DENSE_Q)
    sc = tl.minimum(slots, tl.maximum(nsel - 1, 0))  # dead slots take the last live slot's span
    first, last = _row_spans(sc, _slot_rows(ROWS, sc, NQ, DENSE_Q), QPOS, CU_Q, CU_K, NSEQ, STEPS, window,
                             WINDOWED, DENSE_Q)
    lo, m_end, u0, u1, hi = _key_regions(first, last, BN)
    live = pid * BM < nsel
    m_end = tl.where(live, m_end, lo)
    u0 = tl.where(live, u0, lo)
    u1 = tl.where(live, u1, lo)
    hi = tl.where(live, hi, lo)
    return h, slots, rows, row_ok, first, last, lo, m_end, u0, u1, hi


# ----------------------------------------------------------------------------------------------------------
# forward: one program per (query block, head)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, first, last, k_head, v_head, sk_n, sv_n, start, end, hi, qk_scale, KD, VD, col,
               MASK: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr):
    offs_nb = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    kb = k_head + start.to(tl.int64) * sk_n  # block pointers advance in int64 (no 32-bit overflow)
    vb = v_head + start.to(tl.int64) * sv_n
    for n0 in range(start, end, BN):
        if DESC:  # TMA loads of (BN, D) tiles at column col = h * D; rows past the tensor read as zero
            kt = KD.load([n0, col]).T  # (D, BN)
            v = VD.load([n0, col])  # (BN, D)
        else:
            kt = _tile(kb, n0, offs_nb, offs_d, sk_n, hi, MASK, True)  # (D, BN)
            v = _tile(vb, n0, offs_nb, offs_d, sv_n, hi, MASK, False)  # (BN, D)
        s = _dot(q, kt, PREC)  # raw scores; the scale is folded into the max and the exp2 argument (one FMA)
        if MASK:  # (with DESC, keys past `hi` are real rows: masked here, their p is exactly 0)
            s = tl.where(_visible(n0 + offs_nb, first, last), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC)
        m_i = m_new
        kb += BN * sk_n
        vb += BN * sv_n
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["NQ", "NSEQ", "STEPS", "window", "NB", "NH", "G"])
def _fwd_kernel(Q, K, V, O, LSE, ROWS, QPOS, CU_Q, CU_K, NQ, NSEQ, STEPS, window, NB, NH, G,
                sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_n, so_h, qk_scale, KD, VD,
                WINDOWED: tl.constexpr, ONE_LOOP: tl.constexpr, DENSE_Q: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr):
    h, slots, rows, row_ok, first, last, lo, m_end, u0, u1, hi = _query_block(
        ROWS, QPOS, CU_Q, CU_K, NQ, NSEQ, STEPS, window, NB, NH, G, WINDOWED, DENSE_Q, BM, BN)
    if ONE_LOOP:  # every key block through the masked loop (short windows: one pipelined loop, not three)
        m_end, u0, u1 = hi, hi, hi
    offs_d = tl.arange(0, D)
    rows64 = rows.to(tl.int64)
    q = tl.load(Q + rows64[:, None] * sq_n + h * sq_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_head = K + h * sk_h
    v_head = V + h * sv_h
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, first, last, k_head, v_head, sk_n, sv_n, lo, m_end, hi,
                               qk_scale, KD, VD, h * D, True, BN, D, PREC, DESC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, first, last, k_head, v_head, sk_n, sv_n, u0, u1, hi,
                               qk_scale, KD, VD, h * D, False, BN, D, PREC, DESC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, first, last, k_head, v_head, sk_n, sv_n, u1, hi, hi,
                               qk_scale, KD, VD, h * D, True, BN, D, PREC, DESC)
    l_safe = tl.where(row_ok, l_i, 1.0)
    o = tl.where(row_ok[:, None], acc / l_safe[:, None], 0.0)  # dead slots: zero rows
    in_n = slots < NQ
    tl.store(O + rows64[:, None] * so_n + h * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=in_n[:, None])
    tl.store(LSE + h * NQ + slots, tl.where(row_ok, m_i + tl.math.log2(l_safe), 0.0), mask=in_n)


# ----------------------------------------------------------------------------------------------------------
# backward: delta = rowsum(dO * O), the slot-ordered copies and the key rows (in the dQ kernel's prologue)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _delta_and_copies(o, do, q, slots, ok, last, h, H, NQ, NK, DELTA, QC, DOC, KIDX, DENSE_Q: tl.constexpr,
                      COMPACT: tl.constexpr, D: tl.constexpr):
    """The backward's per-slot inputs of a block of query slots of head h (of H), from its o, dO and q tiles
    (BM, D) (zero rows for dead slots): delta = rowsum(dO * O) into DELTA (returned; zero for dead slots, so
    the dK/dV products stay finite there); with COMPACT, q and dO copied into slot order (QC, DOC: contiguous
    (NQ, H, D)) for the dK/dV kernel's TMA loads; for sparse queries, head 0 writes each slot's packed key row
    KIDX (its `last` key, or NK for dead slots: ascending), which `_split_kernel` searches and the dK/dV
    kernel's masks read."""
    in_n = slots < NQ
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h * NQ + slots, delta, mask=in_n)
    if COMPACT:
        dst = slots.to(tl.int64)[:, None] * (H * D) + h * D + tl.arange(0, D)[None, :]
        tl.store(QC + dst, q, mask=in_n[:, None])
        tl.store(DOC + dst, do, mask=in_n[:, None])
    if not DENSE_Q:
        if h == 0:
            tl.store(KIDX + slots, tl.where(ok, last, NK), mask=in_n)
    return delta


@triton.jit(do_not_specialize=["NQ", "NK", "NBK", "QSTEPS"])
def _split_kernel(KIDX, SPLIT, NQ, NK, NBK, QSTEPS, BN: tl.constexpr, BLOCK: tl.constexpr):
    """Per KV block b of BN keys, the first query slot whose key row is at or after the block's first key
    (SPLIT[b]) and its last key (SPLIT[NBK + b]): a lower-bound binary search over the ascending KIDX (NQ,), with
    QSTEPS = bit_length(NQ) halvings (the same as `torch.searchsorted(kidx, bounds)`)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    blk = tl.where(i < NBK, i, i - NBK)
    start = blk * BN
    bound = tl.where(i < NBK, start, tl.minimum(start + BN - 1, NK - 1))
    lo = tl.zeros_like(i)
    hi = lo + NQ
    for _ in range(QSTEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        less = tl.load(KIDX + mid, mask=active, other=0) < bound
        lo = tl.where(active & less, mid + 1, lo)
        hi = tl.where(active & ~less, mid, hi)
    tl.store(SPLIT + i, lo, mask=i < 2 * NBK)


# ----------------------------------------------------------------------------------------------------------
# backward: dQ, one program per (query block, head); mirrors the forward traversal
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _dq_inner(dq, q, do, first, last, lse, delta, k_head, v_head, sk_n, sv_n, start, end, hi, qk_scale,
              MASK: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    offs_nb = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    kb = k_head + start.to(tl.int64) * sk_n  # block pointers advance in int64 (no 32-bit overflow)
    vb = v_head + start.to(tl.int64) * sv_n
    for n0 in range(start, end, BN):
        k = _tile(kb, n0, offs_nb, offs_d, sk_n, hi, MASK, False)  # (BN, D)
        vt = _tile(vb, n0, offs_nb, offs_d, sv_n, hi, MASK, True)  # (D, BN)
        s = _dot(q, tl.trans(k), PREC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASK:
            p = tl.where(_visible(n0 + offs_nb, first, last), p, 0.0)
        dp = _dot(do, vt, PREC)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PREC)
        kb += BN * sk_n
        vb += BN * sv_n
    return dq


@triton.jit(do_not_specialize=["NQ", "NSEQ", "NK", "STEPS", "window", "NB", "NH", "G"])
def _dq_kernel(Q, K, V, O, DO, DQ, LSE, DELTA, QC, DOC, KIDX, ROWS, QPOS, CU_Q, CU_K, NQ, NSEQ, NK, STEPS, window,
               NB, NH, G, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_n, so_h, sdo_n, sdo_h, sdq_n, sdq_h, qk_scale, scale,
               WINDOWED: tl.constexpr, ONE_LOOP: tl.constexpr, DENSE_Q: tl.constexpr, COMPACT: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    """dQ of the block's slots; its prologue also writes what the dK/dV kernel reads (`_delta_and_copies`), which
    the grid covers slot by slot and head by head (dead blocks included), so no separate delta pass is needed."""
    h, slots, rows, row_ok, first, last, lo, m_end, u0, u1, hi = _query_block(
        ROWS, QPOS, CU_Q, CU_K, NQ, NSEQ, STEPS, window, NB, NH, G, WINDOWED, DENSE_Q, BM, BN)
    if ONE_LOOP:
        m_end, u0, u1 = hi, hi, hi
    offs_d = tl.arange(0, D)
    rows64 = rows.to(tl.int64)
    q = tl.load(Q + rows64[:, None] * sq_n + h * sq_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + rows64[:, None] * sdo_n + h * sdo_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    o = tl.load(O + rows64[:, None] * so_n + h * so_h + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = _delta_and_copies(o, do, q, slots, row_ok, last, h, NH, NQ, NK, DELTA, QC, DOC, KIDX, DENSE_Q,
                              COMPACT, D)
    lse = tl.load(LSE + h * NQ + slots, mask=row_ok, other=0.0)
    k_head = K + h * sk_h
    v_head = V + h * sv_h
    dq = tl.zeros([BM, D], tl.float32)
    dq = _dq_inner(dq, q, do, first, last, lse, delta, k_head, v_head, sk_n, sv_n, lo, m_end, hi, qk_scale,
                   True, BN, D, PREC)
    dq = _dq_inner(dq, q, do, first, last, lse, delta, k_head, v_head, sk_n, sv_n, u0, u1, hi, qk_scale,
                   False, BN, D, PREC)
    dq = _dq_inner(dq, q, do, first, last, lse, delta, k_head, v_head, sk_n, sv_n, u1, hi, hi, qk_scale,
                   True, BN, D, PREC)
    dq = tl.where(row_ok[:, None], dq * scale, 0.0)  # dead slots: unselected rows get zero gradient
    tl.store(DQ + rows64[:, None] * sdq_n + h * sdq_h + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=(slots < NQ)[:, None])


# ----------------------------------------------------------------------------------------------------------
# backward: dK, dV, one program per (KV block, head)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_inner(dk, dv, k, v, keys, kend, qend, Q, DO, LSE, DELTA, KIDX, ROWS, h, NQ, sq_n, sq_h, sdo_n, sdo_h,
                start, end, qk_scale, window, QD, DOD, WINDOWED: tl.constexpr, DENSE_Q: tl.constexpr,
                MASK: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr):
    offs_mb = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    for m0 in range(start, end, BM):
        rows = m0 + offs_mb  # query slots
        rows64 = _slot_rows(ROWS, rows, NQ, DENSE_Q).to(tl.int64)  # the packed rows they hold
        if MASK:
            rin = rows < NQ
        if DESC:  # TMA loads of slot-ordered q and dO (slots past NQ read as zero)
            qt = QD.load([m0, h * D]).T  # (D, BM)
            do = DOD.load([m0, h * D])  # (BM, D)
        elif MASK:
            qt = tl.load(Q + rows64[None, :] * sq_n + h * sq_h + offs_d[:, None], mask=rin[None, :], other=0.0)
            do = tl.load(DO + rows64[:, None] * sdo_n + h * sdo_h + offs_d[None, :], mask=rin[:, None], other=0.0)
        else:
            qt = tl.load(Q + rows64[None, :] * sq_n + h * sq_h + offs_d[:, None])
            do = tl.load(DO + rows64[:, None] * sdo_n + h * sdo_h + offs_d[None, :])
        if MASK:
            lse = tl.load(LSE + h * NQ + rows, mask=rin, other=0.0)
            delta = tl.load(DELTA + h * NQ + rows, mask=rin, other=0.0)
        else:
            lse = tl.load(LSE + h * NQ + rows)
            delta = tl.load(DELTA + h * NQ + rows)
        st = _dot(k, qt, PREC) * qk_scale  # (BN, BM)
        pt = tl.math.exp2(st - lse[None, :])
        if MASK:
            # key j is seen by row r iff r's key row is at or after j, within the window, in j's sequence
            if DENSE_Q:
                kr = rows
                same = rows[None, :] < kend[:, None]
            else:
                kr = tl.load(KIDX + rows, mask=rin, other=-1)
                same = rows[None, :] < qend[:, None]
            vis = (kr[None, :] >= keys[:, None]) & same & rin[None, :]
            if WINDOWED:
                vis = vis & (kr[None, :] - keys[:, None] < window)
            pt = tl.where(vis, pt, 0.0)
        dv += _dot(pt.to(do.dtype), do, PREC)
        dpt = _dot(v, tl.trans(do), PREC)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(qt.dtype), tl.trans(qt), PREC)
    return dk, dv


@triton.jit(do_not_specialize=["NQ", "NK", "NBK", "NSEQ", "STEPS", "window", "NH", "G"])
def _dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, KIDX, SPLIT, ROWS, CU_Q, CU_K, NQ, NK, NBK, NSEQ, STEPS,
                 window, NH, G, QD, DOD, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sdo_n, sdo_h, sdk_n, sdk_h, sdv_n, sdv_h,
                 qk_scale, scale, WINDOWED: tl.constexpr, ONE_LOOP: tl.constexpr, DENSE_Q: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, DESC: tl.constexpr):
    # 1-D grid of NBK * NH programs in groups of G heads (see _query_block): early key blocks are seen by the
    # most rows, so they go first
    h, pid = _program_head_rank(tl.program_id(0), NBK, NH, G)
    keys = pid * BN + tl.arange(0, BN)
    kin = keys < NK
    kc = tl.minimum(keys, NK - 1)
    kseq = _seq_of(kc, CU_K, NSEQ, STEPS)
    kend = tl.load(CU_K + kseq + 1)  # end of each key's sequence (keys)
    qend = tl.load(CU_Q + kseq + 1)  # end of each key's sequence (query rows)
    one_seq = tl.min(kseq, 0) == tl.max(kseq, 0)
    klast = tl.max(kc, 0)
    if DENSE_Q:  # query row index == key row index
        reach = kend
        if WINDOWED:
            reach = tl.minimum(kend, kc + window)
        qa = pid * BN
        qz = tl.max(reach, 0)
        full_lo = klast
        full_hi = tl.min(reach, 0)
    else:  # query slots: the first slots at or after the block's first / last key come from a searchsorted
        qa = tl.load(SPLIT + pid)
        full_lo = tl.load(SPLIT + NBK + pid)
        qz = tl.max(qend, 0)
        full_hi = tl.min(qend, 0)
    full_hi = tl.where(one_seq, full_hi, full_lo)  # a block spanning two sequences has no fully visible row
    u0 = tl.minimum(qa + ((tl.maximum(full_lo - qa, 0) + BM - 1) // BM) * BM, qz)
    u1 = u0 + (tl.maximum(full_hi - u0, 0) // BM) * BM
    if ONE_LOOP:
        u0, u1 = qz, qz

    offs_d = tl.arange(0, D)
    keys64 = keys.to(tl.int64)
    k = tl.load(K + keys64[:, None] * sk_n + h * sk_h + offs_d[None, :], mask=kin[:, None], other=0.0)
    v = tl.load(V + keys64[:, None] * sv_n + h * sv_h + offs_d[None, :], mask=kin[:, None], other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    dk, dv = _dkdv_inner(dk, dv, k, v, keys, kend, qend, Q, DO, LSE, DELTA, KIDX, ROWS, h, NQ, sq_n, sq_h, sdo_n,
                         sdo_h, qa, u0, qk_scale, window, QD, DOD, WINDOWED, DENSE_Q, True, BM, D, PREC, DESC)
    dk, dv = _dkdv_inner(dk, dv, k, v, keys, kend, qend, Q, DO, LSE, DELTA, KIDX, ROWS, h, NQ, sq_n, sq_h, sdo_n,
                         sdo_h, u0, u1, qk_scale, window, QD, DOD, WINDOWED, DENSE_Q, False, BM, D, PREC, DESC)
    dk, dv = _dkdv_inner(dk, dv, k, v, keys, kend, qend, Q, DO, LSE, DELTA, KIDX, ROWS, h, NQ, sq_n, sq_h, sdo_n,
                         sdo_h, u1, qz, qk_scale, window, QD, DOD, WINDOWED, DENSE_Q, True, BM, D, PREC, DESC)
    tl.store(DK + keys64[:, None] * sdk_n + h * sdk_h + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=kin[:, None])
    tl.store(DV + keys64[:, None] * sdv_n + h * sdv_h + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kin[:, None])
