"""Static KV caches for decoding: allocated once at their final size, written in place, read by the decode kernel.

Each cache holds post-RoPE keys and values of one layer's heads, (B, H, slots, D):
- `DenseCache`: every position 0..capacity-1 of each row (full attention, LoGo's global branch, the intra-layer
  hybrid's global heads); row b's keys are its positions 0..pos[b];
- `RingCache`: the last `window` positions (the sliding-window branch): position p sits in slot p % slots, so
  before the ring wraps slots 0..pos hold positions 0..pos, and afterwards every slot holds one of the last
  `slots` positions; attention needs no order (RoPE is in the keys), only how many slots are filled.
Writes take the positions as a device tensor (B,) and index with it: no host value, so a decode step that
appends is a fixed sequence of kernels (a CUDA graph replays it).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class DenseCache:
    """Keys/values of every position of each row: (B, H, capacity, D)."""

    def __init__(self, batch: int, heads: int, capacity: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, heads, capacity, head_dim, dtype=dtype, device=device)  # (B, H, S, D)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prefill(self, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (b, T, H, D) of the right-padded prompts of `rows`; positions past a row's length are overwritten
        before they are read."""
        T = k.shape[1]
        self.k[rows, :, :T] = k.transpose(1, 2)
        self.v[rows, :, :T] = v.transpose(1, 2)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v (B, H, D) of each row's new token at its position pos (B,) int64."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, pos] = k
        self.v[rows, :, pos] = v

    def lengths(self, pos: torch.Tensor) -> torch.Tensor:
        """Keys each row attends once its token at pos is in: pos + 1."""
        return pos + 1


class RingCache:
    """The last `window` positions of each row: (B, H, slots, D), slots = min(window, capacity)."""

    def __init__(self, batch: int, heads: int, window: int, capacity: int, head_dim: int, dtype, device):
        self.slots = min(window, capacity)  # a ring larger than the whole sequence never wraps
        self.k = torch.zeros(batch, heads, self.slots, head_dim, dtype=dtype, device=device)  # (B, H, W, D)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prefill(self, rows: slice, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> None:
        """k, v (b, T, H, D) of the right-padded prompts of `rows`: each row keeps its last min(len, slots)
        tokens, each at its slot."""
        W = self.slots
        for i, n in enumerate(lengths):
            b = rows.start + i
            p = torch.arange(max(0, n - W), n, device=k.device)  # positions kept
            self.k[b, :, p % W] = k[i, p].transpose(0, 1)
            self.v[b, :, p % W] = v[i, p].transpose(0, 1)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v (B, H, D) at positions pos (B,): into slot pos % slots (the position `slots` earlier leaves)."""
        rows = torch.arange(k.shape[0], device=k.device)
        slot = pos % self.slots
        self.k[rows, :, slot] = k
        self.v[rows, :, slot] = v

    def lengths(self, pos: torch.Tensor) -> torch.Tensor:
        """Slots filled once the token at pos is in: min(pos + 1, slots)."""
        return (pos + 1).clamp_max(self.slots)
