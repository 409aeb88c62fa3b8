"""Triton kernels for `blocks.slot_intervals` and `blocks.tile_lists` (same outputs; `blocks.py` is their
reference): the slots' key intervals and the tile lists of FlashAttention-4's block sparsity in two launches, where
the PyTorch version is ~50 small operations, each with its own host time, on every attention call.

- `_query_tiles_kernel`, one program per query tile of TILE slots: each slot's sequence (binary search over cu_q)
  and key interval, the tile's bounds (lowest / highest first and last of its live slots, whether all are live),
  and, when asked, its lists of key tiles seen in part and whole (a prefix sum over the key tiles packs them left);
  with `longest_first`, program m lays out the slots of the selection's tile mq - 1 - m (`blocks.longest_first`);
- `_key_tiles_kernel`, one program per key tile: from every query tile's bounds, its lists of query tiles (the
  backward's direction).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from logo.kernels.flash import blocks
from logo.kernels.triton._attn import _steps
from logo.kernels.triton._kernels import _row_spans
from logo.kernels.triton._launch import launch

_BIG = tl.constexpr(1 << 30)  # a Triton constant: jit functions read only constexpr globals


@triton.jit
def _sees(lo_min, hi_max, lo_max, hi_min, all_live, start, NK, TILE: tl.constexpr):
    """(part, whole) of key tiles starting at `start` for query tiles with these bounds (broadcast)."""
    start = start + 0 * hi_max  # one shape for every term (either side may be the scalar): masks stay vectors
    end = start + TILE - 1
    seen = (start <= hi_max) & (end >= lo_min)
    whole = (start >= lo_max + _BIG * (1 - all_live)) & (end <= hi_min) & (end < NK)  # not all live: never whole
    return seen & (whole == 0), whole


@triton.jit
def _pack(mask, idx, CNT, IDX, row, STRIDE):
    """Store the indices `idx` where `mask` holds at IDX[row, 0..], packed left in order; the count at CNT[row]."""
    m = mask.to(tl.int32)
    dest = tl.cumsum(m, 0) - 1
    tl.store(IDX + row * STRIDE + dest, idx, mask=mask)
    tl.store(CNT + row, tl.sum(m, 0))


@triton.jit(do_not_specialize=["NQ", "NSEQ", "STEPS", "NK", "MK", "MQ"])
def _query_tiles_kernel(QPOS, ROWS, CU_Q, CU_K, FIRST, LAST, SLOT, SLOT_ROWS, BOUNDS, PC, PI, WC, WI, NQ, NSEQ, STEPS,
                        NK, MK, MQ, LISTS: tl.constexpr, REVERSE: tl.constexpr, TILE: tl.constexpr,
                        BK: tl.constexpr):
    m = tl.program_id(0)
    lane = tl.arange(0, TILE)
    picked = ((MQ - 1 - m) if REVERSE else m) * TILE + lane  # the selection's order: position in `rows`
    slots = m * TILE + lane  # where the kernels see them
    rows = tl.load(ROWS + picked, mask=picked < NQ, other=0)
    tl.store(SLOT + rows, slots, mask=picked < NQ)  # the inverse permutation: each row's slot
    if REVERSE:
        tl.store(SLOT_ROWS + slots, rows, mask=picked < NQ)
    first, last = _row_spans(picked, rows, QPOS, CU_Q, CU_K, NSEQ, STEPS, 0, False, False)
    live = picked < tl.load(CU_Q + NSEQ)
    first = tl.where(live, first, 0)
    last = tl.where(live, last, -1)
    tl.store(FIRST + slots, first)
    tl.store(LAST + slots, last)
    lo_min = tl.min(tl.where(live, first, _BIG), 0)
    hi_max = tl.max(tl.where(live, last, -1), 0)
    lo_max = tl.max(tl.where(live, first, -1), 0)
    hi_min = tl.min(tl.where(live, last, _BIG), 0)
    all_live = tl.min(live.to(tl.int32), 0)
    tl.store(BOUNDS + m * 8 + 0, lo_min)
    tl.store(BOUNDS + m * 8 + 1, hi_max)
    tl.store(BOUNDS + m * 8 + 2, lo_max)
    tl.store(BOUNDS + m * 8 + 3, hi_min)
    tl.store(BOUNDS + m * 8 + 4, all_live)
    if LISTS:
        keys = tl.arange(0, BK)
        part, whole = _sees(lo_min, hi_max, lo_max, hi_min, all_live, keys * TILE, NK, TILE)
        _pack(part & (keys < MK), keys, PC, PI, m, MK)
        _pack(whole & (keys < MK), keys, WC, WI, m, MK)


@triton.jit(do_not_specialize=["NK", "MQ"])
def _key_tiles_kernel(BOUNDS, PC, PI, WC, WI, NK, MQ, TILE: tl.constexpr, BQ: tl.constexpr):
    n = tl.program_id(0)
    q = tl.arange(0, BQ)
    inb = q < MQ
    lo_min = tl.load(BOUNDS + q * 8 + 0, mask=inb, other=_BIG)
    hi_max = tl.load(BOUNDS + q * 8 + 1, mask=inb, other=-1)
    lo_max = tl.load(BOUNDS + q * 8 + 2, mask=inb, other=_BIG)
    hi_min = tl.load(BOUNDS + q * 8 + 3, mask=inb, other=-1)
    all_live = tl.load(BOUNDS + q * 8 + 4, mask=inb, other=0)
    part, whole = _sees(lo_min, hi_max, lo_max, hi_min, all_live, n * TILE, NK, TILE)
    _pack(part & inb, q, PC, PI, n, MQ)
    _pack(whole & inb, q, WC, WI, n, MQ)


def _int32_buffers(dev, *shapes):
    """Int32 tensors of the given shapes as views of one allocation (one allocator call instead of one each; every
    view starts 16-byte aligned)."""
    sizes = [-(-int(torch.Size(sh).numel()) // 4) * 4 for sh in shapes]
    flat = torch.empty(sum(sizes), device=dev, dtype=torch.int32)
    return [part[:torch.Size(sh).numel()].view(sh) for part, sh in zip(flat.split(sizes), shapes)]


def tile_plan(q_pos, rows, cu_q, cu_k, n_keys: int, by_key: bool, longest_first: bool = False):
    """(first, last, slot, slot_rows, lists): `blocks.slot_intervals` over the padded slots, each row's slot (N,)
    int32 (the inverse of the slots' rows, to gather outputs back to row order), the row each slot holds (N,)
    (`rows` itself unless longest_first) and `blocks.tile_lists` (the forward's when not by_key, the backward's when
    by_key), computed on the device in two launches. longest_first (N a multiple of TILE): the selection's query
    tiles in reverse order (`blocks.longest_first`)."""
    n = rows.shape[0]
    tile = blocks.TILE
    if longest_first and n % tile:
        raise ValueError(f"longest_first needs a whole number of {tile}-slot tiles, got {n} slots")
    mq, mk = blocks.padded_slots(n) // tile, -(-n_keys // tile)
    rows_out, cols = (mk, mq) if by_key else (mq, mk)
    first, last, slot, slot_rows, bounds, pc, wc, pi, wi = _int32_buffers(
        rows.device, (mq * tile,), (mq * tile,), (n,), (n if longest_first else 0,), (mq, 8), (1, 1, rows_out),
        (1, 1, rows_out), (1, 1, rows_out, cols), (1, 1, rows_out, cols))
    nseq, steps = _steps(cu_q)
    launch(_query_tiles_kernel, (mq,), q_pos, rows, cu_q, cu_k, first, last, slot, slot_rows, bounds, pc, pi, wc, wi,
           n, nseq, steps, n_keys, mk, mq, LISTS=not by_key, REVERSE=longest_first, TILE=tile,
           BK=triton.next_power_of_2(mk), num_warps=4)
    if by_key:
        launch(_key_tiles_kernel, (mk,), bounds, pc, pi, wc, wi, n_keys, mq, TILE=tile,
               BQ=triton.next_power_of_2(mq), num_warps=4)
    return first, last, slot, slot_rows if longest_first else rows, (pc, pi, wc, wi)
