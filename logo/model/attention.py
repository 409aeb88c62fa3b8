"""Static attention modules: full causal, sliding-window local, and the intra-layer (per-head) hybrid.

Every module maps x (B, T, d) -> (B, T, d) and returns (out, aux_loss, routing_stats) like the LoGo layer,
so the block treats all kinds the same. Attention math goes through the module's `attention_ops`
(`logo.kernels.dispatch.AttentionOps`, which a parallelism plan may replace) only. Head counts are read from the
projections' outputs, so a plan that splits the heads over ranks needs no change here.

Decoding goes through the same forward (`forward(x, cos, sin, seqs, cache)`, `logo.model.kv_cache`): with a
`CacheWrite` over a prompt batch it also writes the keys and values of every token; with a `DecodeStep` in place
of `seqs` (x (B, 1, d), cos/sin (B, D/2) at each row's position) it appends the new token's and attends over the
caches with the decode kernel.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from logo.config import AttentionConfig, ModelConfig
from logo.kernels import dispatch
from logo.kernels.rope import apply_rope, apply_rope_rows
from logo.model.kv_cache import CacheWrite, DecodeStep, LayerCache
from logo.model.layers import PackedSeqs, autocast_input


def causal(ops: dispatch.AttentionOps, q, k, v, seqs: PackedSeqs, backend: str) -> torch.Tensor:
    """Full causal attention of q, k, v (B, T, H, D) inside each sequence -> (B, T, H, D)."""
    rows = not seqs.has_documents  # one sequence per row
    if rows and dispatch.attention_impl(q, backend) != "flash":
        # PyTorch's fused SDPA (cuDNN / FlashAttention-2 on GPU), faster than the Triton kernels
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return o.transpose(1, 2)
    B, T = q.shape[:2]
    o = ops.causal_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), seqs.cu_seqlens,
                             backend=backend, seqlen=T if rows else 0)
    return o.unflatten(0, (B, T))


def local(ops: dispatch.AttentionOps, q, k, v, seqs: PackedSeqs, window: int, backend: str) -> torch.Tensor:
    """Sliding-window causal attention (B, T, H, D) -> (B, T, H, D)."""
    B, T = q.shape[:2]
    o = ops.sliding_window_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), seqs.cu_seqlens, window,
                                     backend=backend)
    return o.unflatten(0, (B, T))


class QKVAttention(nn.Module):
    """Shared projections W_q, W_k, W_v, W_o of a multi-head attention layer. A subclass gives `encode` (its
    forward over packed sequences, writing a prefill's caches when given) and how many heads are global
    (`global_heads`, which lays out the caches); the decoding step over the caches is shared (LoGo has its own)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim  # the model's heads (a plan may split them)
        self.attn_cfg: AttentionConfig = cfg.attention
        self.attention_ops = dispatch.AttentionOps()  # the attention ops this module calls
        inner = self.n_heads * self.head_dim
        self.wq = nn.Linear(cfg.dim, inner, bias=False)
        self.wk = nn.Linear(cfg.dim, inner, bias=False)
        self.wv = nn.Linear(cfg.dim, inner, bias=False)
        self.wo = nn.Linear(inner, cfg.dim, bias=False)

    def forward(self, x, cos, sin, seqs, cache=None):
        """x (B, T, d) over packed sequences `seqs` (cos/sin (T, D/2); cache: a `CacheWrite` to fill, or None), or
        one token per row x (B, 1, d) for a `DecodeStep` `seqs` (cos/sin (B, D/2); cache: the `LayerCache`)
        -> out (B, T, d), aux_loss scalar or None, routing stats (K,) or None."""
        if isinstance(seqs, DecodeStep):
            return self.decode(x, cos, sin, seqs, cache), None, None
        return self.encode(x, cos, sin, seqs, cache)

    def project(self, x):
        """x (B, T, d) -> pre-RoPE q, k, v (B, T, H, D), H the heads the projections hold. Under autocast x is cast
        once for all three (one copy kept for their weight gradients instead of three)."""
        shape = (*x.shape[:2], -1, self.head_dim)
        x = autocast_input(x)
        return self.wq(x).view(shape), self.wk(x).view(shape), self.wv(x).view(shape)

    def init_weights(self, std: float, out_std: float):
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)

    def global_heads(self) -> int:
        """How many of the first heads attend the whole causal context (the others: the sliding window)."""
        return self.n_heads

    def cache_heads(self) -> tuple[int, int]:
        """Heads of the (dense, ring) decoding caches."""
        g = self.global_heads()
        return g, self.n_heads - g

    def new_cache(self, batch: int, capacity: int, dtype, device) -> LayerCache:
        """Empty decoding caches for `batch` rows of up to `capacity` positions."""
        return LayerCache.new(self.cache_heads(), batch, capacity, self.attn_cfg.window, self.head_dim, dtype, device)

    def cache_row_bytes(self, capacity: int, dtype) -> int:
        """Bytes of one row's decoding caches."""
        return LayerCache.row_bytes(self.cache_heads(), capacity, self.attn_cfg.window, self.head_dim, dtype)

    def rotated_qkv(self, x, cos, sin, cache: CacheWrite | None):
        """x (B, T, d) -> RoPE(q), RoPE(k), v (B, T, H, D); with a prefill's `cache`, the keys and values are
        written too: the global heads' into the dense cache, the others' into the ring."""
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            g = self.global_heads()
            cache.write((k[:, :, :g], v[:, :, :g]), (k[:, :, g:], v[:, :, g:]))
        return q, k, v

    def decode(self, x, cos, sin, step: DecodeStep, cache: LayerCache) -> torch.Tensor:
        """One token per row: x (B, 1, d), cos/sin (B, D/2) -> (B, 1, d); the global heads over the dense cache,
        the others over the ring."""
        q, k, v = (t[:, 0] for t in self.project(x))  # (B, H, D) pre-RoPE
        qr, kr = apply_rope_rows(q, cos, sin), apply_rope_rows(k, cos, sin)
        g, backend = self.global_heads(), self.attn_cfg.backend
        parts = []
        if cache.dense is not None:
            parts.append(cache.dense.attend(qr[:, :g], kr[:, :g], v[:, :g], step.pos, step.active, backend))
        if cache.ring is not None:
            parts.append(cache.ring.attend(qr[:, g:], kr[:, g:], v[:, g:], step.pos, step.active, backend))
        o = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # (B, H, D)
        return self.wo(o.flatten(1))[:, None]


