"""How closely each budget controller holds rho per layer: short CPU training runs, and plots comparing runs.

    # train (CPU, minutes): tiny LoGo on the embedded corpus with token ids folded into a small vocabulary (the
    # 100k-entry LM head dominates a CPU step otherwise); one run per controller, metrics.jsonl every step
    python -m logo.analysis.budget_fidelity train OUT --controllers threshold quantile --rho 0.25 --steps 300
    # compare any runs (train.py run directories too): loss, per-layer windowed ratios, summary table
    python -m logo.analysis.budget_fidelity compare OUT/threshold OUT/quantile --out docs/figures/budget

The summary gives, per run and layer, the mean realized ratio over the last `--tail` fraction of the logged
steps, its error against rho, and the gate spread (std of p, fraction of gates within gamma of b) there.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from logo.analysis.plot_metrics import per_layer, read_metrics
from data.default_corpus import ensure_default_corpus
from data.loader import ShardDataset, TokenLoader
from logo.config import AttentionConfig, model_config
from logo.model import BudgetController, Transformer
from logo.train.step import lm_loss_sum

TAIL = 0.2


def train_run(out: Path, controller: str, rho: float, steps: int, vocab: int, seq_len: int, batch: int,
              gamma: float, pmask_fraction: float, lr: float, window: int, seed: int = 0) -> Path:
    """One short run; writes <out>/metrics.jsonl (one record per step) and config.yaml (for rho)."""
    import math

    import torch


    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    S = int(round(pmask_fraction * steps))
    attn = AttentionConfig(kind="logo", rho=rho, window=32, gamma=gamma, budget_control=controller)
    attn.threshold_init = attn.pmask_threshold_init(S)
    model = Transformer(model_config("tiny", vocab_size=vocab, attention=attn))
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    ctrl = BudgetController(model, window=window)
    loader = TokenLoader(ShardDataset(ensure_default_corpus(), "train"), seq_len, batch, batch, 0, 1, seed, True)
    (out / "config.yaml").write_text(f"attention:\n  kind: logo\n  rho: {rho}\n  budget_control: {controller}\n"
                                     f"  gamma: {gamma}\npmask_steps: {S}\n")
    with open(out / "metrics.jsonl", "w") as f:
        for step in range(steps):
            for g in opt.param_groups:  # linear warmup (5%), cosine to 10%
                w = max(1, steps // 20)
                g["lr"] = lr * ((step + 1) / w if step < w else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - w) / (steps - w))))
            mb = loader.step_data(step).micro_batches[0]
            labels = torch.where(mb.labels >= 0, mb.labels % vocab, mb.labels)
            o = model(mb.inputs % vocab, cu_seqlens=mb.cu_seqlens, valid=mb.valid)
            loss = lm_loss_sum(o.logits, labels) / (labels >= 0).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ctrl.accumulate(o.routing)
            ctrl.step()
            f.write(json.dumps({"step": step + 1, "loss": loss.item(), **ctrl.metrics()}) + "\n")
    return out


def summary(run_dir: Path, tail: float = TAIL) -> dict:
    """Per layer over the last `tail` of the logged steps: mean ratio, error vs rho, gate std, near-threshold."""
    rows = read_metrics(run_dir)
    rho = _rho(run_dir)
    out = {"run": str(run_dir), "rho": rho, "layers": {}}
    for i, (_steps, vals) in per_layer(rows, "ratio").items():
        n = max(1, int(round(len(vals) * tail)))
        last = rows[-n:]
        mean = sum(vals[-n:]) / n
        std = sum(r.get(f"logo/gate_std/layer_{i}", float("nan")) for r in last) / n
        near = sum(r.get(f"logo/gate_near_threshold/layer_{i}", float("nan")) for r in last) / n
        out["layers"][i] = {"ratio": mean, "error": None if rho is None else mean - rho, "gate_std": std,
                            "near_threshold": near}
    losses = [r["loss"] for r in rows if "loss" in r]
    n = max(1, int(round(len(losses) * tail)))
    out["loss_tail"] = sum(losses[-n:]) / n
    return out


def _rho(run_dir: Path):
    cfg = Path(run_dir) / "config.yaml"
    if not cfg.exists():
        return None
    from omegaconf import OmegaConf
    c = OmegaConf.load(cfg)
    return float(c.attention.rho) if "attention" in c else None


def compare(run_dirs: list[Path], out: Path, tail: float = TAIL) -> list[Path]:
    """loss.png and ratio_window.png (one panel per run, every layer, rho dashed); summary.json."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for d in run_dirs:
        rows = [r for r in read_metrics(d) if "loss" in r]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=Path(d).name, lw=1)
    ax.set(xlabel="step", ylabel="training loss", title="loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    written.append(out / "loss.png")
    plt.close(fig)

    fig, axes = plt.subplots(1, len(run_dirs), figsize=(5 * len(run_dirs), 3.8), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], run_dirs):
        rows = read_metrics(d)
        key = "ratio_window" if any(k.startswith("logo/ratio_window/") for k in rows[-1]) else "ratio"
        for i, (s, v) in _per_layer_any(rows, key).items():
            ax.plot(s, v, lw=1, label=f"layer {i}")
        rho = _rho(d)
        if rho is not None:
            ax.axhline(rho, color="black", ls="--", lw=1, label=f"rho={rho:g}")
        ax.set(xlabel="step", title=f"{Path(d).name}: windowed realized ratio", ylim=(-0.02, 1.02))
        ax.legend(fontsize=7, ncol=2)
    axes[0][0].set_ylabel("realized global ratio")
    fig.tight_layout()
    fig.savefig(out / "ratio_window.png", dpi=110)
    written.append(out / "ratio_window.png")
    plt.close(fig)
    (out / "summary.json").write_text(json.dumps([summary(Path(d), tail) for d in run_dirs], indent=1))
    written.append(out / "summary.json")
    return written


