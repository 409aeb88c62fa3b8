"""Inference model of an exported logo checkpoint, in plain PyTorch (loads with trust_remote_code=True).

Written by `python -m logo.export`; self-contained (no `logo` import, no Triton). A Llama-style decoder
(pre-RMSNorm, rotate-half RoPE, SwiGLU, untied embeddings) whose layers are, per `config.layer_kinds`:

    full         causal attention
    local        sliding-window attention (token t sees t-window+1 .. t)
    intra_layer  the first `num_global_heads` heads full, the others sliding-window
    logo         LoGo: every token local; tokens with p_t = sigmoid(x_t . w_g) > b (b frozen from training)
                 also attend the whole causal context through the transformed global branch, fused as
                 (1 - p) Norm^L(O^L) + p Norm^G(O^G) (weighted) or Norm^L(O^L) + p Norm^G(O^G) (additive)

`generate` re-encodes the whole sequence at every step (no KV cache): exact, quadratic in length.
`attention_mask` zeros (padding, left or right) are never attended to and never routed global. Arithmetic is in
at least fp32 (fp64 weights compute in fp64). This file stands alone; tests/test_export.py checks it against the
`logo` package (the same logits in float64 for every attention kind, and the same fusion rule).
"""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_logo import LogoConfig

_SCORE_ELEMS = 1 << 25  # bound on one (H, queries, keys) score block


def upcast(x):
    """x in at least fp32 (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def gated_fusion(n_local, n_global, p, z, weighted):
    """LoGo's fusion of the normalised branch outputs n_local, n_global (N, H, D), gate p (N,), decisions z (N,)
    bool: n_local where not z; (1 - p) n_local + p n_global (weighted) or n_local + p n_global (additive), summed in
    at least fp32 and rounded once, where z."""
    cdt = torch.float64 if n_local.dtype == torch.float64 else torch.float32
    p_ = p[:, None, None].to(cdt)  # (N, 1, 1)
    fused = ((1.0 - p_) * n_local.to(cdt) if weighted else n_local.to(cdt)) + p_ * n_global.to(cdt)
    return torch.where(z[:, None, None], fused.to(n_local.dtype), n_local)


class LogoRMSNorm(nn.Module):
    """RMSNorm over the last dim in fp32; weight (D,) or head-wise (H, D)."""

    def __init__(self, shape, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape))

    def forward(self, x):
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).to(x.dtype)


def rope_cos_sin(positions, head_dim, theta):
    """positions (B, T) -> cos, sin (B, T, 1, D/2) fp32 (angles in fp64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64)
                                / head_dim))
    angles = positions.double()[..., None] * inv_freq  # (B, T, D/2)
    return angles.cos().float()[:, :, None], angles.sin().float()[:, :, None]


