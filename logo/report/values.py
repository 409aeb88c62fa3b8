"""One number per metric per run (`run_values`), and how each metric is named, ordered and printed (`metric`)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from logo.report.evals import eval_values, length_order
from logo.report.runs import Run

RATIO = re.compile(r"^logo/ratio/layer_(\d+)$")
RATIO_WINDOW = re.compile(r"^logo/ratio_window/layer_(\d+)$")  # the budget reporting's window means
HOURS_KEYS = {"cuda": "gpu_hours", "cpu": "cpu_hours", None: "process_hours"}  # by the device a run trained on


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    better: Optional[str] = None  # "lower" | "higher" | None (no direction: a budget, a size)
    style: str = "3"  # decimals, or "si" (26.8M), "sci" (3.1e+18)
    seeded: bool = True  # False: set by the config and plan (same for every seed): shown without a std


METRICS = {m.key: m for m in (
    Metric("train_loss", "Train loss", "lower", "3"),
    Metric("eval_loss", "Held-out loss", "lower", "3"),
    Metric("eval_ppl", "Held-out ppl", "lower", "2"),
    Metric("wiki_ppl", "Wiki.", "lower", "2"),
    Metric("lmb_ppl", "LMB.", "lower", "2"),
    Metric("lmb_acc", "LMB. acc", "higher", "2"),
    Metric("piqa", "PIQA", "higher", "2"),
    Metric("hella", "Hella.", "higher", "2"),
    Metric("wino", "Wino.", "higher", "2"),
    Metric("arc_e", "ARC-e", "higher", "2"),
    Metric("arc_c", "ARC-c", "higher", "2"),
    Metric("csr_avg", "CSR avg.", "higher", "2"),
    Metric("ruler_avg", "RULER avg.", "higher", "1"),
    Metric("budget", "Attn budget", None, "2", seeded=False),
    Metric("ratio_mean", "Global ratio", None, "3"),
    Metric("global_flops_fraction", "Global FLOPs frac.", None, "3"),
    Metric("params_total", "Params (total)", None, "si", seeded=False),
    Metric("params_non_embedding", "Params (non-emb.)", None, "si", seeded=False),
    Metric("tokens", "Tokens", None, "si", seeded=False),
    Metric("train_flops", "Train FLOPs", None, "sci", seeded=False),
    Metric("attention_flops", "Attn FLOPs", None, "sci", seeded=False),
    Metric("gpu_hours", "GPU-hours", None, "3"),
    Metric("cpu_hours", "CPU process-hours", None, "3"),
    Metric("process_hours", "Process-hours", None, "3"),
    Metric("steps", "Steps", None, "0", seeded=False),
)}


def metric(key: str) -> Metric:
    """The Metric of a report value key, including the per-dataset/-task/-layer ones."""
    if key in METRICS:
        return METRICS[key]
    parts = key.split("/")
    if parts[0] == "ruler":
        return Metric(key, "RULER " + " ".join(parts[1:]), "higher", "1")
    if parts[0] == "ppl":
        return Metric(key, f"{parts[1]} ppl", "lower", "2")
    if parts[0] == "loss":
        return Metric(key, f"{parts[1]} loss", "lower", "3")
    if parts[0] == "ratio":
        return Metric(key, f"ratio L{parts[1]}", None, "3")
    if parts[0] == "synthetic" and len(parts) == 3:
        return Metric(key, f"{parts[1]} {'acc.' if parts[2] == 'accuracy' else 'token acc.'}", "higher", "1")
    if parts[0] == "span" and len(parts) == 4:
        return Metric(key, f"{parts[1]} L{parts[3]} global ratio ({parts[2]})", None, "3")
    if parts[0] == "lm_eval":
        lower = "perplexity" in parts[-1] or parts[-1] in ("bits_per_byte", "byte_perplexity")
        return Metric(key, f"{parts[1]} {parts[2]}", "lower" if lower else "higher", "4")
    return Metric(key, key, None, "4")


def sort_key(key: str) -> tuple:
    """Known metrics in the registry's order, then RULER by task and length, then the rest by name."""
    order = list(METRICS)
    if key in METRICS:
        return (0, order.index(key), "")
    parts = key.split("/")
    if parts[0] == "ruler":
        return (1, 0 if len(parts) == 2 else 1, parts[1] if len(parts) > 2 else "", length_order(parts[-1]))
    if parts[0] == "ratio":
        return (3, int(parts[1]), "")
    return (2, 0, key)


