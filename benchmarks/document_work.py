"""How much a step's work varies with the data: attention inside documents (data.document_mask=true) costs
sum over documents of L(L+1)/2 per window instead of T(T+1)/2, so with packed documents of varied length the
attention share of a step's FLOPs changes from batch to batch. This prints, for a preset, the distribution of
that ratio over the corpus' training windows and what it implies, from FLOPs alone (no GPU): the step-work
spread on one GPU (5th / 95th percentile against the median) and the weak-scaling efficiency lost when every
step waits for the slowest of N ranks (median step work of one rank over the median of the max of N).

    python benchmarks/document_work.py --gpus 2 --per-gpu 2 -- experiment=scaling/470m_full
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def window_work(cfg, max_windows: int) -> np.ndarray:
    """(n,) causal attention work of each training window inside its documents, relative to the whole window."""
    from data.default_corpus import ensure_default_corpus
    from data.loader import ShardDataset, TokenLoader
    path = ensure_default_corpus(tokenizer=cfg.data.tokenizer) if cfg.data.kind == "default" else cfg.data.path
    T = cfg.stage.seq_len
    ld = TokenLoader(ShardDataset(path, "train", tokenizer=cfg.data.tokenizer), T, 1, 1, seed=cfg.data.seed)
    out = []
    for b in range(min(ld.batches_per_epoch, max_windows)):
        (mb,) = ld.step_data(b).micro_batches
        lengths = np.diff(mb.cu_seqlens.numpy().astype(np.int64)) if mb.cu_seqlens is not None else np.array([T])
        out.append(float((lengths * (lengths + 1) / 2).sum() / (T * (T + 1) / 2)))
    return np.array(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2, help="ranks whose slowest sets each step")
    ap.add_argument("--per-gpu", type=int, default=1, help="sequences per GPU per step (micro-batch x accumulation)")
    ap.add_argument("--max-windows", type=int, default=20000)
    ap.add_argument("--samples", type=int, default=200000)
    ap.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = ap.parse_args(argv)
    import torch
    from logo.model import Transformer
    from logo.model.flops import attention_flops_per_token, param_counts, train_flops_per_token
    from logo.run.config import compose
    cfg = compose(list(args.overrides))[0]
    T = cfg.stage.seq_len
    with torch.device("meta"):
        _, non_emb = param_counts(Transformer(cfg.model))
    share = 3 * attention_flops_per_token(cfg.model, T) / train_flops_per_token(cfg.model, T, non_emb)
    w = window_work(cfg, args.max_windows) if cfg.data.document_mask else np.ones(1)
    rng = np.random.default_rng(0)

    def rank_work():  # (samples,) one rank's step work relative to a step of whole-window attention
        return (1 - share) + share * rng.choice(w, size=(args.samples, args.per_gpu)).mean(1)
    one = rank_work()
    slowest = np.max([rank_work() for _ in range(args.gpus)], axis=0)
    med = np.median(one)
    print(f"{cfg.model.name} at {T} tokens, document_mask={cfg.data.document_mask}: attention is "
          f"{100 * share:.0f}% of a step's FLOPs with whole-window attention")
    print(f"attention work per window inside documents ({len(w)} windows): mean {w.mean():.3f}, p10 "
          f"{np.percentile(w, 10):.3f}, median {np.median(w):.3f}, p90 {np.percentile(w, 90):.3f}")
    print(f"step work, {args.per_gpu} sequence(s) per GPU: p5 {100 * (np.percentile(one, 5) / med - 1):+.1f}% / p95 "
          f"{100 * (np.percentile(one, 95) / med - 1):+.1f}% around the median")
    print(f"{args.gpus} ranks, each step as slow as the slowest: weak-scaling efficiency from the data alone "
          f"{100 * med / np.median(slowest):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
