"""Synthetic episode generation and mixed-loader throughput (one process): tokens/s.

    taskset -c 0 python benchmarks/synthetic_throughput.py [--lengths 2048,4096,8192] [--seconds 1]
                                                           [--seq 2048 --global-batch 64 --micro 8 --window 128 --layers 4]
Part 1: `SyntheticTask.episode` for each task and episode length (the tasks' default parameters, gap 1.0 x
window x layers). Part 2: `MixLoader.next_step()` over conf/data/mix_long_range.yaml's sources (the embedded
corpus, built on first use, and the synthetic tasks at one episode per sequence), tensors and document offsets built.
"""
import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.default_corpus import ensure_default_corpus
from data.loader import ShardDataset
from data.mix import MixLoader, MixSource
from data.synthetic import TASKS, SyntheticParams, SyntheticStream, SyntheticTask, heldout_stream, train_stream

MIX = (("text", None, 0.4), ("recall", "associative_recall", 0.2), ("needles", "needle_retrieval", 0.2),
       ("copy", "far_copy", 0.2))


def rate(fn, seconds: float) -> float:
    """Median tokens/s of fn() (which returns the tokens it made) over 5 windows."""
    rates = []
    for _ in range(5):
        t0, tokens = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds / 5:
            tokens += fn()
        rates.append(tokens / (time.perf_counter() - t0))
    return sorted(rates)[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    gap = a.window * a.layers
    for task in TASKS:
        for L in map(int, a.lengths.split(",")):
            t = SyntheticTask(SyntheticParams(task, L, gap))
            counter = iter(range(1 << 40))
            r = rate(lambda t=t, L=L: t.episode(next(counter), heldout_stream(0)).tokens.size, a.seconds)
            print(f"{task:<20} length {L:>5}: {r / 1e6:6.1f}M tokens/s")
    sources = []
    for name, task, w in MIX:
        if task is None:
            sources.append(MixSource(name, "default", w, ShardDataset(ensure_default_corpus())))
        else:
            t = SyntheticTask(SyntheticParams(task, a.seq, math.ceil(1.0 * gap)))
            sources.append(MixSource(name, "synthetic", w, SyntheticStream(t, train_stream(0, name), name)))
    loader = MixLoader(sources, a.seq, a.global_batch, a.micro)
    r = rate(lambda: sum(b.inputs.numel() for b in loader.next_step()), a.seconds * 5)
    print(f"MixLoader seq {a.seq} global batch {a.global_batch} micro {a.micro}: {r / 1e6:.1f}M tokens/s")


if __name__ == "__main__":
    main()
