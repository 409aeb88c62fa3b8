"""The report's PNG plots: loss against training compute and against parameters (runs, seed means, fitted
curves), realized global ratio per layer across the sweep, and training-loss curves."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from logo.report.cells import Cell


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path) -> Path:
    plt = _plt()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_vs(cells: list[Cell], x_key: str, y_key: str, fits: dict, path: Path, xlabel: str) -> Optional[Path]:
    """One series per model: every run (dots), the seed mean +- std (error bars), the fitted curve (line)."""
    series: dict[str, list[Cell]] = {}
    for c in cells:
        if c.stat(x_key).n and c.stat(y_key).n:
            series.setdefault(c.name, []).append(c)
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, cs) in enumerate(sorted(series.items())):
        color = f"C{i}"
        xs = [v[x_key] for c in cs for v in c.values if x_key in v and y_key in v]
        ys = [v[y_key] for c in cs for v in c.values if x_key in v and y_key in v]
        ax.scatter(xs, ys, s=12, alpha=0.35, color=color)
        cs = sorted(cs, key=lambda c: c.stat(x_key).mean)
        ax.errorbar([c.stat(x_key).mean for c in cs], [c.stat(y_key).mean for c in cs],
                    yerr=[c.stat(y_key).std or 0.0 for c in cs], fmt="o", color=color, capsize=3, label=name)
        fit = fits.get(name)
        if fit is not None:
            grid = np.geomspace(min(xs) / 1.5, max(xs) * 1.5, 200)
            law = fit.law
            ax.plot(grid, law.predict(grid), color=color, lw=1.2,
                    label=f"{name}: {law.E:.3f} + {law.A:.3g}·x^-{law.alpha:.3f}")
    ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=y_key.replace("_", " "), title=f"{y_key.replace('_', ' ')} vs {xlabel}")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return save(fig, path)


def ratio_per_layer(cells: list[Cell], path: Path) -> Optional[Path]:
    """Realized global ratio by layer (seed mean +- std), one line per cell, target budget dashed."""
    with_ratio = [c for c in cells if any(k.startswith("ratio/") for k in c.keys())]
    if not with_ratio:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, c in enumerate(with_ratio):
        layers = sorted(int(k.split("/")[1]) for k in c.keys() if k.startswith("ratio/"))
        stats = [c.stat(f"ratio/{j}") for j in layers]
        ax.errorbar(layers, [s.mean for s in stats], yerr=[s.std or 0.0 for s in stats], marker="o", ms=3,
                    capsize=2, color=f"C{i % 10}", label=c.label)
        if c.budget is not None:
            ax.axhline(c.budget, color=f"C{i % 10}", ls="--", lw=0.8)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="layer", ylabel="realized global ratio", ylim=(-0.02, 1.02),
           title="realized global ratio per layer (dashed: target budget)")
    ax.legend(fontsize=7)
    return save(fig, path)


def loss_curves(cells: list[Cell], path: Path) -> Optional[Path]:
    """Training loss against tokens for every run, one color per cell."""
    if not cells:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, c in enumerate(cells):
        for j, run in enumerate(c.runs):
            rec = run.train_records
            ax.plot([r.get("tokens", r["step"]) for r in rec], [r["loss"] for r in rec], color=f"C{i % 10}", lw=0.8,
                    alpha=0.8, label=c.label if j == 0 else None)
    ax.set(xlabel="tokens", ylabel="training loss", title="training loss (every run)")
    ax.legend(fontsize=7)
    return save(fig, path)
