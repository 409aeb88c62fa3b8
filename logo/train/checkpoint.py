"""Distributed checkpoints (torch.distributed.checkpoint) that become visible only once complete.

<run_dir>/checkpoints/step_00000100/      model + optimizer shards (DCP), train_state.pt (rank 0: step,
                                          LR scheduler, data-loader state, RNG states, W&B run id)
A checkpoint is written to `step_N.tmp/` and renamed to `step_N/` by rank 0 after every rank finished and
train_state.pt is on disk; `latest()` only ever returns renamed directories. The last `keep` are kept.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

STEP_DIR = re.compile(r"^step_(\d{8})$")
TRAIN_STATE = "train_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint path is missing, incomplete or unreadable; the message names it."""


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier():
    if _is_dist():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / TRAIN_STATE).exists() and (path / ".metadata").exists()


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def latest(self) -> Optional[Path]:
        if not self.dir.is_dir():
            return None
        steps = sorted(p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and is_complete(p))
        return steps[-1] if steps else None

    def save(self, step: int, model, optimizer, train_state: dict) -> Path:
        final = self.dir / f"step_{step:08d}"
        tmp = self.dir / f"step_{step:08d}.tmp"
        if _rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        if _rank() == 0:
            torch.save(train_state, tmp / TRAIN_STATE)
            with open(tmp / TRAIN_STATE, "rb") as f:
                os.fsync(f.fileno())
        _barrier()
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self):
        done = sorted(p for p in self.dir.iterdir() if STEP_DIR.match(p.name))
        for old in done[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model, optimizer) -> dict:
        """Restore model, optimizer and return the train state of a complete checkpoint."""
        path = resolve_checkpoint(path)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return torch.load(path / TRAIN_STATE, weights_only=False)


def load_model_only(path: Path, model) -> None:
    """Model weights and buffers (LoGo thresholds included) of a checkpoint; for context-extension stages."""
    path = resolve_checkpoint(path)
    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


def resolve_checkpoint(path) -> Path:
    """A complete checkpoint folder from a checkpoint path or a run directory (its latest); CheckpointError else."""
    path = Path(path)
    if path.is_dir() and (path / "checkpoints").is_dir():  # a run directory: take its latest checkpoint
        latest = Checkpointer(path, 1).latest()
        if latest is None:
            raise CheckpointError(f"run directory {path} has no complete checkpoint")
        path = latest
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is not a complete checkpoint (it lacks {TRAIN_STATE} or "
                              f".metadata); pass a run directory or one of its checkpoints/step_* folders")
    return path


@contextmanager
def _quiet_dcp():
    """DCP logs full tracebacks (as warnings) before it raises; the CheckpointError we raise says it in one line."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.CRITICAL + 1)  # DCP's loaders log through the root logger
    try:
        yield
    finally:
        root.setLevel(level)


def _dcp_load(state: dict, path: Path) -> None:
    try:
        FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything
        raise CheckpointError(f"checkpoint {path} is corrupted: its .metadata cannot be read "
                              f"({type(e).__name__}: {_first_line(e)})") from None
    try:
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # noqa: BLE001 - DCP raises many types; name the checkpoint and the cause
        raise CheckpointError(f"could not load checkpoint {path}: {type(e).__name__}: {_first_line(e)} "
                              f"(was it written by a different model config?)") from None


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""
