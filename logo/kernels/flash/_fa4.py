"""FlashAttention-4 (the CuTe DSL kernels of `flash-attn-4`) behind `attn_forward` / `attn_backward`.

Imported only on a Hopper GPU with the package installed (`logo.kernels.flash.usable`). Three problems, the
same contract as `logo.kernels.reference`:

- query-sparse (rows given): the selected rows are gathered into slot order (the order of `rows`), one packed
  batch of all slots over all keys; each slot's key interval is the kernel's mask function, read from two index
  tensors, and the 128 x 128 tile lists skip every tile no slot sees (the unselected rows' tiles among them); both
  come from `_tiles.tile_plan` (two Triton launches; `blocks.py` is its PyTorch reference). The query tiles are laid
  out longest first (`blocks.longest_first`) where the slots fill whole tiles. Outputs and dQ are gathered back to
  row order. FlashAttention-4's backward takes block sparsity only without varlen offsets, hence
  the one packed batch with the document bounds inside the intervals;
- sliding window and dense causal (rows None): varlen attention over cu_seqlens, `window_size=(window - 1, 0)`
  for the window; dense causal over whole rows of `seqlen` tokens (seqlen > 0: no documents) as a (B, T) batch,
  whose scheduler orders the causal tiles longest first (the varlen one does not; docs/benchmarks.md).

Compiled kernels are kept on disk (FlashAttention-4's cache, `FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED`, on unless
the environment sets it): a new process loads them instead of compiling again.
"""
from __future__ import annotations

import functools
import os

os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from flash_attn.cute import interface as _fa  # noqa: E402
from flash_attn.cute import utils as _fa_utils  # noqa: E402
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: E402

from logo.kernels.flash import _tiles  # noqa: E402


@cute.jit
def _slot_sees_key(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Mask function of the query-sparse problem: slot q_idx sees key kv_idx iff first[q_idx] <= kv_idx <=
    last[q_idx] (aux_tensors = [first, last], int32 per slot)."""
    first = _fa_utils.scalar_to_ssa(aux_tensors[0][q_idx[0]], cutlass.Int32)
    last = _fa_utils.scalar_to_ssa(aux_tensors[1][q_idx[0]], cutlass.Int32)
    return (kv_idx >= first) & (kv_idx <= last)


def _empty(*shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Every output buffer handed to the kernels is allocated here (tests swap in a NaN-filled allocator to catch
    unwritten rows)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


def _plan(q_pos, rows, cu_q, cu_k, n_keys: int, by_key: bool):
    """The slots' key intervals (padded to whole tiles: the mask function may read a tile's every row), each row's
    slot (outputs go back to row order by a gather, faster than the scatter `index_copy_`), the row each slot holds
    and the block sparsity of the forward (per query tile) or of the backward (by_key: per key tile). The query tiles
    run longest first (`blocks.longest_first`) where the slots fill whole tiles."""
    longest_first = rows.shape[0] % _tiles.blocks.TILE == 0
    first, last, slot, slot_rows, (pc, pi, wc, wi) = _tiles.tile_plan(q_pos, rows, cu_q, cu_k, n_keys, by_key,
                                                                      longest_first)
    tiles = (_tiles.blocks.TILE,) * 2
    return first, last, slot.long(), slot_rows.long(), BlockSparseTensorsTorch(
        mask_block_cnt=pc, mask_block_idx=pi, full_block_cnt=wc, full_block_idx=wi, block_size=tiles)


def _window(window: int) -> tuple:
    """(window_size_left, window_size_right) of a causal call: the last `window` keys, or every earlier key."""
    return (window - 1, 0) if window > 0 else (None, None)


def _rows(x, seqlen: int):
    """(N, H, D) -> (N / seqlen, seqlen, H, D): whole rows as a batch."""
    return x.view(-1, seqlen, *x.shape[1:])


def attn_forward(q, k, v, q_pos, rows, cu_q, cu_k, scale: float, window: int, seqlen: int = 0):
    """o (N, H, D) in q's dtype (zero at unselected rows) and the natural log-sum-exp (H, N) float32 per slot.
    seqlen > 0 (dense causal only): the sequences are whole rows of seqlen tokens."""
    n, H, D = q.shape
    o = _empty(*q.shape, like=q)
    lse = _empty(H, n, like=q, dtype=torch.float32)
    if rows is None and window == 0 and seqlen > 0:
        _fa._flash_attn_fwd(_rows(q, seqlen), _rows(k, seqlen), _rows(v, seqlen), softmax_scale=scale, causal=True,
                            out=_rows(o, seqlen), lse=lse.view(H, -1, seqlen).transpose(0, 1), return_lse=True)
        return o, lse
    if rows is None:
        left, right = _window(window)
        _fa._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softmax_scale=scale, causal=True,
                            window_size_left=left, window_size_right=right, out=o, lse=lse, return_lse=True)
        return o, lse
    first, last, slot, slot_rows, sparsity = _plan(q_pos, rows, cu_q, cu_k, k.shape[0], by_key=False)
    o_slots = _empty(1, n, H, D, like=q)
    _fa._flash_attn_fwd(q.index_select(0, slot_rows)[None], k[None], v[None], softmax_scale=scale, causal=False,
                        mask_mod=_slot_sees_key, aux_tensors=[first, last], block_sparse_tensors=sparsity,
                        out=o_slots, lse=lse[None], return_lse=True)
    return torch.index_select(o_slots[0], 0, slot, out=o), lse


def attn_backward(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, scale: float, window: int, seqlen: int = 0):
    """dq (zero at unselected rows), dk, dv of `attn_forward` (contiguous, in the inputs' dtype)."""
    n, H, D = q.shape
    dq = _empty(*q.shape, like=q)
    dk, dv = _empty(*k.shape, like=k), _empty(*v.shape, like=v)
    if rows is None and window == 0 and seqlen > 0:
        r = functools.partial(_rows, seqlen=seqlen)
        _fa._flash_attn_bwd(r(q), r(k), r(v), r(o), r(do), lse.view(H, -1, seqlen).transpose(0, 1), scale, True,
                            dq=r(dq), dk=r(dk), dv=r(dv))
        return dq, dk, dv
    if rows is None:
        left, right = _window(window)
        _fa._flash_attn_bwd(q, k, v, o, do, lse, scale, True, 0.0, left, right, cu_seqlens_q=cu_q,
                            cu_seqlens_k=cu_k, dq=dq, dk=dk, dv=dv)
        return dq, dk, dv
    first, last, slot, idx, sparsity = _plan(q_pos, rows, cu_q, cu_k, k.shape[0], by_key=True)
    dq_slots = _empty(1, n, H, D, like=q)
    _fa._flash_attn_bwd(q.index_select(0, idx)[None], k[None], v[None], o.index_select(0, idx)[None],
                        do.index_select(0, idx)[None], lse[None], scale, False, 0.0, None, None,
                        mask_mod=_slot_sees_key, aux_tensors=[first, last], block_sparse_tensors=sparsity,
                        dq=dq_slots, dk=dk[None], dv=dv[None])
    return torch.index_select(dq_slots[0], 0, slot, out=dq), dk, dv
