"""Llama-style decoder (pre-RMSNorm, RoPE, SwiGLU, untied embeddings) with a pluggable attention kind.

The model knows nothing about parallelism or training: `logo/parallel/` wraps it, the trainer drives it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from logo.config import ModelConfig
from logo.model.attention import FullAttention, IntraLayerHybridAttention, LocalAttention, depth_scaled_std
from logo.model.layers import FeedForward, PackedSeqs, RMSNorm, rope_cos_sin
from logo.model.lm_head import LMHead
from logo.model.logo_attention import LoGoAttention

ATTENTION_MODULES = {
    "full": FullAttention,
    "local": LocalAttention,
    "intra_layer": IntraLayerHybridAttention,
    "logo": LoGoAttention,
}


class ModelOutput(NamedTuple):
    logits: Optional[torch.Tensor]  # (B, T, V_padded); None when the forward was given labels
    aux_loss: torch.Tensor  # scalar; 0 unless attention.budget_control == "aux_loss"
    routing: Optional[torch.Tensor]  # (n_logo_layers, K) routing stats (logo.model.controller) or None
    loss_sum: Optional[torch.Tensor] = None  # () fp32 LM loss summed over the valid labels, when labels were given


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, attention_kind: str):
        super().__init__()
        self.layer_id = layer_id
        self.attention_kind = attention_kind
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = ATTENTION_MODULES[attention_kind](cfg)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x, cos, sin, seqs: PackedSeqs, cache=None):
        """x (B, T, d) -> (x, aux_loss, routing stats); `seqs` and `cache` as the attention module's forward
        (`logo.model.attention.QKVAttention.forward`: training, prefill and decoding steps alike)."""
        h, aux, stats = self.attention(self.attention_norm(x), cos, sin, seqs, cache=cache)
        x = x + h
        x = x + self.feed_forward(self.ffn_norm(x))
        return x, aux, stats

    def init_weights(self, std: float, out_std: float):
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        kinds = cfg.attention.layer_kinds(cfg.n_layers)
        self.tok_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.dim)
        # ModuleDict keyed by layer index (torchtitan style: stable FQNs for checkpoints and parallel plans).
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i, kinds[i]) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = LMHead(cfg.dim, cfg.padded_vocab_size)
        self.logo_layer_ids = [i for i, k in enumerate(kinds) if k == "logo"]

    def init_weights(self):
        """(Re)initialize every parameter and buffer; call after `to_empty()` when built on the meta device."""
        std = self.cfg.init_std
        out_std = depth_scaled_std(std, self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for block in self.layers.values():
            block.init_weights(std, out_std)
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, std=self.cfg.dim ** -0.5)

    def logo_layers(self) -> list[LoGoAttention]:
        return [self.layers[str(i)].attention for i in self.logo_layer_ids]

    def forward(self, tokens: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                valid: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                loss_impl: str = "auto", positions: Optional[torch.Tensor] = None) -> ModelOutput:
        """tokens (B, T) int64; cu_seqlens (S+1,) int32 document offsets over the flattened B*T tokens
        (row boundaries included); valid (B, T) bool, False for padding; positions (T,) int64 the rotary
        position of each column (default 0..T-1: the columns of a row are consecutive tokens). With labels
        (B, T) int64 (-100 where ignored) the output holds the summed LM loss (`loss_impl`: see
        logo/model/lm_head.py) and no logits."""
        B, T = tokens.shape
        doc_offsets = cu_seqlens if self.cfg.attention.document_mask else None
        seqs = PackedSeqs.build(B, T, tokens.device, doc_offsets, valid)
        cos, sin = rope_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, tokens.device, positions=positions)

        h = self.tok_embeddings(tokens)  # (B, T, d)
        aux_total = torch.zeros((), device=tokens.device, dtype=torch.float32)
        stats = []
        for block in self.layers.values():
            h, aux, st = block(h, cos, sin, seqs)
            if aux is not None:
                aux_total = aux_total + aux
            if st is not None:
                stats.append(st)
        routing = torch.stack(stats) if stats else None
        if labels is not None:
            loss_sum = self.output(self.norm(h), labels=labels, loss_impl=loss_impl)  # () fp32
            return ModelOutput(None, aux_total, routing, loss_sum)
        logits = self.output(self.norm(h))  # (B, T, V)
        return ModelOutput(logits, aux_total, routing)
