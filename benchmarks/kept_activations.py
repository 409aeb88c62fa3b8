"""What one transformer block keeps for its backward, per attention kind and execution mode (runs on a CPU).

    python benchmarks/kept_activations.py                       # dim 256, 4 heads, 1 x 2048 rows, bf16 autocast
    python benchmarks/kept_activations.py --rows 4096 --modes eager,block --list

Counts the distinct storages autograd saves during one block's forward (saved-tensor hooks), in units of one
(rows, dim) bf16 tensor, so the figures carry over to any model size: at 1.5B/8k one unit per layer is 0.75 GiB.
Modes: `eager` (plain PyTorch, what an eager step runs), `block` (the whole block under torch.compile, what
`train.compile` runs). The attention
math uses the reference backend, so the count is the model code's, not a kernel's; compiled modes use Inductor
on the CPU. `--list` prints each kept storage (shape, dtype, units).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logo.config import AttentionConfig, ModelConfig  # noqa: E402
from logo.model import logo_attention  # noqa: E402
from logo.model.layers import PackedSeqs, rope_cos_sin  # noqa: E402
from logo.model.transformer import TransformerBlock  # noqa: E402

KINDS = ("full", "local", "intra_layer", "logo")
MODES = ("eager", "block")


def block_of(kind: str, dim: int, heads: int, window: int) -> TransformerBlock:
    cfg = ModelConfig(dim=dim, n_layers=2, n_heads=heads, vocab_size=64,
                      attention=AttentionConfig(kind=kind, window=window, backend="reference")).validate()
    block = TransformerBlock(cfg, 0, kind)
    block.init_weights(0.02, 0.02)
    return block


def kept_storages(block: TransformerBlock, rows: int, mode: str, seed: int = 0) -> list[tuple]:
    """(shape, dtype, bytes) of each distinct storage the block's forward saves for its backward, bf16 autocast,
    fp32 residual stream; LoGo routes half of the rows to the global branch."""
    torch.manual_seed(seed)
    dim, heads = block.attention_norm.shape[0], block.attention.n_heads
    x = torch.randn(1, rows, dim, requires_grad=True)
    seqs = PackedSeqs.build(1, rows, "cpu")
    cos, sin = rope_cos_sin(rows, dim // heads, 10000.0, "cpu")
    attn = block.attention
    if isinstance(attn, logo_attention.LoGoAttention):
        with torch.no_grad():
            attn.threshold.fill_(float(attn.gate_probs(block.attention_norm(x)).median()))
    run = torch.compile(block, fullgraph=True) if mode == "block" else block
    saved: dict[int, tuple] = {}

    def pack(t):
        s = t.untyped_storage()
        saved.setdefault(s.data_ptr(), (tuple(t.shape), t.dtype, s.nbytes()))
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x * 1.0  # a non-leaf block input, as in the model
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(h, cos, sin, seqs)
    return list(saved.values())


def units(storages, rows: int, dim: int) -> float:
    return sum(b for _, _, b in storages) / (rows * dim * 2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {list(KINDS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {list(MODES)}")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--list", action="store_true", help="print every kept storage")
    a = ap.parse_args(argv)
    kinds, modes = a.kinds.split(","), a.modes.split(",")
    for name, given, allowed in (("--kinds", kinds, KINDS), ("--modes", modes, MODES)):
        bad = [v for v in given if v not in allowed]
        if bad:
            ap.error(f"{name}: unknown {bad}; choose from {list(allowed)}")
    print(f"| kind | mode | kept, units of one ({a.rows}, {a.dim}) bf16 tensor |\n|---|---|---|")
    for kind in kinds:
        for mode in modes:
            kept = kept_storages(block_of(kind, a.dim, a.heads, a.window), a.rows, mode)
            print(f"| {kind} | {mode} | {units(kept, a.rows, a.dim):.2f} |")
            if a.list:
                for shape, dtype, nbytes in sorted(kept, key=lambda s: -s[2]):
                    print(f"|   | {shape} {str(dtype).replace('torch.', '')} | {nbytes / (a.rows * a.dim * 2):.3f} |")


if __name__ == "__main__":
    main()
