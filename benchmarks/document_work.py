"""How much a step's work varies with the data: attention inside documents (data.document_mask=true) costs
sum over documents of L(L+1)/2 per window instead of T(T+1)/2, so with packed documents of varied length the
attention share of a step's FLOPs changes from batch to batch. This prints, for a preset, the distribution of
that ratio over the corpus' training windows and what it implies, from FLOPs alone (no GPU): the step-work
spread on one GPU (5th / 95th percentile against the median) and the weak-scaling efficiency lost when every
step waits for the slowest of N ranks (median step work of one rank over the median of the max of N), with the
ranks given contiguous slices of the global batch and with the rows dealt by work (`data.balance`).

    python benchmarks/document_work.py --gpus 2 --per-gpu 2 -- experiment=scaling/470m_full

With `--cp N` it also prints how evenly context parallelism over N ranks divides each window's attention work
inside documents: with the split in use (every document cut into 2N pieces, `logo.parallel.cp.split_documents`)
and with a split of each row into 2N head and tail chunks (the median and the largest ratio of the heaviest
rank's work to the lightest's).

    python benchmarks/document_work.py --cp 2 -- model=1.5b stage.seq_len=32768 stage.global_batch_tokens=32768
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def window_documents(cfg, max_windows: int):
    """The document offsets (S+1,) of each training window (one window per step, as the loader reads them)."""
    from data.default_corpus import ensure_default_corpus
    from data.loader import ShardDataset, TokenLoader
    path = ensure_default_corpus(tokenizer=cfg.data.tokenizer) if cfg.data.kind == "default" else cfg.data.path
    T = cfg.stage.seq_len
    ld = TokenLoader(ShardDataset(path, "train", tokenizer=cfg.data.tokenizer), T, 1, 1, seed=cfg.data.seed)
    for b in range(min(ld.batches_per_epoch, max_windows)):
        (mb,) = ld.step_data(b).micro_batches
        yield mb.cu_seqlens.numpy().astype(np.int64) if mb.cu_seqlens is not None else np.array([0, T])


def window_work(cfg, max_windows: int) -> np.ndarray:
    """(n,) causal attention work of each training window inside its documents, relative to the whole window."""
    from data.balance import segment_work
    T = cfg.stage.seq_len
    return np.array([segment_work(cu) / (T * (T + 1) / 2) for cu in window_documents(cfg, max_windows)])


def causal_work(starts: np.ndarray, lengths: np.ndarray, doc_starts: np.ndarray) -> float:
    """Causal attention work (keys per query, summed) of spans [start, start + length) inside documents that
    begin at doc_starts."""
    first = starts - doc_starts + 1  # the first query's key count
    return float((lengths * first + lengths * (lengths - 1) / 2).sum())


def cp_imbalance(cu: np.ndarray, cp: int) -> tuple[float, float]:
    """(document split, row split): the heaviest cp rank's causal attention work over the lightest's for one
    window with document offsets cu."""
    from logo.parallel.cp import split_documents
    by_docs = [causal_work(p[:, 0], p[:, 1], cu[p[:, 2]]) for p in split_documents(cu, cp)]
    T, n = int(cu[-1]), 2 * cp
    c = T // n
    by_rows = []
    for r in range(cp):
        work = 0.0
        for j in (r, n - 1 - r):  # the chunk's pieces inside documents
            cuts = np.unique(np.concatenate((cu[(cu > j * c) & (cu < (j + 1) * c)], [j * c, (j + 1) * c])))
            doc = np.searchsorted(cu, cuts[:-1], side="right") - 1
            work += causal_work(cuts[:-1], np.diff(cuts), cu[doc])
        by_rows.append(work)
    return max(by_docs) / min(by_docs), max(by_rows) / min(by_rows)


def slowest_balanced(w: np.ndarray, share: float, gpus: int, per_gpu: int, samples: int, rng) -> np.ndarray:
    """(samples,) the heaviest rank's step work when each global batch of gpus x per_gpu windows drawn from the
    windows' attention work w is dealt to the ranks by `data.balance.assign_rows` (as the loader does)."""
    from data.balance import assign_rows
    out = np.empty(samples)
    for s in range(samples):
        batch = rng.choice(w, size=gpus * per_gpu)
        out[s] = (1 - share) + share * batch[assign_rows(batch, gpus)].mean(1).max()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2, help="ranks whose slowest sets each step")
    ap.add_argument("--per-gpu", type=int, default=1, help="sequences per GPU per step (micro-batch x accumulation)")
    ap.add_argument("--max-windows", type=int, default=20000)
    ap.add_argument("--samples", type=int, default=200000)
    ap.add_argument("--cp", type=int, default=0, help="also: how evenly cp ranks divide each window's attention")
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
    balanced = slowest_balanced(w, share, args.gpus, args.per_gpu, min(args.samples, 20000), rng)
    print(f"{cfg.model.name} at {T} tokens, document_mask={cfg.data.document_mask}: attention is "
          f"{100 * share:.0f}% of a step's FLOPs with whole-window attention")
    print(f"attention work per window inside documents ({len(w)} windows): mean {w.mean():.3f}, p10 "
          f"{np.percentile(w, 10):.3f}, median {np.median(w):.3f}, p90 {np.percentile(w, 90):.3f}")
    print(f"step work, {args.per_gpu} sequence(s) per GPU: p5 {100 * (np.percentile(one, 5) / med - 1):+.1f}% / p95 "
          f"{100 * (np.percentile(one, 95) / med - 1):+.1f}% around the median")
    print(f"{args.gpus} ranks, each step as slow as the slowest: weak-scaling efficiency from the data alone "
          f"{100 * med / np.median(slowest):.1f}%; with the rows dealt by work (data.balance=true) "
          f"{100 * med / np.median(balanced):.1f}%")
    if args.cp > 1:
        if T % (2 * args.cp):
            print(f"error: stage.seq_len={T} is not divisible by 2 x --cp={args.cp}", file=sys.stderr)
            return 2
        ratios = np.array([cp_imbalance(cu, args.cp) for cu in window_documents(cfg, args.max_windows)])
        for name, col in (("every document cut into pieces (in use)", 0), ("every row cut into chunks", 1)):
            print(f"cp={args.cp}, {name}: heaviest rank's attention work / lightest's over {len(ratios)} windows: "
                  f"median {np.median(ratios[:, col]):.3f}, p90 {np.percentile(ratios[:, col], 90):.3f}, "
                  f"max {ratios[:, col].max():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
