"""Per-token log-probabilities of a model, with the vocabulary head applied in chunks of positions, so a long
sequence never materializes (B, T, V) logits (a 128k-token row would need 51 GB of fp32 logits).

The distribution is softmax over the padded vocabulary, exactly the one the training loss uses, computed the
way the training loss computes it (`logo.model.lm_head`'s chunked loss): one fp32 logits buffer serves every
chunk and the softmax is taken in place in it. A fresh (rows, V) tensor per chunk and op costs more in page
faults on a CPU than the arithmetic.
"""
from __future__ import annotations

from typing import Optional

import torch

from logo.model.layers import PackedSeqs, rope_cos_sin
from logo.model.lm_head import CHUNK_ELEMENTS, IGNORE_INDEX, autocast_operands


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
def token_logprobs(model, h: torch.Tensor, targets: torch.Tensor,
                   greedy: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """h (n, d) hidden states, targets (n,) next tokens -> (log p(target) (n,) fp32, target is the argmax over
    the real vocabulary (n,) bool, or None when `greedy` is False). Targets of -100 give 0 / False."""
    n, vocab = h.shape[0], model.cfg.vocab_size
    hc, w = autocast_operands(h, model.output.weight)
    rows = max(1, CHUNK_ELEMENTS // w.shape[0])
    logp = torch.zeros(n, dtype=torch.float32, device=h.device)
    hits = torch.zeros(n, dtype=torch.bool, device=h.device) if greedy else None
    buf = torch.empty(min(rows, n), w.shape[0], dtype=torch.float32, device=h.device)  # (rows, V)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, n, rows):
            t = targets[s:s + rows]
            logits = _chunk_logits(buf, hc[s:s + rows], w)
            target_logit = logits.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
            if hits is not None:
                hits[s:s + rows] = logits[:, :vocab].argmax(1) == t
            top = logits.amax(1, keepdim=True)
            lse = top.squeeze(1) + logits.sub_(top).exp_().sum(1).log()  # in place: the logits are spent
            logp[s:s + rows] = torch.where(t != IGNORE_INDEX, target_logit - lse, 0.0)
    return logp, hits


def _chunk_logits(buf: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h (c, d) @ w (V, d)^T written into the first c rows of the fp32 buffer."""
    logits = buf[:h.shape[0]]
    if h.dtype == torch.float32 and w.dtype == torch.float32:
        return torch.mm(h, w.t(), out=logits)
    return logits.copy_(h @ w.t())
