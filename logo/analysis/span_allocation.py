"""Span-allocation analysis of a LoGo model (paper Sec. 4.5 and Appendix D.3).

- `record_routing(model, tokens)`: the exact routing decisions z (L_logo, B, T) of one forward, recorded with
  forward pre-hooks on the LoGo layers (the gate and threshold are re-applied to each layer's input, so the
  model code is untouched).
- `allocation_stats(z, valid)`: layer-wise realized ratio and the token-wise distribution of how many layers
  route each token global.
- `word_scores(...)`: per-token global-layer counts shifted by one position (routing at t serves the
  prediction of token t+1), as the paper's word-level visualization does.
- `plot_allocation(...)`: the two panels of the paper's Figure 6 for one domain, as a PNG.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from logo.model.routing import route


@contextmanager
def _routing_hooks(model, sink: list):
    handles = []
    for layer in model.logo_layers():
        def pre_hook(module, args, sink=sink):
            x, _cos, _sin, seqs = args
            with torch.no_grad():
                z = route(module.gate_probs(x), module.threshold, seqs)
            sink.append(z.view(x.shape[0], x.shape[1]).cpu())
        handles.append(layer.register_forward_pre_hook(pre_hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def record_routing(model, tokens: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                   valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(L_logo, B, T) bool: which tokens each LoGo layer routed to the global branch."""
    if not model.logo_layer_ids:
        raise ValueError("the model has no LoGo layers (attention.kind is not logo / inter_layer+logo)")
    sink: list[torch.Tensor] = []
    with _routing_hooks(model, sink):
        model(tokens, cu_seqlens=cu_seqlens, valid=valid)
    return torch.stack(sink)


def allocation_stats(z: torch.Tensor, valid: Optional[torch.Tensor] = None) -> dict:
    """Layer-wise ratios (L,) and the histogram (L+1,) of per-token global-layer counts over valid tokens."""
    L = z.shape[0]
    v = torch.ones(z.shape[1:], dtype=torch.bool) if valid is None else valid.bool().cpu()
    n = int(v.sum())
    per_layer = (z & v).flatten(1).sum(1).double() / max(n, 1)
    counts = z.sum(0)[v]  # (n,) number of global layers per valid token
    hist = torch.bincount(counts, minlength=L + 1)
    return {
        "layer_ratio": per_layer.tolist(),
        "mean_ratio": float(per_layer.mean()),
        "global_layers_histogram": hist.tolist(),
        "tokens": n,
    }


def word_scores(z: torch.Tensor) -> torch.Tensor:
    """(B, T) number of layers that routed global for the prediction of each token (shifted by one)."""
    counts = z.sum(0).float()  # (B, T): routing at position t is used to predict token t+1
    shifted = torch.zeros_like(counts)
    shifted[:, 1:] = counts[:, :-1]
    return shifted


def plot_allocation(stats: dict, title: str, path: str) -> None:
    """Layer-wise realized ratio (bars) and token-wise global-layer histogram, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    ratios = stats["layer_ratio"]
    ax1.bar(range(len(ratios)), ratios, color="tab:orange")
    ax1.axhline(stats["mean_ratio"], color="k", lw=1, ls="--", label=f"mean {stats['mean_ratio']:.3f}")
    ax1.set(xlabel="LoGo layer", ylabel="global ratio", ylim=(0, 1), title=f"{title}: layer-wise allocation")
    ax1.legend(loc="upper right")
    hist = torch.tensor(stats["global_layers_histogram"], dtype=torch.float64)
    ax2.bar(range(len(hist)), (hist / hist.sum().clamp_min(1)).tolist(), color="tab:blue")
    ax2.set(xlabel="layers with global span", ylabel="fraction of tokens", title=f"{title}: token-wise allocation")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
