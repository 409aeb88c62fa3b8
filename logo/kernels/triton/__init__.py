"""Triton GPU kernels for LoGo attention, same signatures and varlen contract as `logo.kernels.reference`.

`query_sparse_attention(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale=None)` and
`sliding_window_attention(q, k, v, cu_seqlens, window, scale=None)` are differentiable (Triton forward and
backward kernels); `causal_attention(q, k, v, cu_seqlens, scale=None)` is dense causal varlen attention
built on the same kernels. See `_attn.py` for the design.
"""
from logo.kernels.triton._attn import causal_attention, query_sparse_attention, sliding_window_attention

__all__ = ["query_sparse_attention", "sliding_window_attention", "causal_attention"]
