"""Greedy decoding for evaluation (needle retrieval): with KV caches (`logo.eval.decode`, the default) or by
re-encoding the whole prefix for every new token (the reference the cached decoder is tested against).

The model is evaluated exactly as trained (LoGo routing included).
"""
from __future__ import annotations

from typing import Optional

import torch

from logo.eval.decode import generate


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: Optional[set[int]] = None,
                    device: Optional[torch.device] = None, autocast_dtype: Optional[torch.dtype] = None,
                    use_cache: bool = True) -> list[int]:
    """Append up to max_new_tokens argmax tokens to prompt_ids; stop early at any id in stop_ids."""
    device = device or next(model.parameters()).device
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        if use_cache:
            return generate(model, [prompt_ids], max_new_tokens, stop_ids).tokens[0]
        return _reencode(model, prompt_ids, max_new_tokens, stop_ids, device)


def _reencode(model, prompt_ids, max_new_tokens, stop_ids, device) -> list[int]:
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)[None]  # (1, T)
    new: list[int] = []
    vocab = model.cfg.vocab_size  # never emit padded-vocabulary ids
    for _ in range(max_new_tokens):
        nxt = int(model(ids).logits[0, -1, :vocab].float().argmax())
        if stop_ids and nxt in stop_ids:
            break
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return new
