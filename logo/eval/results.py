"""Where evaluation results go: `<run_dir>/eval/<kind>.json` and the run's metrics sinks.

JSON (`synthetic`: one file per task, `synthetic_<label>.json`): {"kind", "checkpoint", "step", "created",
"results"}, written atomically (a reader never sees half a
file). Metrics: one record {"step": <checkpoint step>, ...} appended to `<run_dir>/metrics.jsonl`, and, as
the run's config.yaml asks, TensorBoard (at the checkpoint step) and W&B (the run's own id from the
checkpoint; W&B cannot log before its current step, so a past checkpoint lands at the run's latest step,
with `eval/checkpoint_step` naming the real one).
"""
from __future__ import annotations

import json
import logging
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from logo.run.load import Loaded
from logo.run.checkpoint import read_train_state
from logo.run.wandb import wandb_logged_in

log = logging.getLogger("logo")
KINDS = ("perplexity", "ruler", "lm_eval", "synthetic")


def save_results(loaded: Loaded, kind: str, results: dict, name: Optional[str] = None) -> Path:
    """Write <run_dir>/eval/<name>.json (default name: the kind); returns its path."""
    if kind not in KINDS:
        raise ValueError(f"unknown results kind {kind!r}; choose one of {list(KINDS)}")
    out = loaded.run_dir / "eval" / f"{name or kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rec = {"kind": kind, "checkpoint": str(loaded.checkpoint), "step": loaded.step,
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "results": results}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rec, indent=1, allow_nan=False))
    os.replace(tmp, out)
    return out


def log_metrics(loaded: Loaded, metrics: dict) -> None:
    """Append the scalars to the run's metrics.jsonl and to its TensorBoard / W&B when configured."""
    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    if not metrics:
        return
    step = loaded.step
    with open(loaded.run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    lc = loaded.cfg.logging
    if lc.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        with SummaryWriter(log_dir=str(loaded.run_dir / "tensorboard")) as tb:
            for k, v in metrics.items():
                tb.add_scalar(k, v, step)
    if lc.wandb:
        _log_wandb(loaded, metrics)


def _log_wandb(loaded: Loaded, metrics: dict) -> None:
    try:
        import wandb

        lc = loaded.cfg.logging
        run_id = read_train_state(loaded.checkpoint, map_location="cpu").get("wandb_id")
        mode = lc.wandb_mode if lc.wandb_mode != "auto" else ("online" if wandb_logged_in() else "offline")
        run = wandb.init(project=lc.wandb_project, id=run_id, resume="allow", dir=str(loaded.run_dir), mode=mode)
        run.log({**metrics, "eval/checkpoint_step": loaded.step}, step=max(loaded.step, run.step))
        run.finish()
    except Exception as e:  # noqa: BLE001 - the JSON and metrics.jsonl are written; W&B is best effort
        log.warning("could not log the evaluation to W&B: %s: %s", type(e).__name__, str(e).splitlines()[0])
