"""Typed model and attention configs (plain dataclasses; Hydra registers them in `logo.run.config`).

Every field is validated by `validate()`, which raises `ConfigError` naming the offending field and value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

ATTENTION_KINDS = ("full", "local", "inter_layer", "intra_layer", "logo")
TRANSFORMS = ("lp", "so", "shared", "full")
FUSIONS = ("weighted", "additive")
BUDGET_CONTROLS = ("threshold", "quantile", "aux_loss")
GLOBAL_LAYER_KINDS = ("full", "logo")
BACKENDS = ("auto", "reference", "triton", "flash")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


def _fail(field_name: str, value, why: str):
    raise ConfigError(f"invalid config {field_name}={value!r}: {why}")


@dataclass
class AttentionConfig:
    """Which attention pathway every layer uses, and the LoGo layer's options (paper Sec. 3.2)."""

    kind: str = "logo"  # full | local | inter_layer | intra_layer | logo
    window: int = 128  # local (sliding-window) span w, in tokens
    # Static hybrids: inter_layer -> fraction of layers that are global; intra_layer -> fraction of heads.
    global_fraction: float = 0.5
    # inter_layer only: explicit layout, a string of 'L'/'G' repeated to n_layers (e.g. "LG" = 1:1, "LLLG" = 1:3).
    # Empty -> layer i is global iff floor((i+1)*f) > floor(i*f), i.e. globals spread evenly, last of each group.
    layer_pattern: str = ""
    global_layer: str = "full"  # inter_layer only: what its global layers are: full | logo (paper Table 8)
    # --- LoGo ---
    rho: float = 0.5  # target global ratio per layer
    transform: str = "lp"  # branch transform phi: lp | so | shared | full
    context_norm: bool = True  # head-wise RMSNorm on each branch output before fusion
    fusion: str = "weighted"  # weighted: (1-p)*L + p*G ; additive: L + p*G   (selected tokens only)
    # threshold: the paper's sign controller (default) ; quantile: b at the (1 - rho) quantile of the last
    # steps' gates plus integral feedback (budget-exact, logo/model/controller.py) ; aux_loss: ratio penalty
    budget_control: str = "threshold"
    gamma: float = 0.0005  # threshold update rate (quantile: only the P-mask ramp's rate)
    quantile_gain: float = 0.5  # quantile: integral gain k, quantile level += k * (F - rho) per step
    quantile_bins: int = 1025  # quantile: gate-logit histogram bins (odd: logit 0 is a bin centre)
    quantile_decay: float = 0.0  # quantile: weight of older steps in the histogram (EMA; 0 = last step only)
    pmask: bool = True  # progressive masking: b0 = 0.5 - gamma * S ; off -> b0 = 0.5
    pmask_fraction: float = 0.2  # S as a fraction of the stage's optimizer steps
    threshold_init: Optional[float] = None  # derived by the training plan; None -> 0.5
    aux_loss_coef: float = 0.01  # aux_loss: lambda
    aux_loss_temperature: float = 0.05  # aux_loss: tau of the soft routing surrogate
    gate_init_std: float = 1e-3  # near-zero gate init: p starts ~0.5
    document_mask: bool = True  # keep attention inside documents when the batch carries boundaries
    # attention ops: auto (FlashAttention-4 on Hopper when installed, else Triton on CUDA; reference on CPU) |
    # reference | triton | flash (logo/kernels/dispatch.py)
    backend: str = "auto"

    def validate(self, n_layers: Optional[int] = None, n_heads: Optional[int] = None) -> AttentionConfig:
        if self.kind not in ATTENTION_KINDS:
            _fail("attention.kind", self.kind, f"unknown attention kind; choose one of {list(ATTENTION_KINDS)}")
        if not isinstance(self.window, int) or self.window < 1:
            _fail("attention.window", self.window, "the local window must be an integer >= 1")
        if not (0.0 < self.rho <= 1.0):
            _fail("attention.rho", self.rho, "the target global ratio must be in (0, 1]")
        if self.transform not in TRANSFORMS:
            _fail("attention.transform", self.transform, f"choose one of {list(TRANSFORMS)}")
        if self.fusion not in FUSIONS:
            _fail("attention.fusion", self.fusion, f"choose one of {list(FUSIONS)}")
        if self.budget_control not in BUDGET_CONTROLS:
            _fail("attention.budget_control", self.budget_control, f"choose one of {list(BUDGET_CONTROLS)}")
        if self.global_layer not in GLOBAL_LAYER_KINDS:
            _fail("attention.global_layer", self.global_layer, f"choose one of {list(GLOBAL_LAYER_KINDS)}")
        if self.backend not in BACKENDS:
            _fail("attention.backend", self.backend, f"choose one of {list(BACKENDS)}")
        if not (self.gamma > 0):
            _fail("attention.gamma", self.gamma, "the threshold update rate must be > 0")
        if not (0.0 < self.quantile_gain < 2.0):
            _fail("attention.quantile_gain", self.quantile_gain, "the integral gain must be in (0, 2) to be stable")
        if not isinstance(self.quantile_bins, int) or self.quantile_bins < 3 or self.quantile_bins % 2 == 0:
            _fail("attention.quantile_bins", self.quantile_bins, "must be an odd integer >= 3")
        if not (0.0 <= self.quantile_decay < 1.0):
            _fail("attention.quantile_decay", self.quantile_decay, "must be in [0, 1)")
        if not (0.0 <= self.pmask_fraction < 1.0):
            _fail("attention.pmask_fraction", self.pmask_fraction, "must be in [0, 1)")
        if self.aux_loss_coef < 0:
            _fail("attention.aux_loss_coef", self.aux_loss_coef, "must be >= 0")
        if self.aux_loss_temperature <= 0:
            _fail("attention.aux_loss_temperature", self.aux_loss_temperature, "must be > 0")
        if self.kind in ("inter_layer", "intra_layer") and not (0.0 <= self.global_fraction <= 1.0):
            _fail("attention.global_fraction", self.global_fraction, "must be in [0, 1]")
        if self.layer_pattern and (self.kind != "inter_layer" or set(self.layer_pattern) - {"L", "G"}):
            _fail("attention.layer_pattern", self.layer_pattern,
                  "only for kind=inter_layer, and only the letters 'L' (local) and 'G' (global)")
        if self.kind == "inter_layer" and n_layers is not None:
            self.global_layers(n_layers)  # raises if the budget is not realizable exactly
        if self.kind == "intra_layer" and n_heads is not None:
            self.num_global_heads(n_heads)
        return self

    # --- static hybrid layouts -------------------------------------------------------------------
    def global_layers(self, n_layers: int) -> list[bool]:
        """inter_layer: which layers are global. Raises unless the layout realizes the budget exactly."""
        if self.layer_pattern:
            pat = (self.layer_pattern * n_layers)[:n_layers]
            return [c == "G" for c in pat]
        f = self.global_fraction
        if abs(n_layers * f - round(n_layers * f)) > 1e-9:
            _fail("attention.global_fraction", f,
                  f"{n_layers} layers x {f} is not a whole number of global layers; pick a fraction that is")
        return [math.floor((i + 1) * f + 1e-9) > math.floor(i * f + 1e-9) for i in range(n_layers)]

    def num_global_heads(self, n_heads: int) -> int:
        """intra_layer: how many heads of every layer are global (the first ones)."""
        f = self.global_fraction
        if abs(n_heads * f - round(n_heads * f)) > 1e-9:
            _fail("attention.global_fraction", f,
                  f"{n_heads} heads x {f} is not a whole number of global heads; pick a fraction that is")
        return int(round(n_heads * f))

    def layer_kinds(self, n_layers: int) -> list[str]:
        """Per layer, the attention module kind: 'full' | 'local' | 'intra_layer' | 'logo'."""
        if self.kind in ("full", "local", "logo", "intra_layer"):
            return [self.kind] * n_layers
        glob = "logo" if self.global_layer == "logo" else "full"
        return [glob if g else "local" for g in self.global_layers(n_layers)]

    def pmask_threshold_init(self, pmask_steps: int) -> float:
        """b0 = 0.5 - gamma * S with P-mask (so b reaches 0.5 after S steps), else 0.5."""
        return 0.5 - self.gamma * pmask_steps if self.pmask else 0.5


