"""The query-sparse global branch as a block-sparse problem: compacted query slots, each with the interval of
packed keys it sees, and the 128 x 128 tile lists that FlashAttention-4's block sparsity takes.

Pure PyTorch, static shapes (every size follows from the tensors' shapes), no host synchronisation: the selected
count n_sel = cu_q[-1] stays on the device. Slots past it (the unselected rows at the end of `rows`, and the padding
up to a whole tile) see no key, so their tiles are in no list and the kernels never compute them.

A key tile is listed for a query tile as
- `whole` when every slot of the query tile sees all of it (the kernel applies no mask there), or
- `part` when some slot sees some of it (the kernel applies the per-slot interval mask).
`part` is a superset bound: a tile between two documents' intervals may be listed though no slot sees it; the mask
then removes every element (a cost, never a wrong value).
"""
from __future__ import annotations

import torch

TILE = 128  # query and key tile of the lists (FlashAttention-4's sparse block on Hopper)


def padded_slots(n: int, tile: int = TILE) -> int:
    """Slots rounded up to whole tiles."""
    return -(-n // tile) * tile


def longest_first(x: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """The slots' values x (n_slots, ...) (n_slots a multiple of `tile`) with the query tiles in reverse order.
    Within a sequence the slots are in position order, so its later tiles see the most keys; FlashAttention-4's
    non-causal scheduler starts tiles in index order, and reversed the longest start first and the shortest fill the
    kernel's end (its causal scheduler does the same for dense attention)."""
    return x.reshape(-1, tile, *x.shape[1:]).flip(0).flatten(0, 1)


def slot_intervals(q_pos: torch.Tensor, rows: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) (n_slots,) int32: the packed keys [first, last] slot i sees. Slot i < n_sel holds row rows[i]
    of sequence s (cu_q[s] <= i < cu_q[s+1]) and sees cu_k[s] .. cu_k[s] + q_pos[rows[i]]; every other slot (up to
    n_slots >= rows.shape[0]) sees nothing: first 0, last -1. The contract of `logo.kernels.reference`."""
    n = rows.shape[0]
    dev = rows.device
    i = torch.arange(n_slots, device=dev)
    seq = torch.searchsorted(cu_q[1:].long(), i, right=True).clamp_max(cu_q.shape[0] - 2)  # (n_slots,)
    row = rows.long()[i.clamp_max(max(n - 1, 0))] if n else torch.zeros_like(i)
    first = cu_k.long()[seq]
    last = first + (q_pos.long()[row] if n else torch.zeros_like(i))
    live = i < cu_q[-1].long()
    return (torch.where(live, first, 0).to(torch.int32),
            torch.where(live, last, -1).to(torch.int32))


def tile_masks(first: torch.Tensor, last: torch.Tensor, n_keys: int,
               tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """(part, whole) (Mq, Mk) bool over query tiles x key tiles, from the slots' intervals (n_slots a multiple of
    `tile`) and the number of keys."""
    mq, mk = first.shape[0] // tile, -(-n_keys // tile)
    f, l = first.view(mq, tile).long(), last.view(mq, tile).long()
    live = l >= f
    big = 1 << 40
    lo_min = torch.where(live, f, big).amin(1, keepdim=True)  # (Mq, 1)
    lo_max = torch.where(live, f, -1).amax(1, keepdim=True)
    hi_min = torch.where(live, l, big).amin(1, keepdim=True)
    hi_max = torch.where(live, l, -1).amax(1, keepdim=True)
    start = torch.arange(mk, device=first.device)[None, :] * tile  # (1, Mk)
    end = start + tile - 1
    seen = (start <= hi_max) & (end >= lo_min)
    # whole: every slot live and seeing the tile's every key (a key tile cut by the end of the keys never is)
    whole = live.all(1, keepdim=True) & (start >= lo_max) & (end <= hi_min) & (end < n_keys)
    return seen & ~whole, whole


def ordered_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of mask (R, C) bool: the count (R,) int32 and the column indices in ascending order, packed left,
    (R, C) int32 (entries past the count are 0)."""
    R, C = mask.shape
    count = mask.sum(1, dtype=torch.int32)
    dest = torch.where(mask, mask.cumsum(1) - 1, C)  # (R, C): each listed column's place; the rest to a spare column
    idx = torch.zeros(R, C + 1, dtype=torch.int32, device=mask.device)
    cols = torch.arange(C, device=mask.device, dtype=torch.int32).expand(R, C)
    idx.scatter_(1, dest, cols)
    return count, idx[:, :C]


def tile_lists(first: torch.Tensor, last: torch.Tensor, n_keys: int, by_key: bool):
    """The four lists of FlashAttention-4's block sparsity, (count, index) for the `part` and the `whole` tiles:
    per query tile, its key tiles (forward), or with by_key per key tile, its query tiles (backward). Shapes
    (1, 1, R) and (1, 1, R, C) (one batch, every head the same: the routing is shared by the heads)."""
    part, whole = tile_masks(first, last, n_keys)
    if by_key:
        part, whole = part.t(), whole.t()
    out = []
    for m in (part, whole):
        count, idx = ordered_lists(m)
        out += [count[None, None], idx[None, None]]
    return tuple(out)