class FullAttention(QKVAttention):
    def encode(self, x, cos, sin, seqs: PackedSeqs, cache: CacheWrite | None = None):
        q, k, v = self.rotated_qkv(x, cos, sin, cache)
        o = causal(self.attention_ops, q, k, v, seqs, self.attn_cfg.backend)
        return self.wo(o.flatten(2)), None, None


class LocalAttention(QKVAttention):
    def global_heads(self) -> int:
        return 0

    def encode(self, x, cos, sin, seqs: PackedSeqs, cache: CacheWrite | None = None):
        q, k, v = self.rotated_qkv(x, cos, sin, cache)
        o = local(self.attention_ops, q, k, v, seqs, self.attn_cfg.window, self.attn_cfg.backend)
        return self.wo(o.flatten(2)), None, None


class IntraLayerHybridAttention(QKVAttention):
    """The first `n_global` heads attend the full causal context, the others a sliding window (`n_global`: of the
    heads this module holds; a tensor-parallel plan sets it for each rank's block of heads)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.n_global = cfg.attention.num_global_heads(cfg.n_heads)

    def global_heads(self) -> int:
        return self.n_global

    def encode(self, x, cos, sin, seqs: PackedSeqs, cache: CacheWrite | None = None):
        q, k, v = self.rotated_qkv(x, cos, sin, cache)
        g, ops, a = self.n_global, self.attention_ops, self.attn_cfg
        parts = []
        if g > 0:
            parts.append(causal(ops, q[:, :, :g], k[:, :, :g], v[:, :, :g], seqs, a.backend))
        if g < q.shape[2]:
            parts.append(local(ops, q[:, :, g:].contiguous(), k[:, :, g:].contiguous(), v[:, :, g:].contiguous(),
                               seqs, a.window, a.backend))
        o = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        return self.wo(o.flatten(2)), None, None


def depth_scaled_std(std: float, n_layers: int) -> float:
    """Residual-branch output projections are initialized with std / sqrt(2 * n_layers)."""
    return std / math.sqrt(2 * n_layers)
