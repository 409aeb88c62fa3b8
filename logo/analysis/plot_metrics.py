"""Turn a run's metrics.jsonl into PNG plots.

    python -m logo.analysis.plot_metrics runs/tiny-logo-smoke            # writes runs/tiny-logo-smoke/plots/*.png
    python -m logo.analysis.plot_metrics RUN_DIR --out DIR

Plots: loss.png (training loss, held-out loss when eval.interval is on, and learning rate), ratio.png (realized global ratio per LoGo layer, with the
target rho when the run's config.yaml is present), threshold.png (per-layer threshold b), gate.png (gate
mean +- std per layer) and ratio_heatmap.png (layers x steps).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional
from logo.train.metrics import ratio_heatmap_figure

LAYER_KEY = re.compile(r"^logo/(ratio|threshold|gate_mean|gate_std)/layer_(\d+)$")


class MetricsFileError(ValueError):
    pass


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl" if Path(run_dir).is_dir() else Path(run_dir)
    if not path.exists():
        raise MetricsFileError(f"{path} does not exist (pass a run directory written by train.py)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise MetricsFileError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if "step" not in rec:
            raise MetricsFileError(f"{path}:{n}: record has no 'step'")
        rows.append(rec)
    if not rows:
        raise MetricsFileError(f"{path} has no records yet")
    return rows


def per_layer(rows: list[dict], what: str) -> dict[int, tuple[list[int], list[float]]]:
    """{layer: (steps, values)} for what in ratio | threshold | gate_mean | gate_std."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for r in rows:
        for k, v in r.items():
            m = LAYER_KEY.match(k)
            if m and m.group(1) == what:
                s, vals = out.setdefault(int(m.group(2)), ([], []))
                s.append(r["step"])
                vals.append(v)
    return dict(sorted(out.items()))


def _target_rho(run_dir: Path) -> Optional[float]:
    cfg = Path(run_dir) / "config.yaml"
    if not cfg.exists():
        return None
    from omegaconf import OmegaConf
    c = OmegaConf.load(cfg)
    return float(c.attention.rho) if "attention" in c and c.attention.get("kind") in ("logo", "inter_layer") \
        else None


def plot_run(run_dir, out_dir=None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else (run_dir if run_dir.is_dir() else run_dir.parent) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        p = out / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    train = [r for r in rows if "loss" in r]  # `python -m logo.eval` appends evaluation-only records
    steps = [r["step"] for r in train]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in train], label="train loss")
    held = [r for r in train if "eval/loss" in r]
    if held:
        ax.plot([r["step"] for r in held], [r["eval/loss"] for r in held], "o-", label="held-out loss")
        ax.legend(loc="upper right")
    ax.set(xlabel="step", ylabel="loss", title="training loss")
    if train and all("lr" in r for r in train):
        ax2 = ax.twinx()
        ax2.plot(steps, [r["lr"] for r in train], color="gray", alpha=0.5, label="lr")
        ax2.set_ylabel("learning rate")
    save(fig, "loss.png")

    ratio = per_layer(rows, "ratio")
    if ratio:
        rho = _target_rho(run_dir) if run_dir.is_dir() else None
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (s, v) in ratio.items():
            ax.plot(s, v, label=f"layer {i}")
        if rho is not None:
            ax.axhline(rho, color="black", ls="--", lw=1, label=f"rho={rho:g}")
        ax.set(xlabel="step", ylabel="realized global ratio F", ylim=(-0.02, 1.02), title="global ratio per layer")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "ratio.png")

        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (s, v) in per_layer(rows, "threshold").items():
            ax.plot(s, v, label=f"layer {i}")
        ax.set(xlabel="step", ylabel="threshold b", title="routing threshold per layer")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "threshold.png")

        std = per_layer(rows, "gate_std")
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (s, v) in per_layer(rows, "gate_mean").items():
            line, = ax.plot(s, v, label=f"layer {i}")
            if i in std:
                import numpy as np
                m, sd = np.array(v), np.array(std[i][1])
                ax.fill_between(s, m - sd, m + sd, color=line.get_color(), alpha=0.15)
        ax.set(xlabel="step", ylabel="gate p (mean +- std)", title="gate per layer")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "gate.png")

        history = [(r["step"], {i: r[f"logo/ratio/layer_{i}"] for i in ratio if f"logo/ratio/layer_{i}" in r})
                   for r in rows]
        save(ratio_heatmap_figure([h for h in history if h[1]]), "ratio_heatmap.png")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run directory (or its metrics.jsonl)")
    ap.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    a = ap.parse_args(argv)
    try:
        for p in plot_run(a.run_dir, a.out):
            print(p)
    except MetricsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
