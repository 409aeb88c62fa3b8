"""The resolved training plan: everything derived from the token budget and the world size."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from logo.config import ConfigError, ModelConfig
from logo.kernels import dispatch
from logo.model import Transformer
from logo.model.flops import attention_budget, attention_flops_per_token, param_counts, train_flops_per_token
from logo.parallel.memory import data_parallel_mode
from logo.parallel.mesh import ParallelDims
from logo.run.config import Config, synthetic_params
from logo.run.hf import has_thresholds


DATA_PARALLEL = {"none": "none (one rank per data shard and context)", "replicate": "replicate (DDP, whole weights)",
                 "shard": "shard (FSDP2)"}


def gpu_memory_gib(device: torch.device) -> float | None:
    """The GPU's memory in GiB, None off CUDA."""
    return torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None


@dataclass
class Plan:
    run_name: str
    run_dir: str
    world_size: int
    dp: int  # data-parallel shards (ranks reading different sequences) = world_size / (tp x cp)
    tp: int
    cp: int
    data_parallel: str  # none | replicate (DDP) | shard (FSDP2): parallel.data_parallel resolved
    params_total: int
    params_non_embedding: int
    seq_len: int
    tokens_total: int
    global_batch_tokens: int
    global_batch: int  # sequences
    micro_batch: int  # sequences per rank per forward
    grad_accum: int
    steps: int
    warmup_steps: int
    pmask_steps: int
    threshold_init: float
    lr: float
    lr_min: float
    attention_budget: float
    attention_flops_per_token: float
    train_flops_per_token: float
    attention_kernels: str  # the attention implementation on this machine (logo.kernels.dispatch.describe)
    # what the run trains on: [{name, kind, weight, share, path or params, fingerprint once opened}], one per
    # source of a mixture (data=mix), else the one corpus
    data_sources: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        rows = [("run", self.run_name), ("run dir", self.run_dir), ("world size", self.world_size),
                ("mesh (dp_shard, cp, tp)", f"({self.dp}, {self.cp}, {self.tp})"),
                ("data parallel", DATA_PARALLEL[self.data_parallel]),
                ("params (total)", f"{self.params_total:,}"),
                ("params (non-embedding)", f"{self.params_non_embedding:,}"),
                ("sequence length", self.seq_len), ("tokens (total)", f"{self.tokens_total:,}"),
                ("global batch", f"{self.global_batch_tokens:,} tokens = {self.global_batch} sequences"),
                ("micro batch x grad accum x dp", f"{self.micro_batch} x {self.grad_accum} x {self.dp}"),
                ("tokens per rank per forward", f"{self.micro_batch * self.seq_len // self.cp:,}"),
                ("steps", f"{self.steps:,} (warmup {self.warmup_steps:,})"),
                ("P-mask steps", f"{self.pmask_steps:,}"), ("threshold init", f"{self.threshold_init:.4f}"),
                ("learning rate", f"{self.lr:g} -> {self.lr_min:g} (cosine)"),
                ("attention budget", f"{self.attention_budget:.3f}"),
                ("attention FLOPs / token", f"{self.attention_flops_per_token:.4g}"),
                ("train FLOPs / token", f"{self.train_flops_per_token:.4g}"),
                ("attention kernels", self.attention_kernels)]
        if len(self.data_sources) > 1:
            rows.append(("data mixture", ", ".join(f"{s['name']} {100 * s['share']:.0f}%" for s in self.data_sources)))
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        """The model config this plan trains: `model_cfg` with the planned initial LoGo threshold (the P-mask
        ramp's start). The run's config itself is never changed."""
        attn = dataclasses.replace(model_cfg.attention, threshold_init=self.threshold_init)
        return dataclasses.replace(model_cfg, attention=attn)

    def write(self, run_dir: Path) -> None:
        """<run_dir>/plan.json, replaced whole (never half-written)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "plan.json.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, run_dir / "plan.json")


def run_name(cfg: Config, attention_name: str) -> str:
    """Deterministic (never a timestamp): run.name, else <experiment> or <model>-<attention>[-<corpus folder>|-mix]
    (a prepared corpus other than the embedded one, or a mixture), plus the stage."""
    if cfg.run.name:
        return cfg.run.name
    if cfg.experiment:
        base = cfg.experiment.replace("/", "-")
    else:
        corpus = {"shards": f"-{Path(cfg.data.path.rstrip('/')).name or 'shards'}", "mix": "-mix"}.get(cfg.data.kind, "")
        base = f"{cfg.model.name}-{attention_name}{corpus}"
    return f"{base}-{cfg.stage.name}"


def planned_run_dir(cfg: Config, attention_name: str = "") -> str:
    """run.dir, else runs/<run_name>."""
    return cfg.run.dir or str(Path("runs") / run_name(cfg, attention_name or cfg.model.attention.kind))


def attention_kernels(cfg: Config, device: torch.device) -> str:
    """The attention kernels this run uses on `device` (one line; ConfigError where attention.backend cannot run)."""
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda")
    try:
        return dispatch.describe(cfg.model.attention.backend, device, torch.bfloat16 if bf16 else torch.float32,
                                 cfg.model.head_dim)
    except ValueError as e:
        raise ConfigError(f"invalid config attention.backend={cfg.model.attention.backend!r}: {e}") from None


def default_device(cfg: Config) -> torch.device:
    """The device a run of cfg trains on here (as the trainer picks it)."""
    return torch.device("cuda" if torch.cuda.is_available() and cfg.parallel.device != "cpu" else "cpu")


def make_plan(cfg: Config, world_size: int, attention_name: str = "", device: torch.device | None = None) -> Plan:
    """Derive steps, batch split, P-mask and threshold from the config; errors name the offending field. `device`:
    where the run trains (default: `default_device`), for the attention kernels it reports."""
    with torch.device("meta"):
        total, non_emb = param_counts(Transformer(cfg.model))
    s, t = cfg.stage, cfg.train
    tokens = s.tokens if s.tokens > 0 else int(round(s.tokens_per_param * total))
    dims = ParallelDims.sizes(world_size, cfg.parallel.tp, cfg.parallel.cp)
    global_batch = s.global_batch_tokens // s.seq_len
    per_rank, rem = divmod(global_batch, dims.dp)
    if rem or per_rank == 0:
        raise ConfigError(f"invalid config stage.global_batch_tokens={s.global_batch_tokens}: its {global_batch} "
                          f"sequences of {s.seq_len} tokens cannot be split evenly over {dims.dp} data-parallel "
                          f"shards")
    micro = min(t.micro_batch, per_rank)
    if per_rank % micro:
        raise ConfigError(f"invalid config train.micro_batch={t.micro_batch}: each of the {dims.dp} data shards gets "
                          f"{per_rank} sequences per step, which is not a multiple of it")
    steps = t.steps if t.steps > 0 else max(1, math.ceil(tokens / s.global_batch_tokens))
    if t.steps > 0:
        tokens = steps * s.global_batch_tokens
    a = cfg.model.attention
    # A stage that starts from a previous stage's checkpoint keeps its thresholds: no new P-mask ramp. A Hugging
    # Face folder without LoGo thresholds (a plain Transformer converted to LoGo) gets the ramp like a fresh run.
    init = cfg.checkpoint.init_from
    keeps_thresholds = bool(init) and (not init.startswith("hf:") or has_thresholds(init))
    pmask_steps = int(round(a.pmask_fraction * steps)) if a.pmask and not keeps_thresholds else 0
    device = device or default_device(cfg)
    data_parallel = data_parallel_mode(cfg.model, s.seq_len, micro, dims.dp, dims.cp, dims.tp,
                                       cfg.parallel.data_parallel, gpu_memory_gib(device), t.activation_checkpointing)
    if t.cuda_graphs and world_size > 1 and (data_parallel != "replicate" or dims.tp > 1 or dims.cp > 1):
        raise ConfigError(f"invalid config train.compile_mode='reduce-overhead' with {world_size} ranks "
                          f"(tp={dims.tp}, cp={dims.cp}, data parallel: {data_parallel}): CUDA graphs of the blocks "
                          "run on one device or under replicated data parallelism (tp=cp=1, "
                          "parallel.data_parallel=replicate); FSDP, tensor and context parallelism communicate inside "
                          "the blocks. Use train.compile_mode=default")
    if data_parallel == "replicate" and cfg.parallel.reduce_dtype == "bf16" and torch.device(device).type != "cuda":
        raise ConfigError("invalid config parallel.reduce_dtype='bf16': replicated data parallelism reduces in bf16 "
                          "through NCCL only (GPUs); use fp32 on this device, or parallel.data_parallel=shard")
    name = run_name(cfg, attention_name or cfg.model.attention.kind)
    run_dir = planned_run_dir(cfg, attention_name)
    return Plan(run_name=name, run_dir=run_dir, world_size=world_size, dp=dims.dp, tp=dims.tp, cp=dims.cp,
                data_parallel=data_parallel,
                params_total=total, params_non_embedding=non_emb, seq_len=s.seq_len, tokens_total=tokens,
                global_batch_tokens=s.global_batch_tokens, global_batch=global_batch, micro_batch=micro,
                grad_accum=per_rank // micro, steps=steps, warmup_steps=int(round(s.warmup_fraction * steps)),
                pmask_steps=pmask_steps, threshold_init=a.pmask_threshold_init(pmask_steps), lr=s.lr,
                lr_min=s.lr_min, attention_budget=attention_budget(cfg.model),
                attention_flops_per_token=attention_flops_per_token(cfg.model, s.seq_len),
                train_flops_per_token=train_flops_per_token(cfg.model, s.seq_len, non_emb),
                attention_kernels=attention_kernels(cfg, device), data_sources=planned_sources(cfg))


def planned_sources(cfg: Config) -> list[dict]:
    """The configured data sources with their shares and resolved synthetic episode shapes (no fingerprints: the
    trainer replaces these with the opened sources')."""
    d = cfg.data
    if d.kind != "mix":
        return [{"name": d.kind, "kind": d.kind, "weight": 1.0, "share": 1.0,
                 **({"path": d.path} if d.kind == "shards" else {})}]
    total = sum(s.weight for s in d.sources)
    out = []
    for s in d.sources:
        rec = {"name": s.name, "kind": s.kind, "weight": s.weight, "share": s.weight / total}
        if s.kind == "shards":
            rec["path"] = s.path
        if s.kind == "synthetic":
            rec["params"] = synthetic_params(s, cfg.stage.seq_len, cfg.model.attention.window,
                                             cfg.model.n_layers).relevant()
        out.append(rec)
    return out
