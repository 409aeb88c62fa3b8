"""Held-out loss during training: `eval.interval` / `eval.tokens` on the corpus's validation split (of a
mixture, data=mix: its first default or shards source; synthetic sources are scored by `python -m logo.eval
synthetic`).

The validation split is made of whole documents that the training split never holds (`data/prepare.py`
sends document i to `val` when i % k == k-1), so the two never overlap. Each evaluation reads the same
first ceil(eval.tokens / seq_len) windows of the split, in order, whatever the number of ranks (rank r takes
windows r, r+W, ...; rows past the budget are masked), and reduces the summed loss and token count over all
ranks: `eval/loss` (mean next-token cross-entropy, the training loss's definition) and `eval/ppl`.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from data.format import DataError
from data.loader import IGNORE_INDEX, ShardDataset, TokenLoader


class HeldOutEval:
    """Built once by the trainer; `maybe_evaluate(step, model, autocast)` each step (all ranks)."""

    def __init__(self, cfg, plan, corpus: Optional[Path], rank: int, world: int, device: torch.device,
                 group=None):
        """corpus: the prepared corpus whose `eval.split` is read (None only with eval.interval=0); rank / world:
        this rank's data shard and the number of shards; group: the ranks holding different shards (None: the
        default group). Ranks of one shard (tensor/context parallel) compute the same sums."""
        self.group = group
        # CUDA graphs record one graph per input shape: document offsets in buckets, as the training batches'
        self.doc_buckets = cfg.train.cuda_graphs
        e = cfg.eval
        self.interval, self.last_step, self.device = e.interval, plan.steps, device
        self.last_seconds = 0.0
        if self.interval <= 0:
            return
        ds = ShardDataset(corpus, e.split, tokenizer=cfg.data.tokenizer)
        if ds.num_tokens < 2:  # nothing to predict: an evaluation would read as loss 0, ppl 1
            raise DataError(f"invalid config eval.interval={e.interval}: the {e.split!r} split of "
                            f"{corpus} has {ds.num_tokens} tokens, nothing to evaluate on; prepare the "
                            f"corpus with a validation split (python -m data.prepare ... --val-fraction F) or set "
                            f"eval.interval=0")
        self.rank, self.world = rank, world
        self.micro = e.micro_batch or plan.micro_batch
        self.loader = TokenLoader(ds, plan.seq_len, self.micro * world, self.micro, rank, world,
                                  document_mask=cfg.data.document_mask)
        all_windows = -(-(ds.num_tokens - 1) // plan.seq_len)
        self.windows = min(all_windows, -(-e.tokens // plan.seq_len))
        self.batches = -(-self.windows // (self.micro * world))

    def due(self, step: int) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or step == self.last_step)

    @torch.no_grad()
    def maybe_evaluate(self, step: int, model, autocast) -> dict:
        """{"eval/loss", "eval/ppl"} when an evaluation is due at `step` (after its optimizer step), else {}."""
        self.last_seconds = 0.0
        if not self.due(step):
            return {}
        t0 = time.perf_counter()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss sum, tokens]
        for j, b in enumerate(self.loader.iter_eval(max_batches=self.batches)):
            window = self.rank + self.world * (j * self.micro + torch.arange(self.micro))  # (M,) window ids
            labels = b.labels.masked_fill((window >= self.windows)[:, None], IGNORE_INDEX).to(self.device)
            b = (b.with_bucketed_offsets() if self.doc_buckets else b).to(self.device)
            with autocast:  # chunked: without gradients it only takes the loss, one chunk of logits at a time
                ce = model(b.inputs, cu_seqlens=b.cu_seqlens, valid=b.valid, labels=labels,
                           loss_impl="chunked").loss_sum
            sums += torch.stack((ce.double(), (labels != IGNORE_INDEX).sum().double()))
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(sums, group=self.group)
        loss = float(sums[0] / sums[1].clamp_min(1))
        self.last_seconds = time.perf_counter() - t0
        return {"eval/loss": loss, "eval/ppl": math.exp(loss)}