def fmt(key: str, v: Optional[float]) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    style = metric(key).style
    if style == "sci":
        return f"{v:.3g}"
    if style == "si":
        for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
            if abs(v) >= scale:
                return f"{v / scale:.3g}{suffix}"
        return f"{v:.3g}"
    return f"{v:.{int(style)}f}"


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def run_values(run: Run, last_steps: int, ratio_tail: Optional[float] = None) -> dict[str, float]:
    """The run's report values. train_loss: mean logged loss over the last `last_steps` optimizer steps (at least
    the last logged step); ratios: the budget reporting's window means when logged, else the mean over the same
    steps, or with `ratio_tail` the mean of the logged window means (else per-step ratios) over that last fraction
    of the run's steps (`tail_records`); FLOPs: the plan's per-token FLOPs x the tokens trained; compute time: logged wall time x world size,
    as GPU-hours, CPU process-hours or (device not recorded) process-hours; held-out loss: the training loop's."""
    train = run.train_records
    last = train[-1]
    window = [r for r in train if r["step"] > last["step"] - last_steps] or [last]
    plan = run.plan
    v: dict[str, float] = {"train_loss": _mean(r["loss"] for r in window), "steps": float(last["step"])}
    tokens = last.get("tokens", last["step"] * plan.get("global_batch_tokens", 0))
    v["tokens"] = float(tokens)
    for k in ("params_total", "params_non_embedding"):
        if isinstance(plan.get(k), (int, float)):
            v[k] = float(plan[k])
    if isinstance(plan.get("attention_budget"), (int, float)):
        v["budget"] = float(plan["attention_budget"])
    if isinstance(plan.get("train_flops_per_token"), (int, float)):
        v["train_flops"] = plan["train_flops_per_token"] * tokens
    if isinstance(plan.get("attention_flops_per_token"), (int, float)):
        v["attention_flops"] = 3.0 * plan["attention_flops_per_token"] * tokens  # forward + backward
    hours = process_hours(train, plan.get("world_size", 1))
    if hours is not None:
        v[HOURS_KEYS[run.device]] = hours
    v.update(_ratios(window, last) if ratio_tail is None else _ratios(tail_records(train, ratio_tail), last, tail=True))
    # Held-out values logged with a training step; `python -m logo.eval perplexity` appends records without a
    # training loss, whose results are the ppl/<dataset> values of eval/perplexity.json.
    for key, name in (("eval/loss", "eval_loss"), ("eval/ppl", "eval_ppl")):
        logged = [r[key] for r in train if isinstance(r.get(key), (int, float))]
        if logged:
            v[name] = float(logged[-1])
    v.update(eval_values(run.evals))
    return v


def tail_records(train: list[dict], fraction: float) -> list[dict]:
    """The training records of the last `fraction` of the run's steps (step > (1 - fraction) x last step; at
    least the last record)."""
    last = train[-1]["step"]
    return [r for r in train if r["step"] > (1.0 - fraction) * last] or train[-1:]


def _ratios(window: list[dict], last: dict, tail: bool = False) -> dict[str, float]:
    """Per-layer ratios: the last record's window means (or, `tail`, the mean of the window means over the records
    of `window`), else the mean of the per-step ratios over `window`."""
    out = {}
    per_layer = {}
    for pattern in (RATIO_WINDOW, RATIO):
        records = window if tail or pattern is RATIO else [last]
        layers = sorted({int(m.group(1)) for r in records for k in r if (m := pattern.match(k))})
        name = "logo/ratio_window/layer_" if pattern is RATIO_WINDOW else "logo/ratio/layer_"
        per_layer = {i: _mean(r[f"{name}{i}"] for r in records if f"{name}{i}" in r) for i in layers}
        if per_layer:
            break
    for i, x in per_layer.items():
        out[f"ratio/{i}"] = float(x)
    if not tail and isinstance(last.get("logo/ratio_window_mean"), (int, float)):
        out["ratio_mean"] = float(last["logo/ratio_window_mean"])
    elif per_layer:
        out["ratio_mean"] = _mean(per_layer.values())
    if isinstance(last.get("logo/global_flops_fraction"), (int, float)):
        out["global_flops_fraction"] = float(last["logo/global_flops_fraction"])
    return out


def process_hours(train: list[dict], world_size: int) -> Optional[float]:
    """Sum over logged intervals of (tokens in the interval / tokens per second) x world size, in hours. The
    trainer measures tokens_per_s over the wall time since the previous logged step (checkpoint saves included,
    start-up excluded)."""
    seconds, prev = 0.0, 0
    for r in train:
        tps, tok = r.get("tokens_per_s"), r.get("tokens")
        if not isinstance(tps, (int, float)) or not isinstance(tok, (int, float)) or tps <= 0:
            return None
        seconds += (tok - prev) / tps
        prev = tok
    return seconds * world_size / 3600.0
