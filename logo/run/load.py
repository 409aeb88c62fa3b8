"""Load a trained model: a run directory (its latest checkpoint), one checkpoint folder or an exported
Hugging Face folder. `logo.load_pretrained` is this module's `load_model`; evaluation and export both load
through it.

A run's model is rebuilt from its `config.yaml`, weights and LoGo thresholds come from the checkpoint (DCP,
strict). An exported folder (`python -m logo.export`) or a Llama-architecture folder is rebuilt from its
config.json (`logo.run.hf`), strict as well.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from logo.config import ConfigError
from logo.model import Transformer
from logo.run.checkpoint import CheckpointError, load_model_only, read_train_state, resolve_checkpoint, run_dir_of
from logo.run.config import Config, DataConfig, StageConfig, to_dataclass
from logo.run.hf import is_hf_folder, native_from_folder

DTYPES = ("auto", "fp32", "bf16")


@dataclass
class Loaded:
    model: Transformer  # eval mode, on `device`, fp32 weights (bf16 runs under `autocast()`)
    cfg: Config  # the run's validated config
    run_dir: Path  # the run directory, or the exported folder itself
    checkpoint: Path
    step: int  # optimizer steps the checkpoint was trained for
    device: torch.device
    dtype: str  # fp32 | bf16 (bf16: autocast, as in training)

    @property
    def seq_len(self) -> int:
        """The context length the checkpoint was trained at (stage.seq_len)."""
        return self.cfg.stage.seq_len

    def autocast(self):
        """The compute-precision context of every forward: bf16 autocast like training, or nothing."""
        if self.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()


def run_config(run_dir: Path) -> Config:
    """The validated Config of a run directory from its config.yaml."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise CheckpointError(f"run directory {run_dir} has no config.yaml (was it written by train.py?)")
    schema = OmegaConf.structured(Config)
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.load(path))
    except Exception as e:  # noqa: BLE001 - OmegaConf raises many types; one line naming the file
        raise ConfigError(f"invalid config {path}: {str(e).splitlines()[0]}") from None
    return to_dataclass(cfg)


def pick_device(device: Optional[str]) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"invalid device {device!r}: no CUDA device is visible")
    return torch.device(device)


def load_model(path, device: Optional[str] = None, dtype: str = "auto") -> Loaded:
    """Model (eval mode) + config from a run directory, a checkpoints/step_N folder or a Hugging Face folder."""
    if dtype not in DTYPES:
        raise ConfigError(f"invalid dtype {dtype!r}: choose one of {list(DTYPES)}")
    dev = pick_device(device)
    resolved = ("bf16" if dev.type == "cuda" else "fp32") if dtype == "auto" else dtype
    if is_hf_folder(path):
        model, mcfg, meta = native_from_folder(path, dev)
        seq_len = int(meta.get("seq_len") or 0) or StageConfig().seq_len
        cfg = Config(model=mcfg, attention=mcfg.attention, stage=StageConfig(seq_len=seq_len),
                     data=DataConfig(tokenizer=meta.get("tokenizer", "cl100k_base")))
        return Loaded(model, cfg, Path(path), Path(path), int(meta.get("step", 0)), dev, resolved)
    ckpt = resolve_checkpoint(path)
    run_dir = run_dir_of(ckpt)
    cfg = run_config(run_dir)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=dev)
    load_model_only(ckpt, model)
    model.eval()
    step = int(read_train_state(ckpt, map_location="cpu").get("step", 0))
    return Loaded(model, cfg, run_dir, ckpt, step, dev, resolved)
