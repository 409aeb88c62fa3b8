"""Static KV caches for decoding: allocated once at their final size, written in place, read by the decode kernel.

An attention module's forward takes them (`cache=`): over a prompt batch (`PackedSeqs`) it runs its training
computation and writes the keys and values of every token (`CacheWrite`); for one new token per row
(`DecodeStep` in place of the `PackedSeqs`) it appends that token's keys and values and attends over the cache.

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
from dataclasses import dataclass
from typing import Optional

import torch

from logo.kernels import dispatch


class _Cache:
    """Keys k and values v (B, H, slots, D); a subclass places each row's token (`append`) and says how many slots
    a row's query reads (`lengths`)."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def attend(self, q, k, v, pos, active, backend: str) -> torch.Tensor:
        """Append k, v (B, H, D) at pos (B,), then attention of q (B, H, D) over each row's cached keys: (B, H, D),
        zeros at rows not `active` (B,) bool (their programs do no work)."""
        self.append(k, v, pos)
        return dispatch.decode_attention(q, self.k, self.v, self.lengths(pos), active, backend=backend)


class DenseCache(_Cache):
    """Keys/values of every position of each row: (B, H, capacity, D)."""

    def __init__(self, batch: int, heads: int, capacity: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, heads, capacity, head_dim, dtype=dtype, device=device)  # (B, H, S, D)
        self.v = torch.zeros_like(self.k)

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


class RingCache(_Cache):
    """The last `window` positions of each row: (B, H, slots, D), slots = min(window, capacity)."""

    def __init__(self, batch: int, heads: int, window: int, capacity: int, head_dim: int, dtype, device):
        self.slots = min(window, capacity)  # a ring larger than the whole sequence never wraps
        self.k = torch.zeros(batch, heads, self.slots, head_dim, dtype=dtype, device=device)  # (B, H, W, D)
        self.v = torch.zeros_like(self.k)

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


@dataclass
class LayerCache:
    """One attention layer's caches: `dense` for the heads that see every position (full attention, the
    intra-layer hybrid's global heads, LoGo's global branch), `ring` for the sliding-window heads (local
    attention's, the hybrid's local heads, LoGo's local branch); None where the layer has no such heads."""

    dense: Optional[DenseCache] = None
    ring: Optional[RingCache] = None

    @staticmethod
    def new(heads: tuple[int, int], batch: int, capacity: int, window: int, head_dim: int, dtype,
            device) -> LayerCache:
        """Empty caches at their final size for (dense, ring) head counts `heads`."""
        dense, ring = heads
        return LayerCache(DenseCache(batch, dense, capacity, head_dim, dtype, device) if dense else None,
                          RingCache(batch, ring, window, capacity, head_dim, dtype, device) if ring else None)

    @staticmethod
    def row_bytes(heads: tuple[int, int], capacity: int, window: int, head_dim: int, dtype) -> int:
        """Bytes of one row's keys and values in caches of `new`'s shape."""
        dense, ring = heads
        slots = min(window, capacity)
        return 2 * head_dim * (dense * capacity + ring * slots) * torch.empty(0, dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in (self.dense, self.ring) if c is not None)

    def at(self, rows: slice, lengths: Sequence[int]) -> CacheWrite:
        """What a forward over the prompts of batch rows `rows` (their lengths) writes into."""
        return CacheWrite(self, rows, lengths)


@dataclass
class CacheWrite:
    """A prefill's target: the layer's caches and the batch rows (with their prompt lengths) of the forward."""

    cache: LayerCache
    rows: slice
    lengths: Sequence[int]

    def write(self, dense_kv: Optional[tuple], ring_kv: Optional[tuple]) -> None:
        """Post-RoPE keys and values (b, T, H, D) of every prompt token: `dense_kv` for the dense cache, `ring_kv`
        for the ring (each None where the layer has no such cache)."""
        if self.cache.dense is not None:
            self.cache.dense.prefill(self.rows, *dense_kv)
        if self.cache.ring is not None:
            self.cache.ring.prefill(self.rows, *ring_kv, self.lengths)


@dataclass
class DecodeStep:
    """One new token per row, in place of a forward's `PackedSeqs`: pos (B,) int64 its position, active (B,) bool
    the rows still generating (the others attend nothing and are never routed global), counts (3,) float64 the
    LoGo routing counts on the device: [rows active, rows selected, layer-steps with none selected]."""

    pos: torch.Tensor
    active: torch.Tensor
    counts: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        """The rows that may be routed (`PackedSeqs.valid`'s role): the active ones."""
        return self.active

    def count(self, z: torch.Tensor) -> None:
        """Add one LoGo layer's routing decisions z (B,) bool to `counts` (no host read)."""
        n = z.sum()
        self.counts += torch.stack((self.active.sum(), n, (n == 0) & self.active.any())).to(self.counts.dtype)
