"""Perplexity on the held-out split of a prepared corpus, overall and by context position.

Windows of seq_len + 1 tokens walk the split in order (`TokenLoader.iter_eval`, the tail padded), exactly like
the training instances but never shuffled; each predicted token counts once. A token's bucket is the number
of earlier tokens its prediction can attend to (its place in its document when the model masks documents,
else in its window), so the buckets show whether the long context is used.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from data.format import DataError
from data.loader import IGNORE_INDEX, ShardDataset, TokenLoader
from logo.config import ConfigError
from logo.eval.load import Loaded
from logo.eval.scoring import context_positions, hidden_states, token_logprobs


def corpus_path(loaded: Loaded, data: Optional[str]) -> Path:
    """--data PATH, else the corpus the run trained on (the embedded default corpus or data.path)."""
    if data:
        return Path(data)
    if loaded.cfg.data.kind == "default":
        from data.default_corpus import ensure_default_corpus
        return ensure_default_corpus(tokenizer=loaded.cfg.data.tokenizer)
    return Path(loaded.cfg.data.path)


def default_bucket_size(seq_len: int) -> int:
    return max(1, seq_len // 8)


@torch.no_grad()
def perplexity(loaded: Loaded, data: Optional[str] = None, split: str = "val", seq_len: Optional[int] = None,
               tokens: int = 0, bucket_size: Optional[int] = None, batch_size: int = 4) -> dict:
    """Results dict: dataset, split, seq_len, tokens, loss, ppl, buckets [{start, end, tokens, loss, ppl}]."""
    T = seq_len or loaded.seq_len
    bucket = bucket_size or default_bucket_size(T)
    for name, v in (("seq_len", T), ("bucket_size", bucket), ("batch_size", batch_size)):
        if v < 1:
            raise ConfigError(f"invalid {name}={v}: must be >= 1")
    if tokens < 0:
        raise ConfigError(f"invalid tokens={tokens}: must be >= 0 (0 = the whole split)")
    path = corpus_path(loaded, data)
    if not (path / "manifest.json").exists():
        raise DataError(f"{path} is not a prepared corpus (no manifest.json); make one with python -m data.prepare")
    ds = ShardDataset(path, split, tokenizer=loaded.cfg.data.tokenizer)
    if ds.num_tokens < 2:
        raise DataError(f"{path} split {split!r} has {ds.num_tokens} tokens: nothing to predict")
    loader = TokenLoader(ds, T, batch_size, batch_size, document_mask=loaded.cfg.data.document_mask)
    n_windows = -(-(ds.num_tokens - 1) // T)
    if tokens:
        n_windows = min(n_windows, -(-tokens // T))
    n_buckets = -(-T // bucket)
    loss_sum = torch.zeros(n_buckets, dtype=torch.float64)
    count = torch.zeros(n_buckets, dtype=torch.int64)
    model, dev = loaded.model, loaded.device
    for j, b in enumerate(loader.iter_eval(max_batches=-(-n_windows // batch_size))):
        labels = b.labels.clone()
        labels[n_windows - j * batch_size:] = IGNORE_INDEX  # rows past the token budget
        with loaded.autocast():
            h = hidden_states(model, b.inputs.to(dev), None if b.cu_seqlens is None else b.cu_seqlens.to(dev),
                              b.valid.to(dev))
            logp, _ = token_logprobs(model, h.flatten(0, 1), labels.flatten().to(dev))
        keep = labels.flatten() != IGNORE_INDEX
        pos = context_positions(model, *b.inputs.shape, b.cu_seqlens).flatten()
        idx = (pos[keep] // bucket).clamp_max(n_buckets - 1)
        loss_sum.index_add_(0, idx, -logp.cpu().double()[keep])
        count += torch.bincount(idx, minlength=n_buckets)
    total = int(count.sum())
    loss = float(loss_sum.sum() / max(total, 1))
    buckets = [{"start": i * bucket, "end": min((i + 1) * bucket, T), "tokens": int(count[i]),
                "loss": float(loss_sum[i] / count[i]), "ppl": math.exp(float(loss_sum[i] / count[i]))}
               for i in range(n_buckets) if count[i] > 0]
    return {"dataset": str(path), "split": split, "seq_len": T, "tokens": total, "loss": loss,
            "ppl": math.exp(loss), "buckets": buckets}


def perplexity_metrics(res: dict) -> dict:
    """Scalars for the run's logger: eval/loss, eval/ppl and eval/ppl_by_position/<start>-<end>."""
    m = {"eval/loss": res["loss"], "eval/ppl": res["ppl"]}
    m.update({f"eval/ppl_by_position/{b['start']}-{b['end']}": b["ppl"] for b in res["buckets"]})
    return m
