"""Parameter and FLOP accounting for every attention kind (used for MFU and matched-budget tables).

Conventions:
- `params_non_embedding` excludes the input embedding and the output (LM-head) matrix.
- `attention_flops_per_token(cfg, T)`: forward FLOPs of the attention *score and value* products
  (QK^T and PV: 4 * H * D per query-key pair) per token, averaged over positions 1..T of a full-length
  sequence and summed over layers. Local: min(t, w) keys; global: t keys; LoGo: local for every token plus
  rho of the tokens global (the target budget); intra-layer: per-head mix. Projections (including LoGo's
  transforms and gate) are parameters and so are counted by 6 * N in `train_flops_per_token`.
"""
from __future__ import annotations

import torch.nn as nn

from logo.config import ModelConfig


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(total, non_embedding) counted from the module (works on the meta device)."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.tok_embeddings.weight.numel() + model.output.weight.numel()
    return total, total - emb


def _mean_keys_global(T: int) -> float:
    return (T + 1) / 2.0  # mean over t = 1..T of t


def _mean_keys_local(T: int, w: int) -> float:
    if T <= w:
        return _mean_keys_global(T)
    return (w * (w + 1) / 2.0 + (T - w) * w) / T


def layer_global_fractions(cfg: ModelConfig) -> list[float]:
    """Per layer, the fraction of (token, head) query rows with full-context span (the attention budget)."""
    a = cfg.attention
    out = []
    for kind in a.layer_kinds(cfg.n_layers):
        if kind == "full":
            out.append(1.0)
        elif kind == "local":
            out.append(0.0)
        elif kind == "intra_layer":
            out.append(a.num_global_heads(cfg.n_heads) / cfg.n_heads)
        else:  # logo: local for all rows plus a global branch for rho of them
            out.append(a.rho)
    return out


def realized_global_fraction(cfg: ModelConfig, logo_ratios: list[float]) -> float:
    """Global-attention (full-span) FLOPs as a fraction of full attention in every layer, with each LoGo layer at
    its realized ratio (`logo_ratios`, in LoGo-layer order) instead of rho. Tokens are weighted alike whatever
    their position (a causal global query at position t costs t keys: exact when selection is uniform in t)."""
    ratios = iter(logo_ratios)
    f = [next(ratios) if kind == "logo" else g
         for kind, g in zip(cfg.attention.layer_kinds(cfg.n_layers), layer_global_fractions(cfg))]
    return sum(f) / len(f)


def attention_budget(cfg: ModelConfig) -> float:
    """Mean global fraction over layers: 1.0 for a Transformer, 0.5 for the paper's matched hybrids."""
    f = layer_global_fractions(cfg)
    return sum(f) / len(f)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward attention (score + value) FLOPs per token, summed over layers."""
    a = cfg.attention
    per_pair = 4 * cfg.n_heads * cfg.head_dim
    g, loc = _mean_keys_global(seq_len), _mean_keys_local(seq_len, a.window)
    total = 0.0
    for kind, f in zip(a.layer_kinds(cfg.n_layers), layer_global_fractions(cfg)):
        if kind == "logo":
            total += per_pair * (loc + f * g)
        else:
            total += per_pair * (f * g + (1.0 - f) * loc)
    return total


def train_flops_per_token(cfg: ModelConfig, seq_len: int, params_non_embedding: int) -> float:
    """Forward+backward FLOPs per token: 6 * (non-embedding params + LM head) + 3 * attention forward."""
    lm_head = cfg.padded_vocab_size * cfg.dim
    return 6.0 * (params_non_embedding + lm_head) + 3.0 * attention_flops_per_token(cfg, seq_len)
