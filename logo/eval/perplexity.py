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
from data.loader import IGNORE_INDEX, Batch, ShardDataset, TokenLoader
from logo.config import ConfigError
from logo.run.load import Loaded
from logo.eval.progress import Progress
from logo.eval.scoring import context_positions, hidden_states, token_logprobs
from data.default_corpus import ensure_default_corpus


def corpus_path(loaded: Loaded, data: Optional[str]) -> Path:
    """--data PATH, else the corpus the run trained on (the embedded default corpus or data.path; of a mixture,
    its first default or shards source)."""
    if data:
        return Path(data)
    d = loaded.cfg.data
    kind, path = d.kind, d.path
    if kind == "mix":
        corpora = [s for s in d.sources if s.kind in ("default", "shards")]
        if not corpora:
            raise DataError(f"the run {loaded.run_dir} trained on synthetic sources only (data.sources: "
                            f"{', '.join(s.name for s in d.sources)}): pass --data DIR, a prepared corpus")
        kind, path = corpora[0].kind, corpora[0].path
    if kind == "default":
        return ensure_default_corpus(tokenizer=d.tokenizer)
    return Path(path)


def default_bucket_size(seq_len: int) -> int:
    return max(1, seq_len // 8)


def _window_budget(split_tokens: int, T: int, tokens: int) -> tuple[int, int]:
    """(windows to read, tokens they predict) for a split of `split_tokens` and a budget of `tokens` (0: all)."""
    windows = -(-(split_tokens - 1) // T)
    if tokens:
        windows = min(windows, -(-tokens // T))
    return windows, min(windows * T, split_tokens - 1)


def _first_rows(b: Batch, rows: int) -> Batch:
    """The batch's first `rows` rows (their document offsets included): rows past the budget never run."""
    if rows >= b.inputs.shape[0]:
        return b
    T = b.inputs.shape[1]
    cu = None if b.cu_seqlens is None else b.cu_seqlens[b.cu_seqlens <= rows * T]
    return Batch(b.inputs[:rows], b.labels[:rows], cu, b.valid[:rows])


def _score_batch(loaded: Loaded, b: Batch, bucket: int, loss_sum: torch.Tensor, count: torch.Tensor) -> int:
    """Add the batch's per-bucket losses (on the device) and token counts (on the host); returns its tokens."""
    model, dev = loaded.model, loaded.device
    labels = b.labels.flatten()
    keep = (labels != IGNORE_INDEX).nonzero().squeeze(1)  # (n,) on the host: no device read
    idx = (context_positions(model, *b.inputs.shape, b.cu_seqlens).flatten()[keep] // bucket).clamp_max(
        count.shape[0] - 1)
    with loaded.autocast():
        h = hidden_states(model, b.inputs.to(dev), None if b.cu_seqlens is None else b.cu_seqlens.to(dev),
                          b.valid.to(dev))
        logp, _ = token_logprobs(model, h.flatten(0, 1)[keep.to(dev)], labels[keep].to(dev), greedy=False)
    loss_sum.index_add_(0, idx.to(dev), -logp.double())
    count += torch.bincount(idx, minlength=count.shape[0])
    return int(keep.shape[0])


@torch.inference_mode()
def perplexity(loaded: Loaded, data: Optional[str] = None, split: str = "val", seq_len: Optional[int] = None,
               tokens: int = 0, bucket_size: Optional[int] = None, batch_size: int = 4,
               progress: Optional[Progress] = None) -> dict:
    """Results dict: dataset, split, seq_len, tokens, loss, ppl, buckets [{start, end, tokens, loss, ppl}].
    `progress`: its bar shows the predicted tokens (none drawn when not given)."""
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
        raise DataError(f"split {split!r} of the corpus {path} has {ds.num_tokens} token"
                        f"{'' if ds.num_tokens == 1 else 's'}: perplexity needs at least 2 (a context and a token "
                        f"to predict)")
    loader = TokenLoader(ds, T, batch_size, batch_size, document_mask=loaded.cfg.data.document_mask)
    n_windows, to_predict = _window_budget(ds.num_tokens, T, tokens)
    n_buckets = -(-T // bucket)
    loss_sum = torch.zeros(n_buckets, dtype=torch.float64, device=loaded.device)
    count = torch.zeros(n_buckets, dtype=torch.int64)
    progress = progress or Progress(enabled=False)
    with progress.bar(to_predict, f"perplexity [{split}]"):
        for j, b in enumerate(loader.iter_eval(max_batches=-(-n_windows // batch_size))):
            n = _score_batch(loaded, _first_rows(b, n_windows - j * batch_size), bucket, loss_sum, count)
            progress.update(n, tokens=n)
    loss_sum = loss_sum.cpu()
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
