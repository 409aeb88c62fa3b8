"""Static attention modules: full causal, sliding-window local, and the intra-layer (per-head) hybrid.

Every module maps x (B, T, d) -> (B, T, d) and returns (out, aux_loss, routing_stats) like the LoGo layer,
so the block treats all kinds the same. Attention math goes through the module's `attention_ops`
(`logo.kernels.dispatch.AttentionOps`, which a parallelism plan may replace) only. Head counts are read from the
projections' outputs, so a plan that splits the heads over ranks needs no change here.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from logo.config import AttentionConfig, ModelConfig
from logo.kernels import dispatch
from logo.kernels.rope import apply_rope
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
    """Shared projections W_q, W_k, W_v, W_o of a multi-head attention layer."""

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


class FullAttention(QKVAttention):
    def forward(self, x, cos, sin, seqs: PackedSeqs):
        q, k, v = self.project(x)
        o = causal(self.attention_ops, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, seqs, self.attn_cfg.backend)
        return self.wo(o.flatten(2)), None, None


class LocalAttention(QKVAttention):
    def forward(self, x, cos, sin, seqs: PackedSeqs):
        q, k, v = self.project(x)
        o = local(self.attention_ops, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, seqs,
                  self.attn_cfg.window, self.attn_cfg.backend)
        return self.wo(o.flatten(2)), None, None


class IntraLayerHybridAttention(QKVAttention):
    """The first `n_global` heads attend the full causal context, the others a sliding window (`n_global`: of the
    heads this module holds; a tensor-parallel plan sets it for each rank's block of heads)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.n_global = cfg.attention.num_global_heads(cfg.n_heads)

    def forward(self, x, cos, sin, seqs: PackedSeqs):
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
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
