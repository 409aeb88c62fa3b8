"""Log a written report to Weights & Biases: every CSV as a wandb.Table, every PNG as a wandb.Image, one run."""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from logo.report.report import Report
from logo.run.wandb import wandb_logged_in


def log_report(rep: Report, files: list[Path], project: str) -> str:
    """Online when logged in (or WANDB_MODE says so), else offline files under <out>/wandb; returns one line."""
    import pandas as pd
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if wandb_logged_in() else "offline")
    out = files[0].parent
    run = wandb.init(project=project, name=f"report-{rep.layout.family}", job_type="report", dir=str(out),
                     mode=mode, config=asdict(rep.settings))
    payload = {}
    for f in files:
        if f.suffix == ".csv":
            payload[f"report/{f.stem}"] = wandb.Table(dataframe=pd.read_csv(f))
        elif f.suffix == ".png":
            payload[f"report/{f.stem}"] = wandb.Image(str(f))
    run.log(payload)
    where = run.url if mode == "online" else Path(run.dir).parent
    run.finish()
    return f"logged {len(payload)} tables and plots to W&B ({mode}): {where}"
