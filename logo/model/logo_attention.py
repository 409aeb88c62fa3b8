"""The LoGo attention layer (paper Sec. 3.2, Eq. 4-10), training, prefill and decoding alike.

    Eq. 4   q, k, v   = x W_q, x W_k, x W_v                  local branch, all tokens (`project`)
    Eq. 5   u^G_h     = phi_{U,h}(u^L_h)  for u in {q, k, v}   global branch, pre-RoPE (`BranchTransform`,
                                                              `global_branch_qkv`)
    Eq. 6   O^L       = SWA_w(q, k, v)                         every token (`branch_outputs`)
    Eq. 7   p_t       = sigmoid(x_t . w_g) ; z_t = [p_t > b]   one decision per token, shared by all heads (`Gate`,
                                                              `route`)
    Eq. 8   O^G_I     = Attn_inf(q^G_I, k^G, v^G)              selected rows I only, query-sparse (`branch_outputs`)
    Eq. 9   Norm^L, Norm^G                                     head-wise RMSNorm of each branch (ContextNorm)
    Eq. 10  o_t       = (1 - p_t) Norm^L(O^L_t) + p_t Norm^G(O^G_t)   if z_t  (weighted fusion, `fuse`)
                      = Norm^L(O^L_t)                                 otherwise
            out       = o W_o

Ablation variants (AttentionConfig): transform lp | so | shared | full; context_norm off -> Norm = identity;
fusion 'additive': o_t = Norm^L(O^L_t) + p_t Norm^G(O^G_t) for selected tokens (CoLT5-style: the local
output is kept whole and the gate only scales the global addition); budget_control 'aux_loss': see
`aux_loss` below.

One forward serves every use (`logo.model.attention.QKVAttention.forward`): `encode` over packed sequences
(training; with a `CacheWrite`, the prefill, which also stores the rotated local keys in the ring cache and the
rotated global keys in the dense one) and `decode` for one token per row over those caches (the same gate,
transforms and fusion; the global branch is the decode kernel with z as its active rows, so unselected rows
cost no work). Static shapes and no host synchronisation in both.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from logo.config import ModelConfig
from logo.kernels import dispatch
from logo.kernels.gate import gate_logit
from logo.kernels.recompute import recompute_all_but_attention
from logo.kernels.reference import gated_fusion
from logo.kernels.rope import apply_rope, apply_rope_rows, upcast
from logo.model.attention import QKVAttention
from logo.model.kv_cache import CacheWrite, DecodeStep, LayerCache
from logo.model.layers import PackedSeqs, RMSNorm, autocast_input
from logo.model.routing import Selection, partition, routing_stats, soft_ratio


class BranchTransform(nn.Module):
    """phi_{U,h} (Eq. 5): per-head map from local-branch to global-branch q/k/v (pre-RoPE). Starts as identity.

    lp: u_h A_{U,h} with A (H, D, D); so: u_h * s_{U,h} + b_{U,h}; shared: identity (no parameters).
    ('full' separate projections live in LoGoAttention since they read x, not u.)
    """

    def __init__(self, kind: str, n_heads: int, head_dim: int):
        super().__init__()
        self.kind = kind
        if kind == "lp":
            self.A = nn.Parameter(torch.empty(3, n_heads, head_dim, head_dim))  # (q|k|v, H, D, D)
        elif kind == "so":
            self.scale = nn.Parameter(torch.empty(3, n_heads, head_dim))
            self.offset = nn.Parameter(torch.empty(3, n_heads, head_dim))

    def forward(self, i: int, u: torch.Tensor) -> torch.Tensor:
        """u (..., H, D) -> (..., H, D) for branch tensor i (0=q, 1=k, 2=v)."""
        if self.kind == "lp":
            return torch.einsum("...hd,hde->...he", u, self.A[i].to(u.dtype))
        if self.kind == "so":
            return u * self.scale[i].to(u.dtype) + self.offset[i].to(u.dtype)
        return u

    def reset_parameters(self):
        if self.kind == "lp":
            with torch.no_grad():
                self.A.zero_()
                self.A.add_(torch.eye(self.A.shape[-1], device=self.A.device, dtype=self.A.dtype))
        elif self.kind == "so":
            nn.init.ones_(self.scale)
            nn.init.zeros_(self.offset)


class Gate(nn.Module):
    """p_t = sigmoid(x_t . w_g) (Eq. 7): one routing probability per token, read from the full hidden state."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))  # w_g

    def forward(self, x: torch.Tensor, x_low: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, d) -> (N,) in at least fp32. The logit is an fp32 product even under autocast: in bf16 it
        has 8 bits of mantissa, so many gates would tie at the threshold and decisions would hang on rounding.
        x_low: the same activation in the precision the projections keep (their autocast copy, or x itself), which
        the product's weight gradient may read instead of an fp32 copy of x (`logo.kernels.gate.gate_logit`)."""
        xf = upcast(x.flatten(0, 1))  # (N, d)
        with torch.autocast(xf.device.type, enabled=False):
            return torch.sigmoid(gate_logit(xf, x_low, self.weight.to(xf.dtype)))


