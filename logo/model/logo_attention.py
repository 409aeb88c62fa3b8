"""The LoGo attention layer (paper Sec. 3.2, Eq. 4-10).

    q, k, v   = x W_q, x W_k, x W_v                         local branch, all tokens
    u^G_h     = phi_{U,h}(u^L_h)  for u in {q, k, v}          global branch (pre-RoPE transform)
    p_t       = sigmoid(x_t . w_g) ; z_t = [p_t > b]          one decision per token, shared by all heads
    O^L       = SWA_w(q, k, v)                                every token
    O^G_I     = Attn_inf(q^G_I, k^G, v^G)                     selected rows I only (query-sparse)
    o_t       = (1 - p_t) Norm^L(O^L_t) + p_t Norm^G(O^G_t)   if z_t  (weighted fusion)
              = Norm^L(O^L_t)                                 otherwise
    out       = o W_o

Ablation variants (AttentionConfig): transform lp | so | shared | full; context_norm off -> Norm = identity;
fusion 'additive': o_t = Norm^L(O^L_t) + p_t Norm^G(O^G_t) for selected tokens (CoLT5-style: the local
output is kept whole and the gate only scales the global addition); budget_control 'aux_loss': see
`aux_loss` below.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn as nn

from logo.config import ModelConfig
from logo.kernels import dispatch
from logo.model.attention import QKVAttention
from logo.kernels.rope import upcast
from logo.model.layers import PackedSeqs, RMSNorm, autocast_input
from logo.model.routing import partition, route, routing_stats, soft_ratio


class BranchTransform(nn.Module):
    """phi_{U,h}: per-head map from local-branch to global-branch q/k/v (pre-RoPE). Starts as identity.

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
    """p_t = sigmoid(x_t . w_g): one routing probability per token, read from the full hidden state."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))  # w_g

    def forward(self, x: torch.Tensor, x_low: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, d) -> (N,) in at least fp32. The logit is an fp32 product even under autocast: in bf16 it
        has 8 bits of mantissa, so many gates would tie at the threshold and decisions would hang on rounding.
        x_low: the same activation in the precision the projections keep (their autocast copy, or x itself). When
        given and narrower than fp32, the weight's gradient is taken from it, so no fp32 copy of x is kept."""
        xf = upcast(x.flatten(0, 1))  # (N, d)
        with torch.autocast(xf.device.type, enabled=False):
            w = self.weight.to(xf.dtype)
            plain = x_low is None or x_low.dtype == xf.dtype
            # x_low takes no gradient here (x's flows through xf): detached, it adds no edge to the autograd graph
            logit = xf @ w if plain else _LogitKeepingNarrowInput.apply(xf, x_low.detach(), w)
            return torch.sigmoid(logit)