def _per_layer_any(rows, key):
    import re
    pat = re.compile(rf"^logo/{key}/layer_(\d+)$")
    res: dict = {}
    for r in rows:
        for k, v in r.items():
            m = pat.match(k)
            if m:
                s, vals = res.setdefault(int(m.group(1)), ([], []))
                s.append(r["step"])
                vals.append(v)
    return dict(sorted(res.items()))


def table(summaries: list[dict]) -> str:
    lines = ["| run | layer | ratio (last 20%) | error | gate std | near b |", "|---|---|---|---|---|---|"]
    for s in summaries:
        for i, v in s["layers"].items():
            err = "" if v["error"] is None else f"{v['error']:+.3f}"
            lines.append(f"| {Path(s['run']).name} | {i} | {v['ratio']:.3f} | {err} | {v['gate_std']:.4f} | "
                         f"{v['near_threshold']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="short CPU runs, one per controller")
    t.add_argument("out")
    t.add_argument("--controllers", nargs="+", default=["threshold", "quantile"])
    t.add_argument("--rho", type=float, default=0.25)
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--vocab", type=int, default=2048)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--gamma", type=float, default=0.005)
    t.add_argument("--pmask-fraction", type=float, default=0.2)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--window", type=int, default=20)
    c = sub.add_parser("compare", help="plots and a per-layer table of runs")
    c.add_argument("runs", nargs="+")
    c.add_argument("--out", required=True)
    c.add_argument("--tail", type=float, default=TAIL)
    a = ap.parse_args(argv)
    if a.cmd == "train":
        for ctl in a.controllers:
            d = train_run(Path(a.out) / ctl, ctl, a.rho, a.steps, a.vocab, a.seq_len, a.batch, a.gamma,
                          a.pmask_fraction, a.lr, a.window)
            print(table([summary(d)]))
        return 0
    for p in compare([Path(r) for r in a.runs], Path(a.out), a.tail):
        print(p)
    print(table(json.loads((Path(a.out) / "summary.json").read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
