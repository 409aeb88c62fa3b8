"""Loader throughput (reading + batching, one process): tokens/s of TokenLoader.next_step().

    taskset -c 0 python benchmarks/loader_throughput.py [--seq 8192] [--global-batch 32] [--micro 4] [--seconds 5]
                                                        [--path DIR] [--no-doc-mask]
Reads the embedded default corpus (built on first use) unless --path names a prepared corpus.
"""
import argparse
import time

from data.default_corpus import ensure_default_corpus
from data.loader import ShardDataset, TokenLoader


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--no-doc-mask", action="store_true")
    ap.add_argument("--path", help="a corpus prepared with python -m data.prepare (default: the embedded one)")
    args = ap.parse_args()
    ds = ShardDataset(args.path or ensure_default_corpus())
    loader = TokenLoader(ds, args.seq, args.global_batch, args.micro, seed=0, document_mask=not args.no_doc_mask)
    rates = []
    for _ in range(5):
        t0, tokens = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.seconds / 5:
            for b in loader.next_step():
                tokens += b.inputs.numel()
        rates.append(tokens / (time.perf_counter() - t0))
    rates.sort()
    print(f"seq={args.seq} global_batch={args.global_batch} micro={args.micro} doc_mask={not args.no_doc_mask}: "
          f"median {rates[2] / 1e6:.1f}M tokens/s (min {rates[0] / 1e6:.1f}M, max {rates[-1] / 1e6:.1f}M)")


if __name__ == "__main__":
    main()
