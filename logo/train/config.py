"""Typed training configs, registered with Hydra's ConfigStore as the schema of `conf/config.yaml`.

Groups (conf/<group>/<option>.yaml): model, attention, stage, data, logging, parallel, and `experiment`
presets (`# @package _global_`) that set several groups at once. `validate()` checks everything at start-up
and raises ConfigError naming the field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from logo.config import AttentionConfig, ConfigError, ModelConfig


def _fail(name, value, why):
    raise ConfigError(f"invalid config {name}={value!r}: {why}")


@dataclass
class StageConfig:
    """One training stage: pretraining or a context-extension stage."""

    name: str = "smoke"
    seq_len: int = 512
    # Token budget: `tokens` if > 0, else tokens_per_param x total parameters (the scaling grid's 20 TPP).
    tokens: int = 0
    tokens_per_param: float = 0.0
    global_batch_tokens: int = 8192
    lr: float = 3e-3  # peak learning rate
    lr_min: float = 3e-4  # cosine floor
    warmup_fraction: float = 0.01
    rope_theta: Optional[float] = None  # None: keep model.rope_theta; context extension raises it


@dataclass
class TrainConfig:
    steps: int = 0  # > 0 overrides the steps derived from the token budget (smoke runs)
    micro_batch: int = 8  # sequences per rank per forward
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU | fp32 | bf16
    compile: bool = False
    activation_checkpointing: bool = False
    seed: int = 0


@dataclass
class DataConfig:
    kind: str = "default"  # default: the embedded corpus | shards: a prepared corpus at `path`
    path: str = ""
    tokenizer: str = "cl100k_base"
    seed: int = 1234
    document_mask: bool = True


@dataclass
class CheckpointConfig:
    interval: int = 100  # steps between checkpoints (and one at the end)
    keep: int = 3  # keep the last k
    init_from: str = ""  # a previous stage's checkpoint: model + thresholds only (context extension)
    resume: bool = True  # resume automatically from the run's latest complete checkpoint


@dataclass
class LoggingConfig:
    interval: int = 10
    progress_bar: bool = True
    wandb: bool = False
    wandb_project: str = "logo"
    wandb_mode: str = "auto"  # auto: online when logged in, else offline | online | offline
    tensorboard: bool = False
    heatmap_interval: int = 100  # steps between layers x steps ratio heatmap images


@dataclass
class ParallelConfig:
    backend: str = "auto"  # auto: nccl on GPU, gloo on CPU
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class RunConfig:
    name: str = ""  # default: <model>-<attention>-<stage>
    dir: str = ""  # default: runs/<name>


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    stage: StageConfig = field(default_factory=StageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    experiment: str = ""  # set by experiment presets
    dry_run: bool = False


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="logo_schema", node=Config)


def to_dataclass(cfg: DictConfig) -> Config:
    """The resolved Hydra config as plain, validated dataclasses."""
    try:
        obj: Config = OmegaConf.to_object(cfg)
    except Exception as e:  # noqa: BLE001 - OmegaConf type/validation errors: one line naming the key
        raise ConfigError(f"invalid config: {e}".splitlines()[0] + _first_key_hint(e)) from None
    if obj.model.attention != AttentionConfig():
        raise ConfigError("invalid config model.attention: set attention fields at the top level "
                          "(attention=<preset> attention.rho=0.25 ...), not under model.attention")
    model = dataclasses.replace(obj.model, attention=obj.attention)
    if obj.stage.rope_theta is not None:
        model = dataclasses.replace(model, rope_theta=obj.stage.rope_theta)
    obj.model = model
    validate(obj)
    return obj


def _first_key_hint(e: Exception) -> str:
    key = getattr(e, "full_key", None)
    return f" (key {key})" if key else ""


def validate(c: Config) -> None:
    c.model.validate()
    s, t = c.stage, c.train
    for name, v in (("stage.seq_len", s.seq_len), ("stage.global_batch_tokens", s.global_batch_tokens),
                    ("train.micro_batch", t.micro_batch), ("checkpoint.interval", c.checkpoint.interval),
                    ("checkpoint.keep", c.checkpoint.keep), ("logging.interval", c.logging.interval)):
        if not isinstance(v, int) or v < 1:
            _fail(name, v, "must be a positive integer")
    if s.global_batch_tokens % s.seq_len:
        _fail("stage.global_batch_tokens", s.global_batch_tokens, f"not a multiple of stage.seq_len={s.seq_len}")
    if s.tokens < 0 or s.tokens_per_param < 0 or (s.tokens == 0 and s.tokens_per_param == 0 and t.steps <= 0):
        _fail("stage.tokens", s.tokens, "set stage.tokens, stage.tokens_per_param or train.steps")
    if t.steps < 0:
        _fail("train.steps", t.steps, "must be >= 0 (0 = derive from the token budget)")
    if not (0 < s.lr_min <= s.lr):
        _fail("stage.lr_min", s.lr_min, f"must be in (0, stage.lr={s.lr}]")
    if not (0 <= s.warmup_fraction < 1):
        _fail("stage.warmup_fraction", s.warmup_fraction, "must be in [0, 1)")
    if t.dtype not in ("auto", "fp32", "bf16"):
        _fail("train.dtype", t.dtype, "choose auto, fp32 or bf16")
    if t.grad_clip <= 0:
        _fail("train.grad_clip", t.grad_clip, "must be > 0")
    if c.data.kind not in ("default", "shards"):
        _fail("data.kind", c.data.kind, "choose default or shards")
    if c.data.kind == "shards" and not c.data.path:
        _fail("data.path", c.data.path, "data=shards needs data.path=DIR (a corpus made by python -m data.prepare)")
    if c.parallel.backend not in ("auto", "nccl", "gloo"):
        _fail("parallel.backend", c.parallel.backend, "choose auto, nccl or gloo")
    if c.parallel.device not in ("auto", "cpu", "cuda"):
        _fail("parallel.device", c.parallel.device, "choose auto, cpu or cuda")
    if c.logging.wandb_mode not in ("auto", "online", "offline"):
        _fail("logging.wandb_mode", c.logging.wandb_mode, "choose auto, online or offline")
