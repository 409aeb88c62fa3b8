"""Per-token log-probabilities of a model, with the vocabulary head applied in chunks of positions, so a long
sequence never materializes (B, T, V) logits (a 128k-token row would need 51 GB of fp32 logits).

The distribution is softmax over the padded vocabulary, exactly the one the training loss uses.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from logo.model.layers import PackedSeqs, rope_cos_sin

CHUNK = 4096  # positions per head application


def hidden_states(model, tokens: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                  valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The final-norm hidden states (B, T, d) of `model(tokens, cu_seqlens, valid)`: its blocks, no head."""
    B, T = tokens.shape
    doc_offsets = cu_seqlens if model.cfg.attention.document_mask else None
    seqs = PackedSeqs.build(B, T, tokens.device, doc_offsets, valid)
    cos, sin = rope_cos_sin(T, model.cfg.head_dim, model.cfg.rope_theta, tokens.device)
    h = model.tok_embeddings(tokens)  # (B, T, d)
    for block in model.layers.values():
        h = block(h, cos, sin, seqs)[0]
    return model.norm(h)


def context_positions(model, batch_size: int, seq_len: int, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, T) int64: how many earlier tokens each position can attend to (its place in its document segment
    when the model masks documents, else its place in the row)."""
    if cu_seqlens is None or not model.cfg.attention.document_mask:
        return torch.arange(seq_len).expand(batch_size, seq_len)
    return PackedSeqs.build(batch_size, seq_len, "cpu", cu_seqlens.cpu()).pos.view(batch_size, seq_len).long()


@torch.no_grad()
def token_logprobs(model, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h (n, d) hidden states, targets (n,) next tokens -> (log p(target) (n,) fp32, target is the argmax over
    the real vocabulary (n,) bool). Targets of -100 give 0 / False."""
    vocab = model.cfg.vocab_size
    logp, greedy = [], []
    for i in range(0, h.shape[0], CHUNK):
        logits = model.output(h[i:i + CHUNK]).float()  # (c, V)
        t = targets[i:i + CHUNK]
        logp.append(-F.cross_entropy(logits, t, reduction="none", ignore_index=-100))
        greedy.append(logits[:, :vocab].argmax(-1) == t)
    return torch.cat(logp), torch.cat(greedy)