def apply_rope(x, cos, sin):
    """Rotate the pairs (x[i], x[i + D/2]): x (B, T, H, D), cos/sin broadcastable to (B, T, H, D/2)."""
    xf = upcast(x)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def attend(q, k, v, q_idx, key_ok, window=None):
    """Causal softmax attention of queries at row indices q_idx (Tq,) over every key (Tk,) of one sequence:
    q (Tq, H, D), k/v (Tk, H, D), key_ok (Tk,) bool; window: keys q_idx-window+1 .. q_idx only -> (Tq, H, D)."""
    tk, h = k.shape[0], k.shape[1]
    kidx = torch.arange(tk, device=q.device)
    kt, vt = upcast(k.transpose(0, 1)), upcast(v.transpose(0, 1))  # (H, Tk, D)
    out, step = [], max(1, _SCORE_ELEMS // (h * max(tk, 1)))
    for s in range(0, q.shape[0], step):
        qi = q_idx[s:s + step]
        allowed = (kidx[None] <= qi[:, None]) & key_ok[None]
        if window is not None:
            allowed &= kidx[None] > qi[:, None] - window
        allowed |= kidx[None] == qi[:, None]  # a padding query still sees itself (no empty softmax)
        o = F.scaled_dot_product_attention(upcast(q[s:s + step].transpose(0, 1)), kt, vt, attn_mask=allowed)
        out.append(o.transpose(0, 1))
    return torch.cat(out).to(q.dtype) if out else q.new_zeros(q.shape)


def attend_rows(q, k, v, valid, window=None):
    """Dense-query attention over a batch: q, k, v (B, T, H, D), valid (B, T) bool -> (B, T, H, D)."""
    idx = torch.arange(q.shape[1], device=q.device)
    return torch.stack([attend(q[b], k[b], v[b], idx, valid[b], window) for b in range(q.shape[0])])


class LogoAttention(nn.Module):
    """Shared projections and one of the attention kinds; LoGo adds its branch transform, gate and norms."""

    def __init__(self, config: LogoConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_kinds[layer_idx]
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.window, self.rope_theta = config.window, config.rope_theta
        d, inner, h, hd = config.hidden_size, self.n_heads * self.head_dim, self.n_heads, self.head_dim
        self.q_proj = nn.Linear(d, inner, bias=False)
        self.k_proj = nn.Linear(d, inner, bias=False)
        self.v_proj = nn.Linear(d, inner, bias=False)
        self.o_proj = nn.Linear(inner, d, bias=False)
        self.num_global_heads = config.num_global_heads
        if self.kind != "logo":
            return
        self.transform, self.fusion = config.transform, config.fusion
        self.threshold = float(config.thresholds[layer_idx])  # b, frozen from the checkpoint (fp32 value)
        if self.transform == "lp":
            self.transform_A = nn.Parameter(torch.empty(3, h, hd, hd))  # (q|k|v, H, D, D)
        elif self.transform == "so":
            self.transform_scale = nn.Parameter(torch.empty(3, h, hd))
            self.transform_offset = nn.Parameter(torch.empty(3, h, hd))
        elif self.transform == "full":
            self.q_proj_global = nn.Linear(d, inner, bias=False)
            self.k_proj_global = nn.Linear(d, inner, bias=False)
            self.v_proj_global = nn.Linear(d, inner, bias=False)
        self.gate = nn.Parameter(torch.empty(d))
        norm = (lambda: LogoRMSNorm((h, hd), config.rms_norm_eps)) if config.context_norm else nn.Identity
        self.norm_local, self.norm_global = norm(), norm()

    def _heads(self, t):
        return t.view(*t.shape[:-1], self.n_heads, self.head_dim)

    def phi(self, i, u):
        """Branch transform of q (0), k (1) or v (2): u (..., H, D) -> (..., H, D)."""
        if self.transform == "lp":
            return torch.einsum("...hd,hde->...he", u, self.transform_A[i].to(u.dtype))
        if self.transform == "so":
            return u * self.transform_scale[i].to(u.dtype) + self.transform_offset[i].to(u.dtype)
        return u

    def forward(self, x, cos, sin, valid):
        """x (B, T, d), cos/sin (B, T, 1, D/2), valid (B, T) bool -> (B, T, d)."""
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if self.kind == "logo":
            o = self.logo(x, q, k, v, cos, sin, valid)
        else:
            qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            g = {"full": self.n_heads, "local": 0}.get(self.kind, self.num_global_heads)
            parts = []
            if g > 0:
                parts.append(attend_rows(qr[:, :, :g], kr[:, :, :g], v[:, :, :g], valid))
            if g < self.n_heads:
                parts.append(attend_rows(qr[:, :, g:], kr[:, :, g:], v[:, :, g:], valid, self.window))
            o = torch.cat(parts, dim=2)
        return self.o_proj(o.flatten(2))

    def logo(self, x, q, k, v, cos, sin, valid):
        """LoGo mixing before o_proj: (B, T, H, D)."""
        xf = upcast(x)
        p = torch.sigmoid(xf @ self.gate.to(xf.dtype))  # (B, T)
        z = (p > self.threshold) & valid  # (B, T) routing decision
        o_local = attend_rows(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, valid, self.window)  # (B, T, H, D)
        if self.transform == "full":
            kg, vg = self._heads(self.k_proj_global(x)), self._heads(self.v_proj_global(x))
        else:
            kg, vg = self.phi(1, k), self.phi(2, v)
        kg = apply_rope(kg, cos, sin)
        out = []
        for b in range(x.shape[0]):
            sel = torch.nonzero(z[b]).squeeze(1)  # (Nq,) selected rows of sequence b
            o_global = torch.zeros_like(o_local[b])  # (T, H, D): the global branch at the selected rows only
            if sel.numel() > 0:
                if self.transform == "full":
                    qg = self._heads(self.q_proj_global(x[b, sel]))
                else:
                    qg = self.phi(0, q[b, sel])
                qg = apply_rope(qg[None], cos[b, sel][None], sin[b, sel][None])[0]  # (Nq, H, D)
                o_global[sel] = attend(qg, kg[b], vg[b], sel, valid[b])
            out.append(gated_fusion(self.norm_local(o_local[b]), self.norm_global(o_global), p[b], z[b],
                                    self.fusion == "weighted"))
        return torch.stack(out)


class LogoMLP(nn.Module):
    def __init__(self, config: LogoConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LogoDecoderLayer(nn.Module):
    def __init__(self, config: LogoConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = LogoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LogoAttention(config, layer_idx)
        self.post_attention_layernorm = LogoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LogoMLP(config)

    def forward(self, x, cos, sin, valid):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, valid)
        return x + self.mlp(self.post_attention_layernorm(x))


class LogoPreTrainedModel(PreTrainedModel):
    config_class = LogoConfig
    base_model_prefix = "model"
    _no_split_modules = ["LogoDecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        """Only for weights a folder lacks: the identity/neutral start of LoGo's own parameters."""
        std = self.config.initializer_range if hasattr(self.config, "initializer_range") else 0.02
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
        elif isinstance(module, LogoRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, LogoAttention) and module.kind == "logo":
            if module.transform == "lp":
                module.transform_A.copy_(torch.eye(module.head_dim).expand_as(module.transform_A))
            elif module.transform == "so":
                module.transform_scale.fill_(1.0)
                module.transform_offset.zero_()
            module.gate.normal_(0.0, 1e-3)


class LogoModel(LogoPreTrainedModel):
    def __init__(self, config: LogoConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LogoDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LogoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        """input_ids (B, T) -> last hidden states (B, T, d)."""
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if position_ids is None:  # positions count real tokens only (left padding shifts nothing)
            position_ids = (valid.long().cumsum(-1) - 1).clamp_min(0)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, valid)
        return self.norm(h)


class LogoForCausalLM(LogoPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # used only if tie_word_embeddings

    def __init__(self, config: LogoConfig):
        super().__init__(config)
        self.model = LogoModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        h = self.model(input_ids, attention_mask, position_ids)
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No KV cache: every step re-encodes the whole sequence so far."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
