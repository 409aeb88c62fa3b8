"""Per-GPU peak memory estimate of a training layout (printed by `dry_run=true`).

A count of what bf16 training with fp32 master weights keeps, per GPU (GiB = 2^30 bytes), for the mesh
(dp_shard, cp, tp); n = micro_batch x seq_len / cp tokens per rank, d = model.dim, h = FFN hidden, V = vocab:
- states: fp32 parameters, fp32 gradients and AdamW's two moments, 16 bytes per parameter, sharded over all
  ranks (FSDP over dp_shard x cp, TP over tp); plus FSDP's bf16 all-gathered units in flight (two blocks and
  the kept norm + head) and one unit's unsharded fp32 gradient before its reduce-scatter;
- activations saved for backward, per layer and token (bytes), from what the model code keeps: residual
  RMSNorm inputs upcast to fp32, the all-gathered (sequence-parallel) block input 2d, q/k/v, RoPE's fp32
  upcasts, the attention output; LoGo adds the global k/v, its RoPE, both ContextNorms, the fusion for the
  rho share of tokens (the gate's weight gradient reads the projections' copy of the input); the SwiGLU keeps
  w1/w3 outputs, silu and the product (8h); under cp > 1 each global / full attention layer keeps the
  all-gathered K and V of the whole sequence (4d/tp per token of the sequence). With activation checkpointing
  only each block's input (2d/tp) is kept, plus one block's full activations while it is recomputed;
- logits: the output head's logits are replicated over tp ranks (no loss parallel): bf16 logits, their fp32
  copy for the cross-entropy and its fp32 gradient, 10 V bytes per token.
It is an estimate (no allocator fragmentation, CUDA context or NCCL buffers): a layout "fits" when the
estimate is at most 90% of the GPU's memory. Checked against measured peaks in docs/training.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from logo.model import Transformer
from logo.model.flops import param_counts

GIB = 2 ** 30
GPUS_GB = (40, 80, 141)  # A100-40GB, A100/H100-80GB, H200-141GB (decimal GB as sold)


@dataclass
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    fsdp_buffers: float
    activations: float  # without activation checkpointing
    activations_ac: float  # with
    logits: float

    def total(self, ac: bool) -> float:
        act = self.activations_ac if ac else self.activations
        return self.params + self.grads + self.optimizer + self.fsdp_buffers + act + self.logits

    def fits(self, gb: float, ac: bool) -> bool:
        return self.total(ac) <= 0.9 * gb * 1e9 / GIB

    def table(self) -> str:
        rows = [("params (fp32, sharded)", self.params), ("grads (fp32, sharded)", self.grads),
                ("optimizer (AdamW, sharded)", self.optimizer), ("FSDP gathered units", self.fsdp_buffers),
                ("activations (no AC)", self.activations), ("activations (AC)", self.activations_ac),
                ("logits + CE", self.logits), ("total, no AC", self.total(False)), ("total, AC", self.total(True))]
        lines = [f"  {k:<28} {v:8.2f} GiB" for k, v in rows]
        for ac in (False, True):
            fit = ", ".join(f"{gb} GB: {'yes' if self.fits(gb, ac) else 'no'}" for gb in GPUS_GB)
            lines.append(f"  {'fits, ' + ('AC' if ac else 'no AC'):<28} {fit}")
        return "\n".join(lines)


def _layer_bytes_per_token(kind: str, d: int, h: int, tp: int, cp: int, rho: float) -> float:
    """Activation bytes one block keeps per local token (see the module doc)."""
    full_attn = (6 + 6 + 8 + 4 + 2) * d / tp + 2 * d  # norm, q/k/v, RoPE fp32, roped q/k, output; gathered x
    ffn = 6 * d / tp + 2 * d + 8 * h / tp
    gathered_kv = 4 * d / tp * cp if cp > 1 else 0.0
    if kind == "local":
        return full_attn + ffn
    if kind == "logo":
        extra = (18 + 18 * rho) * d / tp
        return full_attn + extra + ffn + gathered_kv
    return full_attn + ffn + gathered_kv  # full, and intra-layer (global heads gather all of K/V)


def estimate(cfg, seq_len: int, micro_batch: int, dp: int, cp: int, tp: int,
             replicated: bool = False) -> MemoryEstimate:
    """cfg: a ModelConfig (validated). replicated: the data-parallel ranks each hold the whole training state
    (parallel.data_parallel=replicate: nothing sharded over dp x cp, bf16 autocast copies instead of FSDP's units)."""
    import torch
    with torch.device("meta"):
        model = Transformer(cfg)
    total, _ = param_counts(model)
    block = sum(p.numel() for p in model.layers["0"].parameters())
    head = model.output.weight.numel()
    shards = tp if replicated else dp * cp * tp
    d, h, V = cfg.dim, cfg.hidden_dim, cfg.padded_vocab_size
    n = micro_batch * seq_len // cp
    kinds = cfg.attention.layer_kinds(cfg.n_layers)
    rho = cfg.attention.rho
    per_layer = [_layer_bytes_per_token(k, d, h, tp, cp, rho) * n for k in kinds]
    sharded = dp * cp > 1 and not replicated
    fsdp = (2 * 2 * block + 2 * head) / tp + 4 * block / tp if sharded else 2 * total / tp  # bf16 autocast copies
    return MemoryEstimate(
        params=4 * total / shards / GIB, grads=4 * total / shards / GIB, optimizer=8 * total / shards / GIB,
        fsdp_buffers=fsdp / GIB, activations=sum(per_layer) / GIB,
        activations_ac=(cfg.n_layers * 2 * d / tp * n + max(per_layer)) / GIB,
        logits=10 * V * n / GIB)


def data_parallel_mode(cfg, seq_len: int, micro_batch: int, dp: int, cp: int, tp: int, choice: str,
                       gpu_gib: float | None, ac: bool) -> str:
    """How the dp x cp ranks hold the model (parallel.data_parallel resolved): "none" with a single such rank,
    else `choice`, where "auto" is "replicate" when tp == 1 and the replicated state fits a GPU of `gpu_gib`
    (`gpu_gib` None, no GPU to size it: "shard"), else "shard"."""
    if dp * cp == 1:
        return "none"
    if choice != "auto":
        return choice
    if tp > 1 or gpu_gib is None:
        return "shard"
    fits = estimate(cfg, seq_len, micro_batch, dp, cp, tp, replicated=True).total(ac) <= 0.9 * gpu_gib
    return "replicate" if fits else "shard"


def fit_hint(cfg, seq_len: int, micro_batch: int, dp: int, cp: int, tp: int, gb: int = 80) -> str:
    """'' when the layout fits a `gb` GPU with activation checkpointing, else one line naming the smallest layout
    that does: micro_batch 1, then context and tensor parallelism over more GPUs per sequence (cp x tp, tp <= 8 and
    dividing the heads), with AC; or that none up to 64 GPUs per sequence does."""
    if estimate(cfg, seq_len, micro_batch, dp, cp, tp).fits(gb, True):
        return ""
    for g in (cp * tp, 2, 4, 8, 16, 32, 64):
        for tp_ in (1, 2, 4, 8):
            cp_ = g // tp_
            if g % tp_ or cp_ < 1 or cfg.n_heads % tp_ or seq_len % (2 * cp_) or g < cp * tp:
                continue
            est = estimate(cfg, seq_len, 1, dp, cp_, tp_)
            if est.fits(gb, True):
                return (f"hint: nothing fits a {gb} GB GPU as configured; with train.activation_checkpointing=true "
                        f"train.micro_batch=1 parallel.cp={cp_} parallel.tp={tp_} ({g} GPUs per sequence, {g * dp} "
                        f"for dp={dp}) the estimate is {est.total(True):.1f} GiB per GPU")
    return f"hint: no layout of up to 64 GPUs per sequence fits a {gb} GB GPU: shorten stage.seq_len or the model"