def _round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


@dataclass
class ModelConfig:
    """Llama-style MHA + SwiGLU decoder (pre-RMSNorm, RoPE, untied embeddings)."""

    name: str = "tiny"
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 100277  # tokenizer vocabulary (cl100k_base); padded to vocab_multiple
    vocab_multiple: int = 128
    ffn_multiple: int = 256  # SwiGLU hidden = ceil(8d/3 / ffn_multiple) * ffn_multiple
    ffn_hidden: Optional[int] = None  # explicit override of the SwiGLU hidden size
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        return _round_up(self.vocab_size, self.vocab_multiple)

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return _round_up(math.ceil(8 * self.dim / 3), self.ffn_multiple)

    def validate(self) -> ModelConfig:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "vocab_multiple", "ffn_multiple"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                _fail(f"model.{name}", v, "must be a positive integer")
        if self.dim % self.n_heads != 0:
            _fail("model.dim", self.dim, f"not divisible by model.n_heads={self.n_heads}: every head takes dim / n_heads "
                                         f"channels")
        if self.head_dim % 2 != 0:
            _fail("model.dim", self.dim, f"with model.n_heads={self.n_heads} each head has {self.head_dim} channels, "
                                         f"which must be even for RoPE: choose a multiple of {2 * self.n_heads}")
        if self.rope_theta <= 0:
            _fail("model.rope_theta", self.rope_theta, "must be > 0")
        self.attention.validate(n_layers=self.n_layers, n_heads=self.n_heads)
        return self


# The paper's scaling grid (Table 5) plus tiny CPU sizes. LR is the paper's peak learning rate.
MODEL_SIZES: dict[str, dict] = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4),
    "small": dict(dim=256, n_layers=6, n_heads=4),
    "200m": dict(dim=768, n_layers=12, n_heads=12),
    "470m": dict(dim=1024, n_layers=24, n_heads=16),
    "900m": dict(dim=1536, n_layers=24, n_heads=12),
    "1.5b": dict(dim=2048, n_layers=24, n_heads=16),
    "3.3b": dict(dim=2560, n_layers=32, n_heads=20),
}
PEAK_LR = {"200m": 6e-4, "470m": 6e-4, "900m": 6e-4, "1.5b": 3e-4, "3.3b": 3e-4}


def model_config(size: str, **overrides) -> ModelConfig:
    """A named size of the grid, e.g. model_config('1.5b', attention=AttentionConfig(kind='full'))."""
    if size not in MODEL_SIZES:
        _fail("model.name", size, f"unknown size; choose one of {list(MODEL_SIZES)}")
    return ModelConfig(name=size, **{**MODEL_SIZES[size], **overrides})
