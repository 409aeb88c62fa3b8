"""KV caches for autoregressive decoding: a dense cache of every earlier token and a ring buffer of the last
`window` tokens, each (B, H, slots, D) with post-RoPE keys, per row of a right-padded batch.

Attention over a cache goes through `F.scaled_dot_product_attention` (flash / memory-efficient kernels on
GPU): one query per row, keys 0..pos of that row. A boolean mask is passed only when rows differ in length
(or a ring is not full yet), so the common single-row case runs the unmasked fused kernel.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q (n, H, D), k/v (n, H, L, D), mask (n, L) bool or None -> (n, H, D)."""
    m = None if mask is None else mask[:, None, None, :]  # (n, 1, 1, L)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=m)[:, :, 0]


class DenseCache:
    """Keys/values of every position 0..capacity-1 of each row: full attention and LoGo's global branch."""

    def __init__(self, batch: int, heads: int, capacity: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, heads, capacity, head_dim, dtype=dtype, device=device)  # (B, H, S, D)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, T, H, D) of the padded prompt; positions past a row's length are overwritten later."""
        T = k.shape[1]
        self.k[:, :, :T] = k.transpose(1, 2)
        self.v[:, :, :T] = v.transpose(1, 2)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v (B, H, D) of the new token of each row at its position pos (B,) int64."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, pos] = k
        self.v[rows, :, pos] = v

    def attend(self, q: torch.Tensor, pos: torch.Tensor, host_pos: Sequence[int],
               rows: Optional[slice] = None) -> torch.Tensor:
        """q (n, H, D) of rows `rows` (a contiguous slice, default all) at positions pos (n,) -> (n, H, D),
        over keys 0..pos of each row. host_pos: the same positions as Python ints (no device sync)."""
        rows = rows or slice(None)
        L = max(host_pos) + 1
        k, v = self.k[rows, :, :L], self.v[rows, :, :L]  # views: no copy
        mask = None
        if min(host_pos) != max(host_pos):
            mask = torch.arange(L, device=q.device)[None, :] <= pos[:, None]  # (n, L)
        return _sdpa(q, k, v, mask)


class RingCache:
    """The last `window` keys/values of each row: slot = position % slots. The local (sliding-window) branch."""

    def __init__(self, batch: int, heads: int, window: int, capacity: int, head_dim: int, dtype, device):
        self.window = window
        self.slots = min(window, capacity)  # a ring larger than the whole sequence never wraps
        self.k = torch.zeros(batch, heads, self.slots, head_dim, dtype=dtype, device=device)  # (B, H, W, D)
        self.v = torch.zeros_like(self.k)
        self.slot_pos = torch.full((batch, self.slots), -1, dtype=torch.long, device=device)  # (B, W); -1 empty

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.slot_pos.nbytes

    def prefill(self, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> None:
        """k, v (B, T, H, D) of a right-padded prompt: each row keeps its last min(len, slots) real tokens."""
        W = self.slots
        for b, n in enumerate(lengths):
            p = torch.arange(max(0, n - W), n, device=k.device)  # positions kept
            self.k[b, :, p % W] = k[b, p].transpose(0, 1)
            self.v[b, :, p % W] = v[b, p].transpose(0, 1)
            self.slot_pos[b, p % W] = p

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v (B, H, D) at positions pos (B,): overwrite the oldest slot (position pos - window)."""
        rows = torch.arange(k.shape[0], device=k.device)
        slot = pos % self.slots
        self.k[rows, :, slot] = k
        self.v[rows, :, slot] = v
        self.slot_pos[rows, slot] = pos

    def attend(self, q: torch.Tensor, host_pos: Sequence[int]) -> torch.Tensor:
        """q (B, H, D) of every row -> (B, H, D) over the slots holding positions pos-window+1..pos."""
        full = min(host_pos) >= self.slots - 1  # every ring holds `slots` positions, all inside the window
        return _sdpa(q, self.k, self.v, None if full else self.slot_pos >= 0)