class _LogitKeepingNarrowInput(torch.autograd.Function):
    """x @ w in x's precision, keeping a narrower copy of x (the projections' own) for w's gradient.

    forward: x (N, d) fp32, x_low (..., d) bf16/fp16 (the same values, rounded), w (d,) fp32 -> (N,) fp32.
    backward: dx = g w^T exactly; dw = x_low^T g in fp32 (x's rounding enters dw only, as it does for W_q, W_k,
    W_v, whose gradients read the same copy)."""

    @staticmethod
    def forward(ctx, x, x_low, w):
        ctx.save_for_backward(x_low, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):  # g (N,) fp32
        x_low, w = ctx.saved_tensors
        # fp32 products: a compiled graph traces this backward under the forward's caller's autocast
        with torch.autocast(g.device.type, enabled=False):
            dx = g[:, None] * w[None, :] if ctx.needs_input_grad[0] else None  # (N, d)
            # (d,) fp32; as a matrix-vector product, which Inductor folds into the block's other row reductions
            dw = torch.mv(x_low.flatten(0, -2).t().to(g.dtype), g) if ctx.needs_input_grad[2] else None
        return dx, None, dw


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

    def forward(self, x, cos, sin, seqs: PackedSeqs):
        """x (B, T, d) -> out (B, T, d), aux_loss scalar or None, routing stats (K,) (logo.model.controller)."""
        a, B, T = self.attn_cfg, x.shape[0], x.shape[1]
        x_low = autocast_input(x)  # (B, T, d): the one copy of x the backward keeps (projections and gate)
        q, k, v = self.project(x_low)  # (B, T, H, D) pre-RoPE
        # Compiled, the gate's plain fp32 product lets Inductor fuse w_g's gradient into the block's row reductions.
        o, p, z = self.branches(x, None if torch.compiler.is_compiling() else x_low, q, k, v, cos, sin, seqs)
        out = self.wo(o.view(B, T, -1))  # (B, T, d)
        aux = self.aux_loss(p, seqs) if a.budget_control == "aux_loss" else None
        return out, aux, routing_stats(z, p, seqs.valid, self.threshold, a)

    def branches(self, x, x_low, q, k, v, cos, sin, seqs: PackedSeqs):
        """Everything between the shared projections and W_o: x (B, T, d) (x_low: the gate's, see `Gate.forward`),
        pre-RoPE q, k, v (B, T, H, D) -> o (N, H, D), p (N,), z (N,) bool. Static shapes, no host synchronisation."""
        a, B = self.attn_cfg, x.shape[0]
        # Gate and routing: p_t = sigmoid(x_t . w_g), z_t = [p_t > b], the selected rows first.
        p = self.gate_probs(x, x_low)  # (N,) fp32, N = B*T
        z = route(p, self.threshold, seqs)  # (N,) bool
        sel = partition(z, seqs)

        # Both branches: local SWA over every row from RoPE(q), RoPE(k), v; global query-sparse attention of the
        # selected rows from RoPE(phi_Q(q)), RoPE(phi_K(k)), phi_V(v). (N, H, D) each; o_global zero elsewhere.
        x_rows = (x if x_low is None else x_low).flatten(0, 1)  # (N, d): what the `full` variant's projections read
        A = self.transform.A if a.transform == "lp" else None
        o_local, o_global = self.attention_ops.logo_branches(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cos, sin, B, seqs.pos, sel.rows, sel.cu_seqlens_q,
            seqs.cu_seqlens, self.window, a.backend, A=A, global_qkv=partial(self.global_branch_qkv, x_rows))

        # ContextNorm of each branch and the fusion (weighted or additive) at the selected rows: (N, H, D).
        return self.fuse(o_local, o_global, p, z), p, z

    def global_branch_qkv(self, x, q, k, v):
        """The global branch's pre-RoPE q, k, v (N, H, D) of every row, from the rows' inputs x (N, d) or their
        local-branch q, k, v (N, H, D). Every row's query is transformed (static shapes); the op reads the selected
        ones."""
        if self.attn_cfg.transform == "full":
            D = self.head_dim
            return self.wq_g(x).unflatten(-1, (-1, D)), self.wk_g(x).unflatten(-1, (-1, D)), \
                self.wv_g(x).unflatten(-1, (-1, D))
        return self.transform(0, q), self.transform(1, k), self.transform(2, v)

    def gate_probs(self, x: torch.Tensor, x_low: Optional[torch.Tensor] = None) -> torch.Tensor:
        """p_t = sigmoid(x_t . w_g): x (B, T, d) -> (N,) in at least fp32 (x_low: see `Gate.forward`)."""
        return self.gate(x, x_low)

    def fuse(self, o_local, o_global, p, z):
        """Both ContextNorms and the fusion: o_local, o_global (N, H, D), p (N,), z (N,) -> o (N, H, D); unselected
        rows are exactly Norm^L(O^L). One kernel each way where `dispatch.fuses_context_norm`
        (`logo::context_fuse_fwd`); otherwise the same math as one elementwise expression."""
        a = self.attn_cfg
        if isinstance(self.norm_local, RMSNorm) and dispatch.fuses_context_norm(
                o_local, (self.norm_local.weight, self.norm_global.weight), a.backend):
            return dispatch.context_fuse(o_local, o_global, p, z, self.norm_local.weight, self.norm_global.weight,
                                         self.norm_local.eps, a.fusion == "weighted", a.backend)
        o_local = self.norm_local(o_local)
        p_ = p[:, None, None]  # (N, 1, 1): the gate's only path into the output, through selected rows
        o_l, o_g = upcast(o_local), upcast(self.norm_global(o_global))
        fused = ((1.0 - p_) * o_l if a.fusion == "weighted" else o_l) + p_ * o_g
        return torch.where(z[:, None, None], fused.to(o_local.dtype), o_local)

    def aux_loss(self, p, seqs: PackedSeqs) -> torch.Tensor:
        """Auxiliary-loss budget control (ablation): lambda * (F_soft - rho)^2, where
        F_soft = mean_valid sigmoid((p - b) / tau) is a differentiable surrogate of the realized ratio.
        In this mode the threshold only follows the P-mask ramp (b0 -> 0.5, then fixed)."""
        a = self.attn_cfg
        f_soft = soft_ratio(p, self.threshold, seqs.valid, a.aux_loss_temperature)
        return a.aux_loss_coef * (f_soft - self.rho) ** 2
