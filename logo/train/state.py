"""The train state: everything a checkpoint holds besides the model and optimizer, as `train_state.pt`.

`TrainState` is a torch.distributed.checkpoint `Stateful` over the loop's live objects: `state_dict()` takes a
snapshot (every rank: the RNG states are gathered), `load_state_dict()` restores them. The dictionary's keys are
the file's format (step, lr_scheduler, data, rng, controller, wandb_id, plan, config), unchanged since the first
checkpoints, so older `train_state.pt` files resume as they are (a file without `controller` or `wandb_id` keeps
the controller's fresh state and starts a new W&B run).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    """The optimizer-step count and the objects whose state resumes with it. `plan` and `config` are written for
    the record (resume checks and the report read them); loading leaves them to the current launch."""

    lr_scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    data: Any  # data.prefetch.StepLoader (or anything with state_dict / load_state_dict)
    controller: Any  # logo.model.BudgetController
    plan: dict
    config: dict
    step: int = 0
    wandb_id: Optional[str] = None  # rank 0's W&B run, continued on resume

    def state_dict(self) -> dict:
        """A snapshot of every part (collective when distributed: each rank's RNG states are gathered)."""
        return {"step": self.step, "lr_scheduler": self.lr_scheduler.state_dict(), "data": self.data.state_dict(),
                "rng": rng_states_all_ranks(), "controller": self.controller.state_dict(),
                "wandb_id": self.wandb_id, "plan": self.plan, "config": self.config}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.wandb_id = int(sd["step"]), sd.get("wandb_id")
        self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        if "controller" in sd:  # identical on every rank: rank 0's copy serves all
            self.controller.load_state_dict(sd["controller"])
        self.data.load_state_dict(sd["data"])
        set_rng_state(sd["rng"])


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def rng_states_all_ranks() -> list:
    """Every rank's RNG states (index = rank); collective when distributed."""
    st = rng_state()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [st]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, st)
    return out


def set_rng_state(states) -> None:
    """This rank's entry of `rng_states_all_ranks` (a run resumed with more ranks gives the new ones rank 0's),
    or one rank's states."""
    if isinstance(states, list):
        r = dist.get_rank() if dist.is_initialized() else 0
        states = states[r] if r < len(states) else states[0]
    st = states
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
