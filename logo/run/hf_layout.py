"""Exact weight mapping between the native model and the Hugging Face layout (Llama names, rotate-half RoPE).

Native RoPE rotates the pairs (2i, 2i+1) of a head; Llama's rotates (i, i + D/2). Every tensor whose output
channels are RoPE-rotated q/k channels (W_q, W_k, LoGo's global W_q/W_k, and the q/k slices of the branch
transforms) has those channels permuted by `perm` = (0, 2, ..., D-2, 1, 3, ..., D-1); v-space tensors
(W_v, W_o, ContextNorm) are unchanged. The mapping is a pure re-indexing, so logits are equal.
"""
from __future__ import annotations

import re

import torch

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
# native suffix under layers.{i}. -> (HF suffix under model.layers.{i}., how its channels move)
_LAYER = {
    "attention_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", None),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", None),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", None),
    "attention.wq.weight": ("self_attn.q_proj.weight", "rows"),
    "attention.wk.weight": ("self_attn.k_proj.weight", "rows"),
    "attention.wv.weight": ("self_attn.v_proj.weight", None),
    "attention.wo.weight": ("self_attn.o_proj.weight", None),
    # LoGo-only parameters (remote code)
    "attention.wq_g.weight": ("self_attn.q_proj_global.weight", "rows"),
    "attention.wk_g.weight": ("self_attn.k_proj_global.weight", "rows"),
    "attention.wv_g.weight": ("self_attn.v_proj_global.weight", None),
    "attention.transform.A": ("self_attn.transform_A", "lp"),
    "attention.transform.scale": ("self_attn.transform_scale", "so"),
    "attention.transform.offset": ("self_attn.transform_offset", "so"),
    "attention.gate.weight": ("self_attn.gate", None),
    "attention.norm_local.weight": ("self_attn.norm_local.weight", None),
    "attention.norm_global.weight": ("self_attn.norm_global.weight", None),
}
LOGO_ONLY = tuple(k for k in _LAYER if k.split(".")[1] in ("wq_g", "wk_g", "wv_g", "transform", "gate",
                                                           "norm_local", "norm_global"))
BUFFERS = ("attention.threshold",)  # carried in config.json (`thresholds`), not as weights
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_TO_NATIVE = {hf: (native, how) for native, (hf, how) in _LAYER.items()}


def rope_perm(head_dim: int, inverse: bool = False) -> torch.Tensor:
    """Channel order taking interleaved RoPE pairs to rotate-half (or back with inverse=True)."""
    perm = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    return torch.argsort(perm) if inverse else perm


def _move(t: torch.Tensor, how, head_dim: int, inverse: bool) -> torch.Tensor:
    if how is None:
        return t
    p = rope_perm(head_dim, inverse).to(t.device)
    if how == "rows":  # (H*D, d): rows of each head
        return t.unflatten(0, (-1, head_dim))[:, p].flatten(0, 1)
    out = t.clone()
    if how == "lp":  # (3, H, D, D): q and k slices move on both axes (u A -> (u A)[p]), v stays
        out[:2] = t[:2][:, :, p][:, :, :, p]
    else:  # so: (3, H, D)
        out[:2] = t[:2][:, :, p]
    return out


def native_name_to_hf(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_KEY.match(name)
    if not m or m.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for native tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)][0]}"


def to_hf(state: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
    """Native state dict (buffers dropped) -> HF names and channel order."""
    out = {}
    for name, t in state.items():
        m = _LAYER_KEY.match(name)
        if m and m.group(2) in BUFFERS:
            continue
        how = _LAYER[m.group(2)][1] if m and m.group(2) in _LAYER else None
        out[native_name_to_hf(name)] = _move(t, how, head_dim, inverse=False).contiguous()
    return out


def from_hf(state: dict[str, torch.Tensor], head_dim: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """HF state dict -> (native names and channel order, HF names with no native counterpart)."""
    top = {hf: native for native, hf in _TOP.items()}
    out, unknown = {}, []
    for name, t in state.items():
        if name in top:
            out[top[name]] = t
            continue
        m = _HF_LAYER_KEY.match(name)
        if not m or m.group(2) not in _HF_TO_NATIVE:
            unknown.append(name)
            continue
        native, how = _HF_TO_NATIVE[m.group(2)]
        out[f"layers.{m.group(1)}.{native}"] = _move(t, how, head_dim, inverse=True).contiguous()
    return out, unknown


def is_logo_only(native_name: str) -> bool:
    """A LoGo-layer parameter that a plain Llama folder does not have (it keeps its identity init)."""
    m = _LAYER_KEY.match(native_name)
    return bool(m) and m.group(2) in LOGO_ONLY
