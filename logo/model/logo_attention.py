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

from typing import Optional

import torch
import torch.nn as nn

from logo.config import ModelConfig
from logo.kernels import dispatch
from logo.model.attention import QKVAttention
from logo.model.layers import PackedSeqs, RMSNorm, apply_rope, autocast_input, upcast
from logo.model.recompute import recompute_all_but_attention
from logo.model.routing import Selection, partition, route, routing_stats, soft_ratio


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
            logit = xf @ w if plain else _LogitKeepingNarrowInput.apply(xf, x_low, w)
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
        # True when the whole block is recomputed in the backward (activation checkpointing): its rerun forward
        # then lives only for that block's backward, and recomputing the branch inputs once more inside it
        # would only repeat the transforms and RoPE (see `recompute_branch_inputs`).
        self.block_recomputed = False

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

    def global_branch_qkv(self, x, q, k, v):
        """Pre-RoPE global q, k, v (N, H, D) of every row, from the rows' inputs x (N, d) or their local-branch
        q, k, v (N, H, D). Every row's query is transformed (static shapes); the kernel reads the selected ones."""
        if self.attn_cfg.transform == "full":
            H, D = self.n_heads, self.head_dim
            return (self.wq_g(x).view(-1, H, D), self.wk_g(x).view(-1, H, D), self.wv_g(x).view(-1, H, D))
        return self.transform(0, q), self.transform(1, k), self.transform(2, v)

    def gate_probs(self, x: torch.Tensor, x_low: Optional[torch.Tensor] = None) -> torch.Tensor:
        """p_t = sigmoid(x_t . w_g): x (B, T, d) -> (N,) in at least fp32 (x_low: see `Gate.forward`)."""
        return self.gate(x, x_low)

    def mix(self, x, cos, sin, seqs: PackedSeqs):
        """Both branches, the fusion and the routing statistics: x (B, T, d) -> o (N, H, D) before W_o, p (N,),
        z (N,) bool, routing stats (K,) (`routing_stats`)."""
        x_low = autocast_input(x)  # (B, T, d): the one copy of x the backward keeps (projections and gate)
        q, k, v = self.project(x_low)
        if self.compile_glue(x):
            return _compiled_glue()(self, x, x_low, q, k, v, cos, sin, seqs)
        # A compiled block: its partitioner keeps no fp32 copy of x, and Inductor fuses the gate's plain weight
        # gradient into the block's other row reductions (with the narrow-copy gradient the step was ~2% slower).
        gate_low = None if torch.compiler.is_compiling() else x_low
        return self.glue(x, gate_low, q, k, v, cos, sin, seqs)

    def glue(self, x, x_low, q, k, v, cos, sin, seqs: PackedSeqs):
        """`branches` and the routing statistics of its decisions: -> o (N, H, D), p (N,), z (N,), stats (K,).
        The statistics are ~20 small reductions; eager, each was a host dispatch per layer in the forward, where
        the host already sets the pace (docs/benchmarks.md, Session 18), so they run inside the compiled glue."""
        o, p, z = self.branches(x, x_low, q, k, v, cos, sin, seqs)
        return o, p, z, routing_stats(z, p, seqs.valid, self.threshold, self.attn_cfg)

    def compile_glue(self, x: torch.Tensor) -> bool:
        """attention.compile_glue: in an eager CUDA training step, run `glue` (gate, routing, transforms, RoPE,
        both attention ops, ContextNorms, fusion, routing statistics) as one compiled region, so its elementwise
        glue is fused as under train.compile. Not inside an outer compile, under no_grad (evaluation, decoding),
        with an attention override (context parallelism) or with distributed tensors (tensor parallelism)."""
        return (self.attn_cfg.compile_glue and x.is_cuda and torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and not dispatch.overridden() and type(x) is torch.Tensor
                and type(self.gate.weight.data) is torch.Tensor)  # a DTensor weight: tensor parallelism

    def branches(self, x, x_low, q, k, v, cos, sin, seqs: PackedSeqs):
        """Everything between the shared projections and W_o: x (B, T, d) (x_low: the gate's, see `Gate.forward`),
        pre-RoPE q, k, v (B, T, H, D) -> o (N, H, D), p (N,), z (N,) bool. Static shapes, no host synchronisation."""
        p = self.gate_probs(x, x_low)  # (N,)
        z = route(p, self.threshold, seqs)  # (N,) bool
        sel = partition(z, seqs)
        x = x if x_low is None else x_low  # the `full` variant's global projections read the cast copy too
        x, q, k, v = x.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)  # (N, ...)
        if self.fuses_branches(q):  # one op call each way; it recomputes (or keeps) the branch inputs itself
            A, a = self.transform.A, self.attn_cfg
            o_local, o_global = dispatch.logo_branches(q, k, v, A, cos, sin, seqs.pos, sel.rows, sel.cu_seqlens_q,
                                                       seqs.cu_seqlens, self.window,
                                                       not self.recompute_branch_inputs(), a.backend)
        elif self.recompute_branch_inputs():
            o_local, o_global = recompute_all_but_attention(self.attend, x, q, k, v, cos, sin, seqs, sel)
        else:
            o_local, o_global = self.attend(x, q, k, v, cos, sin, seqs, sel)
        return self.fuse(o_local, o_global, p, z), p, z

    def fuses_branches(self, q: torch.Tensor) -> bool:
        """attention.fuse_branches (with fuse_rope, LP transforms, the Triton backend, no context parallelism):
        the branch inputs and both attention ops as one op pair (`logo.kernels.branches`)."""
        return self.attn_cfg.fuse_branches and not dispatch.overridden() and self.fuses_rope(q)

    def fuses_rope(self, q: torch.Tensor) -> bool:
        """attention.fuse_rope with LP transforms on the Triton backend (`dispatch.fuses_rope_transform`)."""
        A = getattr(self.transform, "A", None)
        return A is not None and self.attn_cfg.fuse_rope and dispatch.fuses_rope_transform(q, A, self.attn_cfg.backend)

    def recompute_branch_inputs(self) -> bool:
        """attention.recompute_branch_inputs: always, never, or (compiled) only while torch.compile traces; never
        when the whole block is already recomputed (`block_recomputed`)."""
        mode = self.attn_cfg.recompute_branch_inputs
        if not torch.is_grad_enabled() or self.block_recomputed:
            return False
        return mode == "always" or (mode == "compiled" and torch.compiler.is_compiling())

    def attend(self, x, q, k, v, cos, sin, seqs: PackedSeqs, sel: Selection):
        """Both branches' attention from the rows' inputs x (N, d) and pre-RoPE q, k, v (N, H, D):
        -> o_local (N, H, D) every row, o_global (N, H, D) zero at unselected rows."""
        backend = self.attn_cfg.backend
        q, k, qg, kg, vg = self.rotated_branch_inputs(x, q, k, v, cos, sin, seqs)  # (N, H, D) each

        # Local branch: every token.
        o_local = dispatch.sliding_window_attention(q, k, v, seqs.cu_seqlens, self.window, backend=backend)

        # Global branch: the selected query rows (sel.rows[:n_sel]) over dense keys/values; zero elsewhere.
        o_global = dispatch.query_sparse_attention(qg, kg, vg, seqs.pos, sel.rows, sel.cu_seqlens_q,
                                                   seqs.cu_seqlens, backend=backend)  # (N, H, D)
        return o_local, o_global

    def rotated_branch_inputs(self, x, q, k, v, cos, sin, seqs: PackedSeqs):
        """Both branches' attention inputs from x (N, d) and pre-RoPE q, k, v (N, H, D): RoPE(q), RoPE(k),
        RoPE(q^G), RoPE(k^G), v^G (N, H, D). With LP transforms on the Triton backend, q, k and v pass through the
        fused kernel (`logo::rope_transform_fwd`: both RoPEs and the transform in one read of q and of k, and v's
        transform in the same launch)."""
        if self.fuses_rope(q):
            q, k, qg, kg, vg = dispatch.rope_transform(q, k, v, self.transform.A, cos, sin, self.attn_cfg.backend)
            return q, k, qg, kg, vg
        qg, kg, vg = self.global_branch_qkv(x, q, k, v)
        q, k = apply_rope(q, cos, sin, seqs.batch), apply_rope(k, cos, sin, seqs.batch)
        qg, kg = apply_rope(qg, cos, sin, seqs.batch), apply_rope(kg, cos, sin, seqs.batch)
        return q, k, qg, kg, vg

    def fuse(self, o_local, o_global, p, z):
        """Both ContextNorms and the fusion: o_local, o_global (N, H, D), p (N,), z (N,) -> o (N, H, D); unselected
        rows are exactly Norm^L(O^L). With attention.fuse_context_norm on the Triton backend, one kernel each way
        (`logo::context_fuse_fwd`); otherwise one elementwise expression (compile fuses its forward)."""
        a = self.attn_cfg
        if isinstance(self.norm_local, RMSNorm) and a.fuse_context_norm and dispatch.fuses_context_norm(
                o_local, (self.norm_local.weight, self.norm_global.weight), a.backend):
            return dispatch.context_fuse(o_local, o_global, p, z, self.norm_local.weight, self.norm_global.weight,
                                         self.norm_local.eps, a.fusion == "weighted", a.backend)
        o_local = self.norm_local(o_local)
        p_ = p[:, None, None]  # (N, 1, 1): the gate's only path into the output, through selected rows
        o_l, o_g = upcast(o_local), upcast(self.norm_global(o_global))
        fused = ((1.0 - p_) * o_l if self.attn_cfg.fusion == "weighted" else o_l) + p_ * o_g
        return torch.where(z[:, None, None], fused.to(o_local.dtype), o_local)

    def forward(self, x, cos, sin, seqs: PackedSeqs):
        """x (B, T, d) -> out (B, T, d), aux_loss scalar or None, routing stats (K,) (logo.model.controller)."""
        B, T, _ = x.shape
        o, p, _, stats = self.mix(x, cos, sin, seqs)
        out = self.wo(o.view(B, T, -1))
        aux = self.aux_loss(p, seqs) if self.attn_cfg.budget_control == "aux_loss" else None
        return out, aux, stats

    def aux_loss(self, p, seqs: PackedSeqs) -> torch.Tensor:
        """Auxiliary-loss budget control (ablation): lambda * (F_soft - rho)^2, where
        F_soft = mean_valid sigmoid((p - b) / tau) is a differentiable surrogate of the realized ratio.
        In this mode the threshold only follows the P-mask ramp (b0 -> 0.5, then fixed)."""
        a = self.attn_cfg
        f_soft = soft_ratio(p, self.threshold, seqs.valid, a.aux_loss_temperature)
        return a.aux_loss_coef * (f_soft - self.rho) ** 2

    def global_head_fraction(self) -> float:
        return self.rho  # target; the realized ratio is reported by the controller


_COMPILED_GLUE = None


def _compiled_glue():
    """LoGoAttention.glue compiled once for every layer (the layer is an argument: its parameters and threshold
    are graph inputs, so the layers share one graph per input shape)."""
    global _COMPILED_GLUE
    if _COMPILED_GLUE is None:
        _COMPILED_GLUE = torch.compile(LoGoAttention.glue, fullgraph=True)
    return _COMPILED_GLUE
