"""Parameter and FLOP accounting for every attention kind (used for MFU and matched-budget tables).

Conventions:
- `params_non_embedding` excludes the input embedding and the output (LM-head) matrix.
- `attention_flops_per_token(cfg, T)`: forward FLOPs of the attention *score and value* products
  (QK^T and PV: 4 * H * D per query-key pair) per token, averaged over positions 1..T of a full-length
  sequence and summed over layers; with `doc_lengths`, over the positions of those documents instead (attention
  stays inside a document: packed short documents cost far less than one document of the whole length).
  Local: min(t, w) keys; global: t keys; LoGo: local for every token plus
  rho of the tokens global (the target budget, or the realized ratio per layer when `ratios` is given);
  intra-layer: per-head mix. Projections (including LoGo's transforms and gate) are parameters and so are
  counted by 6 * N in `train_flops_per_token`.
- `mfu`: the one model-FLOPs-utilization formula, used by the trainer's log and benchmarks/model_step.py.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch.nn as nn

from logo.config import ModelConfig


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(total, non_embedding) counted from the module (works on the meta device)."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.tok_embeddings.weight.numel() + model.output.weight.numel()
    return total, total - emb


def _mean_keys(window: int, doc_lengths: Sequence[int]) -> tuple[float, float]:
    """Keys per query, averaged over the tokens of the documents `doc_lengths` (each token sees only its own
    document; causal): (global: t keys at position t, local: min(t, window))."""
    n = np.asarray(doc_lengths, dtype=np.float64)
    tokens = max(float(n.sum()), 1.0)
    m = np.minimum(n, window)  # positions 1..m see t keys, the rest `window`
    local = (m * (m + 1) / 2 + (n - m) * window).sum()
    return float((n * (n + 1) / 2).sum() / tokens), float(local / tokens)


def layer_global_fractions(cfg: ModelConfig, ratios: Optional[dict[int, float]] = None) -> list[float]:
    """Per layer, the fraction of (token, head) query rows with full-context span (the attention budget).
    ratios: {layer index: realized global ratio} of LoGo layers (the controller's); missing layers use rho."""
    a = cfg.attention
    ratios = ratios or {}
    out = []
    for i, kind in enumerate(a.layer_kinds(cfg.n_layers)):
        if kind == "full":
            out.append(1.0)
        elif kind == "local":
            out.append(0.0)
        elif kind == "intra_layer":
            out.append(a.num_global_heads(cfg.n_heads) / cfg.n_heads)
        else:  # logo: local for all rows plus a global branch for rho of them
            out.append(float(ratios.get(i, a.rho)))
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


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, ratios: Optional[dict[int, float]] = None,
                              doc_lengths: Optional[Sequence[int]] = None) -> float:
    """Forward attention (score + value) FLOPs per token, summed over layers (ratios: see layer_global_fractions;
    doc_lengths: the documents the tokens belong to, else one document of seq_len)."""
    a = cfg.attention
    per_pair = 4 * cfg.n_heads * cfg.head_dim
    g, loc = _mean_keys(a.window, [seq_len] if doc_lengths is None else doc_lengths)
    total = 0.0
    for kind, f in zip(a.layer_kinds(cfg.n_layers), layer_global_fractions(cfg, ratios)):
        if kind == "logo":
            total += per_pair * (loc + f * g)
        else:
            total += per_pair * (f * g + (1.0 - f) * loc)
    return total


def train_flops_per_token(cfg: ModelConfig, seq_len: int, params_non_embedding: int,
                          ratios: Optional[dict[int, float]] = None,
                          doc_lengths: Optional[Sequence[int]] = None) -> float:
    """Forward+backward FLOPs per token: 6 * (non-embedding params + LM head) + 3 * attention forward."""
    lm_head = cfg.padded_vocab_size * cfg.dim
    return 6.0 * (params_non_embedding + lm_head) + 3.0 * attention_flops_per_token(cfg, seq_len, ratios,
                                                                                    doc_lengths)


def realized_ratios(metrics: dict) -> dict[int, float]:
    """{layer index: realized global ratio} from `BudgetController.metrics()` ('logo/ratio/layer_<i>')."""
    return {int(k.rsplit("_", 1)[1]): float(v) for k, v in metrics.items() if k.startswith("logo/ratio/layer_")}


def mfu(cfg: ModelConfig, seq_len: int, params_non_embedding: int, tokens_per_s: float, peak_flops: float,
        ratios: Optional[dict[int, float]] = None, doc_lengths: Optional[Sequence[int]] = None) -> float:
    """Model FLOPs utilization: train_flops_per_token (attention by kind: window for local, realized ratio
    for LoGo layers when `ratios` is given, over the documents `doc_lengths` when given) x tokens/s over
    `peak_flops` (bf16 dense peak of all GPUs used)."""
    flops = train_flops_per_token(cfg, seq_len, params_non_embedding, ratios, doc_lengths)
    return flops * tokens_per_s / peak_flops


def peak_bf16_flops(device_name: str) -> float:
    """Dense bf16 peak FLOP/s of one GPU by name (torchtitan's table; H100 SXM / H200: 989e12)."""
    from torchtitan.tools.utils import get_peak_flops
    return float(get_peak_flops(device_name))
