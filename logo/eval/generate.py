"""Greedy decoding for evaluation (needle retrieval): full re-encoding per step, no cache.

The model is evaluated exactly as trained (LoGo routing included); re-encoding costs O(new_tokens) forwards,
which is fine for the few answer tokens that needle tasks need.
"""
from __future__ import annotations

from typing import Optional

import torch


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: Optional[set[int]] = None,
                    device: Optional[torch.device] = None, autocast_dtype: Optional[torch.dtype] = None) -> list[int]:
    """Append up to max_new_tokens argmax tokens to prompt_ids; stop early at any id in stop_ids."""
    device = device or next(model.parameters()).device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)[None]  # (1, T)
    new: list[int] = []
    vocab = model.cfg.vocab_size  # never emit padded-vocabulary ids
    for _ in range(max_new_tokens):
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(ids).logits[0, -1, :vocab]
        nxt = int(logits.float().argmax())
        if stop_ids and nxt in stop_ids:
            break
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return new