def route(p: torch.Tensor, threshold: torch.Tensor, seqs) -> torch.Tensor:
    """z_t = [p_t > b] (Eq. 7) for the rows that may be routed (`seqs.valid`: not padding; while decoding, the
    rows still generating). p (N,) fp32, threshold (1,) fp32 -> (N,) bool."""
    return (p > threshold) & seqs.valid


class LoGoAttention(QKVAttention):
    """Coupled local/global branches with token-level routing and a per-layer budget threshold."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        a = cfg.attention
        H, D = self.n_heads, self.head_dim
        self.window, self.rho = a.window, a.rho
        self.transform = BranchTransform(a.transform, H, D)
        if a.transform == "full":  # separate global W_q, W_k, W_v (about +20% parameters)
            self.wq_g = nn.Linear(cfg.dim, H * D, bias=False)
            self.wk_g = nn.Linear(cfg.dim, H * D, bias=False)
            self.wv_g = nn.Linear(cfg.dim, H * D, bias=False)
        self.gate = Gate(cfg.dim)
        self.norm_local = RMSNorm((H, D), eps=cfg.norm_eps) if a.context_norm else nn.Identity()
        self.norm_global = RMSNorm((H, D), eps=cfg.norm_eps) if a.context_norm else nn.Identity()
        # Budget threshold b (fp32, checkpointed); updated once per optimizer step by BudgetController.
        self.register_buffer("threshold", torch.full((1,), 0.5, dtype=torch.float32))

    def init_weights(self, std: float, out_std: float):
        super().init_weights(std, out_std)
        a = self.attn_cfg
        self.transform.reset_parameters()
        if a.transform == "full":  # start from shared representations, like the identity transforms
            with torch.no_grad():
                self.wq_g.weight.copy_(self.wq.weight)
                self.wk_g.weight.copy_(self.wk.weight)
                self.wv_g.weight.copy_(self.wv.weight)
        nn.init.normal_(self.gate.weight, std=a.gate_init_std)
        for norm in (self.norm_local, self.norm_global):
            if isinstance(norm, RMSNorm):
                norm.reset_parameters()
        self.threshold.fill_(0.5 if a.threshold_init is None else a.threshold_init)

    def encode(self, x, cos, sin, seqs: PackedSeqs, cache: Optional[CacheWrite] = None):
        """x (B, T, d) -> out (B, T, d), aux_loss scalar or None, routing stats (K,) (logo.model.controller)."""
        a, B, T = self.attn_cfg, x.shape[0], x.shape[1]
        x_low = autocast_input(x)  # (B, T, d): the one copy of x the backward keeps (projections and gate)
        q, k, v = self.project(x_low)  # (B, T, H, D) pre-RoPE
        if cache is not None:
            self.write_prompt_cache(cache, x_low, k, v, cos, sin)
        o, p, z = self.branches(x, x_low, q, k, v, cos, sin, seqs)
        out = self.wo(o.view(B, T, -1))  # (B, T, d)
        aux = self.aux_loss(p, seqs) if a.budget_control == "aux_loss" else None
        return out, aux, routing_stats(z, p, seqs.valid, self.threshold, a)

    def branches(self, x, x_low, q, k, v, cos, sin, seqs: PackedSeqs):
        """Everything between the shared projections and W_o: x (B, T, d) and its autocast copy x_low (the gate's
        and the `full` variant's global projections' input), pre-RoPE q, k, v (B, T, H, D) -> o (N, H, D),
        p (N,), z (N,) bool. Static shapes, no host synchronisation."""
        p = self.gate_probs(x, x_low)  # (N,) fp32, N = B*T
        z = route(p, self.threshold, seqs)  # (N,) bool
        sel = partition(z, seqs)  # the selected rows first
        o_local, o_global = self.branch_outputs(x_low.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1),
                                                v.flatten(0, 1), cos, sin, seqs, sel)
        return self.fuse(o_local, o_global, p, z), p, z

    def branch_outputs(self, x, q, k, v, cos, sin, seqs: PackedSeqs, sel: Selection):
        """Both branches (Eq. 5, 6, 8) of the rows' inputs x (N, d) and pre-RoPE q, k, v (N, H, D): o_local =
        SWA_w(RoPE(q), RoPE(k), v) over every row, o_global = the query-sparse attention of the selected rows'
        RoPE(phi_Q(q)) over RoPE(phi_K(k)), phi_V(v); (N, H, D) each, o_global zero at unselected rows.

        One op pair (`logo.kernels.branches`) where the attention ops fuse the LP branches; otherwise the separate
        ops (`attend_branches`), whose branch inputs the backward recomputes where the ops say so (a compiled
        step: `AttentionOps.recomputes_branch_inputs`)."""
        ops, a = self.attention_ops, self.attn_cfg
        A = self.transform.A if a.transform == "lp" else None
        if ops.fuses_branches(q, A, a.backend):
            return ops.logo_branches(q, k, v, A, cos, sin, seqs.pos, sel.rows, sel.cu_seqlens_q, seqs.cu_seqlens,
                                     self.window, a.backend)
        args = (x, q, k, v, cos, sin, seqs.batch, seqs.pos, sel.rows, sel.cu_seqlens_q, seqs.cu_seqlens)
        if ops.recomputes_branch_inputs():
            return recompute_all_but_attention(self.attend_branches, *args)
        return self.attend_branches(*args)

    def attend_branches(self, x, q, k, v, cos, sin, batch: int, q_pos, rows, cu_seqlens_q, cu_seqlens_k):
        """`branch_outputs` as separate ops: the branch inputs (the fused RoPE + transform kernel where it runs,
        else the transforms and RoPE in PyTorch), then the sliding-window and query-sparse attention."""
        ops, a = self.attention_ops, self.attn_cfg
        A = self.transform.A if a.transform == "lp" else None
        if A is not None and ops.fuses_rope_transform(q, A, a.backend):
            q, k, qg, kg, vg = dispatch.rope_transform(q, k, v, A, cos, sin, a.backend)  # (N, H, D) each
        else:
            qg, kg, vg = self.global_branch_qkv(x, q, k, v)
            q, k = apply_rope(q, cos, sin, batch), apply_rope(k, cos, sin, batch)
            qg, kg = apply_rope(qg, cos, sin, batch), apply_rope(kg, cos, sin, batch)
        o_local = ops.sliding_window_attention(q, k, v, cu_seqlens_k, self.window, None, a.backend)  # every row
        o_global = ops.query_sparse_attention(qg, kg, vg, q_pos, rows, cu_seqlens_q, cu_seqlens_k, None, a.backend)
        return o_local, o_global

    def global_input(self, i: int, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The global branch's pre-RoPE q (i=0), k (1) or v (2) (Eq. 5): phi_i(u) of the local one u (..., H, D),
        or for the `full` variant its own projection of the rows' inputs x (..., d)."""
        if self.attn_cfg.transform == "full":
            return (self.wq_g, self.wk_g, self.wv_g)[i](x).unflatten(-1, (-1, self.head_dim))
        return self.transform(i, u)

    def global_branch_qkv(self, x, q, k, v):
        """The global branch's pre-RoPE q, k, v (..., H, D) of every row (static shapes; the attention reads the
        selected queries), from the rows' inputs x (..., d) and local q, k, v (..., H, D)."""
        return self.global_input(0, x, q), self.global_input(1, x, k), self.global_input(2, x, v)

    def gate_probs(self, x: torch.Tensor, x_low: Optional[torch.Tensor] = None) -> torch.Tensor:
        """p_t = sigmoid(x_t . w_g): x (B, T, d) -> (N,) in at least fp32 (x_low: see `Gate.forward`)."""
        return self.gate(x, x_low)

    def fuse(self, o_local, o_global, p, z):
        """Both ContextNorms and the fusion (Eq. 9-10): o_local, o_global (N, H, D), p (N,), z (N,) -> o (N, H, D);
        unselected rows are exactly Norm^L(O^L). One kernel each way where `dispatch.fuses_context_norm`
        (`logo::context_fuse_fwd`); otherwise the norms and `gated_fusion`, one elementwise expression."""
        a = self.attn_cfg
        if isinstance(self.norm_local, RMSNorm) and dispatch.fuses_context_norm(
                o_local, (self.norm_local.weight, self.norm_global.weight), a.backend):
            return dispatch.context_fuse(o_local, o_global, p, z, self.norm_local.weight, self.norm_global.weight,
                                         self.norm_local.eps, a.fusion == "weighted", a.backend)
        return gated_fusion(self.norm_local(o_local), self.norm_global(o_global), p, z, a.fusion == "weighted")

    def aux_loss(self, p, seqs: PackedSeqs) -> torch.Tensor:
        """Auxiliary-loss budget control (ablation): lambda * (F_soft - rho)^2, where
        F_soft = mean_valid sigmoid((p - b) / tau) is a differentiable surrogate of the realized ratio.
        In this mode the threshold only follows the P-mask ramp (b0 -> 0.5, then fixed)."""
        a = self.attn_cfg
        f_soft = soft_ratio(p, self.threshold, seqs.valid, a.aux_loss_temperature)
        return a.aux_loss_coef * (f_soft - self.rho) ** 2

    # --- decoding ------------------------------------------------------------------------------------------------
    def cache_heads(self) -> tuple[int, int]:
        """Every head in both caches: the global branch's keys in the dense one, the local branch's in the ring."""
        return self.n_heads, self.n_heads

    def write_prompt_cache(self, cache: CacheWrite, x, k, v, cos, sin) -> None:
        """The prompts' keys and values: RoPE(k), v into the ring, RoPE(phi_K(k)), phi_V(v) of every token into the
        dense cache (later selected queries see them). x (B, T, d), pre-RoPE k, v (B, T, H, D)."""
        kg, vg = self.global_input(1, x, k), self.global_input(2, x, v)
        cache.write((apply_rope(kg, cos, sin), vg), (apply_rope(k, cos, sin), v))

    def decode(self, x, cos, sin, step: DecodeStep, cache: LayerCache) -> torch.Tensor:
        """One token per row: x (B, 1, d), cos/sin (B, D/2) -> (B, 1, d). The gate decides per row on the device;
        the local branch reads the ring, the global branch the dense cache with z as its active rows (unselected
        rows: no work, zeros), fused as in training."""
        backend = self.attn_cfg.backend
        x_low = autocast_input(x)
        q, k, v = (t[:, 0] for t in self.project(x_low))  # (B, H, D) pre-RoPE
        p = self.gate_probs(x, x_low)  # (B,)
        z = route(p, self.threshold, step)  # (B,) bool, on the device
        qg, kg, vg = self.global_branch_qkv(x_low[:, 0], q, k, v)  # (B, H, D) pre-RoPE, every row

        def rope(u):
            return apply_rope_rows(u, cos, sin)

        o_local = cache.ring.attend(rope(q), rope(k), v, step.pos, step.active, backend)
        o_global = cache.dense.attend(rope(qg), rope(kg), vg, step.pos, z, backend)
        step.count(z)
        return self.wo(self.fuse(o_local, o_global, p, z).flatten(1))[:, None]
