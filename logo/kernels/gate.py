"""The LoGo gate's two token reductions, each in the form that suits how it runs: eagerly or in a compiled graph.

- `gate_logit`: x @ w_g in fp32. Eagerly, given the narrower copy of x that the projections keep, the weight's
  gradient reads that copy (no fp32 copy of x is kept for the backward). In a compiled graph, the plain product:
  its partitioner keeps no fp32 copy of x either, and Inductor fuses the weight's gradient into the block's other
  row reductions.
- `bin_counts`: a histogram of bin indices. Eagerly `torch.histc` (on CUDA one shared-memory histogram per block;
  a scatter-add would serialise on the few bins a fresh gate occupies). In a compiled graph a one-hot comparison
  summed over the tokens, which Inductor generates as one reduction kernel fused with the bin computation (histc
  is an extern call between the graph's kernels, each issued by the host).

Both forms give the same values (the gradients up to x's rounding in the narrow copy), so the model's code calls
these and never asks how it runs.
"""
from __future__ import annotations

from typing import Optional

import torch


def gate_logit(x: torch.Tensor, x_low: Optional[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """x (N, d) in at least fp32, w (d,) in x's dtype -> (N,) logits. x_low: x in the projections' precision
    (..., d), or None; its rounding enters only w's gradient, eagerly, where it is narrower than x."""
    if x_low is None or x_low.dtype == x.dtype or torch.compiler.is_compiling():
        return x @ w
    # x_low takes no gradient here (x's flows through x): detached, it adds no edge to the autograd graph
    return _LogitKeepingNarrowInput.apply(x, x_low.detach(), w)


class _LogitKeepingNarrowInput(torch.autograd.Function):
    """x @ w in x's precision, keeping a narrower copy of x (the projections' own) for w's gradient.

    forward: x (N, d) fp32, x_low (..., d) bf16/fp16 (the same values, rounded), w (d,) fp32 -> (N,) fp32.
    backward: dx = g w^T exactly; dw = x_low^T g in fp32 (x's rounding enters dw only, as it does for W_q, W_k,
    W_v, whose gradients read the same copy)."""

    @staticmethod
    def forward(ctx, x, x_low, w):
        ctx.save_for_backward(x_low, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):  # g (N,) fp32
        x_low, w = ctx.saved_tensors
        # fp32 products also where the backward runs under the forward's caller's autocast
        with torch.autocast(g.device.type, enabled=False):
            dx = g[:, None] * w[None, :] if ctx.needs_input_grad[0] else None  # (N, d)
            dw = torch.mv(x_low.flatten(0, -2).t().to(g.dtype), g) if ctx.needs_input_grad[2] else None  # (d,)
        return dx, None, dw


def bin_counts(idx: torch.Tensor, valid: torch.Tensor, bins: int) -> torch.Tensor:
    """(bins,) fp32: how many valid tokens have each bin index, idx (N,) integral floats in [0, bins), valid (N,)
    bool or 0/1."""
    if torch.compiler.is_compiling():
        return one_hot_counts(idx, valid, bins)
    centre = torch.where(valid.bool(), idx + 0.5, -1.0)  # invalid tokens fall outside [0, bins]: not counted
    return torch.histc(centre, bins=bins, min=0, max=bins)


def one_hot_counts(idx: torch.Tensor, valid: torch.Tensor, bins: int) -> torch.Tensor:
    """`bin_counts` as a (N, bins) comparison summed over the tokens, which a compiled graph never materialises.
    The same counts as histc (sums of ones, exact in fp32 below 2^24 tokens)."""
    hit = (idx[:, None] == torch.arange(bins, device=idx.device, dtype=idx.dtype)[None, :]) & valid.bool()[:, None]
    return hit.sum(0, dtype=torch.float32)
