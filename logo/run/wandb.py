"""Whether this machine can log to W&B online (the run's wandb_mode=auto): training and evaluation ask alike."""
from __future__ import annotations

import os
from pathlib import Path


def wandb_logged_in() -> bool:
    """An API key in the environment, or a W&B entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")
