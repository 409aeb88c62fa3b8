"""The report's PNG plots: loss against training compute and against parameters (runs, seed means, fitted
curves), realized global ratio per layer across the sweep, and training-loss curves; for a layout that asks, the
ratio-per-layer heatmap of the LoGo runs (the realized-ratio check) and the span allocation on the synthetic tasks."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from logo.report.cells import Cell
from logo.report.checks import RatioCheck


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


def ratio_heatmap(checks: list[RatioCheck], path: Path) -> Optional[Path]:
    """LoGo layer x run heatmap of the realized ratio minus rho, each cell annotated with the ratio; a layer
    outside rho +- tolerance is outlined."""
    checks = [c for c in checks if c.off is not None]
    if not checks:
        return None
    runs = list(dict.fromkeys(c.run for c in checks))
    layers = sorted({c.layer for c in checks})
    grid = np.full((len(layers), len(runs)), np.nan)
    by_pos = {(layers.index(c.layer), runs.index(c.run)): c for c in checks}
    for (i, j), c in by_pos.items():
        grid[i, j] = c.off
    tol = checks[0].tolerance
    span = max(2 * tol, float(np.nanmax(np.abs(grid))))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5.5, 2.0 + 0.9 * len(runs)), 1.4 + 0.4 * len(layers)))
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-span, vmax=span, aspect="auto")
    for (i, j), c in by_pos.items():
        ax.text(j, i, f"{c.ratio:.3f}", ha="center", va="center", fontsize=7,
                color="white" if abs(c.off) > 0.6 * span else "black")
        if not c.within:
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="k", lw=2))
    labels = [f"{Path(r).name}\n(seed {next(c.seed for c in checks if c.run == r)})" for r in runs]
    ax.set_xticks(range(len(runs)), labels, fontsize=6, rotation=30, ha="right")
    ax.set_yticks(range(len(layers)), [f"L{i}" for i in layers], fontsize=7)
    fig.colorbar(im, ax=ax, label="realized ratio - rho")
    ax.set_title(f"realized global ratio per LoGo layer\n(colour: minus rho; outlined: off by > {tol:g})", fontsize=8)
    return save(fig, path)


def span_allocation(cells: list[Cell], spans: dict[str, list[int]], path: Path) -> Optional[Path]:
    """Per synthetic task (one panel each) and LoGo cell: each layer's global ratio at the far-context positions
    and over every position (bars: seed mean, error bars: std)."""
    panels = [(label, c, layers) for label, layers in spans.items() for c in cells
              if any(c.stat(f"span/{label}/far/{i}").n for i in layers)]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3 * len(panels)), squeeze=False)
    for ax, (label, c, layers) in zip(axes[:, 0], panels):
        x = np.arange(len(layers))
        for k, (where, name, color) in enumerate((("far", "far-context positions", "tab:red"),
                                                  ("all", "every position", "tab:gray"))):
            stats = [c.stat(f"span/{label}/{where}/{i}") for i in layers]
            ax.bar(x + (k - 0.5) * 0.38, [s.mean if s.n else np.nan for s in stats], 0.38,
                   yerr=[s.std or 0.0 for s in stats], color=color, capsize=2, label=name)
        ax.set_xticks(x, [f"L{i}" for i in layers])
        ax.set(ylim=(0, 1.02), ylabel="routed global", title=f"{c.row}: {label}")
        ax.legend(fontsize=7)
    return save(fig, path)
