"""Span-allocation analysis of a LoGo model (paper Sec. 4.5 and Appendix D.3).

- `record_routing(model, tokens)`: the exact routing decisions z (L_logo, B, T) of one forward, recorded with
  forward pre-hooks on the LoGo layers (the gate and threshold are re-applied to each layer's input, so the
  model code is untouched); `routing_recorded(model, sink)` records them around any forward of the caller's.
- `allocation_stats(z, valid)`: layer-wise realized ratio and the token-wise distribution of how many layers
  route each token global.
- `word_scores(...)`: per-token global-layer counts shifted by one position (routing at t serves the
  prediction of token t+1), as the paper's word-level visualization does.
- `plot_allocation(...)` / `plot_domains(...)`: the two panels of the paper's Figure 6 for one domain / one row
  per domain, as a PNG; `word_spans(...)` + `plot_words(...)`: the word-level view, as a PNG.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from logo.model.logo_attention import route


@contextmanager
def routing_recorded(model, sink: list):
    """Within the block, every forward through the LoGo layers appends each layer's routing (B, T) bool to `sink`,
    in layer order (one forward: len(model.logo_layer_ids) entries)."""
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
    with routing_recorded(model, sink):
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


def _draw_allocation(ax1, ax2, stats: dict, title: str) -> None:
    ratios = stats["layer_ratio"]
    ax1.bar(range(len(ratios)), ratios, color="tab:orange")
    ax1.set_xticks(range(len(ratios)), [str(i) for i in stats.get("layer_ids", range(len(ratios)))])
    ax1.axhline(stats["mean_ratio"], color="k", lw=1, ls="--", label=f"mean {stats['mean_ratio']:.3f}")
    ax1.set(xlabel="layer", ylabel="global ratio", ylim=(0, 1), title=f"{title}: layer-wise allocation")
    ax1.legend(loc="upper right")
    hist = torch.tensor(stats["global_layers_histogram"], dtype=torch.float64)
    ax2.bar(range(len(hist)), (hist / hist.sum().clamp_min(1)).tolist(), color="tab:blue")
    ax2.set(xlabel="layers with global span", ylabel="fraction of tokens", title=f"{title}: token-wise allocation")


def plot_allocation(stats: dict, title: str, path: str) -> None:
    """Layer-wise realized ratio (bars) and token-wise global-layer histogram, side by side."""
    plot_domains({title: stats}, path)


def plot_domains(stats_by_domain: dict, path: str) -> None:
    """The paper's Figure 6 layout: one row per domain, layer-wise ratio left, token-wise distribution right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(stats_by_domain)
    fig, axes = plt.subplots(n, 2, figsize=(11, 3.4 * n), squeeze=False)
    for (title, stats), (ax1, ax2) in zip(stats_by_domain.items(), axes):
        _draw_allocation(ax1, ax2, stats, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def word_spans(token_bytes: list[bytes], scores: list[float]) -> list[tuple[str, float]]:
    """Whitespace-separated words of the text the tokens spell, each with the mean score of the tokens that
    overlap it (the paper's word-level view averages a word's constituent tokens). Works on bytes, so a
    character split across tokens is never broken."""
    text = b"".join(token_bytes)
    owner = [i for i, tb in enumerate(token_bytes) for _ in tb]  # (bytes,) token of each byte
    words: list[tuple[str, float]] = []
    start = None
    for j in range(len(text) + 1):
        blank = j == len(text) or text[j:j + 1].isspace()
        if blank and start is not None:
            toks = sorted(set(owner[start:j]))
            words.append((text[start:j].decode("utf-8", errors="replace"),
                          sum(scores[t] for t in toks) / len(toks)))
            start = None
        elif not blank and start is None:
            start = j
    return words


def plot_words(words: list[tuple[str, float]], vmax: float, title: str, path: str, width: int = 110) -> None:
    """Words laid out as wrapped text, each on a background coloured by its score (0..vmax layers)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines, line, used = [], [], 0
    for w, s in words:
        if line and used + len(w) > width:
            lines.append(line)
            line, used = [], 0
        line.append((used, w, s))
        used += len(w) + 1
    if line:
        lines.append(line)
    cmap = plt.get_cmap("YlOrRd")
    fig = plt.figure(figsize=(width * 0.075 + 0.6, 0.26 * len(lines) + 0.9))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(-1, width + 1), ylim=(len(lines) + 0.5, -1.2))
    ax.axis("off")
    ax.text(0, -0.7, f"{title}  (colour: layers with global span, 0..{vmax:g})", fontsize=9, weight="bold")
    for r, ln in enumerate(lines):
        for x, w, s in ln:
            level = s / vmax if vmax else 0.0
            ax.text(x, r + 0.3, w, family="monospace", fontsize=8, color="white" if level > 0.7 else "black",
                    bbox=dict(boxstyle="square,pad=0.08", lw=0, facecolor=cmap(level)))
    fig.savefig(path, dpi=130)
    plt.close(fig)
