"""The LoGo layer's two attention branches as one op pair: the branch inputs (RoPE + transforms) and both
attention ops in one call each way.

    logo::logo_branches_fwd(q, k, v, A, cos, sin, q_pos, rows, cu_q, cu_k, scale, window, keep_rotated, impl)
        -> (o_local, o_global, lse_local, lse_global, RoPE(q), RoPE(k), RoPE(q A_0), RoPE(k A_1), v A_2)
    logo::logo_branches_bwd(do_local, do_global, q, k, v, A, cos, sin, o_local, o_global, lse_local, lse_global,
                            rotated, q_pos, rows, cu_q, cu_k, scale, window, impl) -> (dq, dk, dv, dA)

It runs what `logo.kernels.ops` runs as three ops forward (rope_transform, the sliding window over every row, the
query-sparse global branch) and four backward (the recomputed rope_transform, both attention backwards, the
rope_transform backward), with the same kernels, in one op call each way: every custom-op call costs host time
besides its launches, and a compiled step's forward, whose kernels per layer are short, waits for the host.
v's gradient from the local branch is added
inside the RoPE + transform backward kernel (no separate add). `impl` names the attention implementation
(`logo.kernels.ops.IMPLS`); the RoPE + transform runs the Triton kernel unless it is "reference".

keep_rotated: the backward reads the five rotated inputs from the forward (kept for it) instead of recomputing
them from q, k, v (`AttentionOps.recomputes_branch_inputs` decides; the recomputation is the forward's
arithmetic, so the results are the same either way). The rotated inputs are returned too so the forward's autograd can keep them;
they are not differentiable.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logo.kernels import ops


@torch.library.custom_op("logo::logo_branches_fwd", mutates_args=())
def logo_branches_fwd(q: Tensor, k: Tensor, v: Tensor, A: Tensor, cos: Tensor, sin: Tensor, q_pos: Tensor,
                      rows: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float, window: int, keep_rotated: bool,
                      impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                 Tensor]:
    """o_local, o_global (N, H, D), the base-2 log-sum-exps (H, N) of each branch (private to the backward), and
    the five rotated inputs (N, H, D)."""
    return branches_forward(q, k, v, A, cos, sin, q_pos, rows, cu_q, cu_k, scale, window, impl)


def branches_forward(q, k, v, A, cos, sin, q_pos, rows, cu_q, cu_k, scale: float, window: int, impl: str):
    """The forward op's body (also timed on its own by benchmarks/host_overhead.py)."""
    qr, kr, qgr, kgr, vg = ops.rope_transform_forward(q, k, v, A, cos, sin, impl != "reference")
    o_local, lse_local = ops.attention_forward(qr, kr, v, None, None, cu_k, cu_k, scale, window, impl)
    o_global, lse_global = ops.attention_forward(qgr, kgr, vg, q_pos, rows, cu_q, cu_k, scale, 0, impl)
    return o_local, o_global, lse_local, lse_global, qr, kr, qgr, kgr, vg


@logo_branches_fwd.register_fake
def _(q, k, v, A, cos, sin, q_pos, rows, cu_q, cu_k, scale, window, keep_rotated, impl):
    nhd = [torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(7)]
    return nhd[0], nhd[1], ops.fake_lse(q), ops.fake_lse(q), *nhd[2:]


@torch.library.custom_op("logo::logo_branches_bwd", mutates_args=())
def logo_branches_bwd(do_local: Tensor, do_global: Tensor, q: Tensor, k: Tensor, v: Tensor, A: Tensor, cos: Tensor,
                      sin: Tensor, o_local: Tensor, o_global: Tensor, lse_local: Tensor, lse_global: Tensor,
                      rotated: list[Tensor], q_pos: Tensor, rows: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float,
                      window: int, impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (N, H, D) in q's dtype, dA (3, H, D, D) in A's dtype. rotated: the forward's five rotated
    inputs, or empty to recompute them."""
    return branches_backward(do_local, do_global, q, k, v, A, cos, sin, o_local, o_global, lse_local, lse_global,
                             rotated, q_pos, rows, cu_q, cu_k, scale, window, impl)


def branches_backward(do_local, do_global, q, k, v, A, cos, sin, o_local, o_global, lse_local, lse_global, rotated,
                      q_pos, rows, cu_q, cu_k, scale: float, window: int, impl: str):
    """The backward op's body: the global branch's backward, then the local one's, then the RoPE + transform
    backward (each branch's rotated inputs freed after its use when recomputed)."""
    if rotated:
        qr, kr, qgr, kgr, vg = rotated
    else:
        qr, kr, qgr, kgr, vg = ops.rope_transform_forward(q, k, v, A, cos, sin, impl != "reference")
    dqg, dkg, dvg = ops.attention_backward(do_global, qgr, kgr, vg, o_global, lse_global, q_pos, rows, cu_q, cu_k,
                                           scale, 0, impl)
    del qgr, kgr, vg
    dqr, dkr, dv_local = ops.attention_backward(do_local, qr, kr, v, o_local, lse_local, None, None, cu_k, cu_k,
                                                scale, window, impl)
    del qr, kr
    return ops.rope_transform_backward(dqr, dkr, dqg, dkg, dvg, q, k, v, A, cos, sin, impl != "reference",
                                       gv=dv_local)


@logo_branches_bwd.register_fake
def _(do_local, do_global, q, k, v, A, cos, sin, o_local, o_global, lse_local, lse_global, rotated, q_pos, rows,
      cu_q, cu_k, scale, window, impl):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, A))


def _setup_context(ctx, inputs, output):
    q, k, v, A, cos, sin, q_pos, rows, cu_q, cu_k, scale, window, keep_rotated, impl = inputs
    o_local, o_global, lse_local, lse_global, *rotated = output
    ctx.save_for_backward(q, k, v, A, cos, sin, o_local, o_global, lse_local, lse_global, q_pos, rows, cu_q, cu_k,
                          *(rotated if keep_rotated else ()))
    ctx.cfg = (scale, window, impl)
    ctx.mark_non_differentiable(lse_local, lse_global, *rotated)


def _backward(ctx, do_local, do_global, *_unused):
    q, k, v, A, cos, sin, o_local, o_global, lse_local, lse_global, q_pos, rows, cu_q, cu_k, *rotated = \
        ctx.saved_tensors
    do_local = torch.zeros_like(o_local) if do_local is None else do_local
    do_global = torch.zeros_like(o_global) if do_global is None else do_global
    dq, dk, dv, dA = logo_branches_bwd(do_local, do_global, q, k, v, A, cos, sin, o_local, o_global, lse_local,
                                       lse_global, rotated, q_pos, rows, cu_q, cu_k, *ctx.cfg)
    return dq, dk, dv, dA, None, None, None, None, None, None, None, None, None, None


logo_branches_fwd.register_autograd(_backward, setup_context=_setup_context)


def logo_branches(q: Tensor, k: Tensor, v: Tensor, A: Tensor, cos: Tensor, sin: Tensor, q_pos: Tensor, rows: Tensor,
                  cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, window: int, keep_rotated: bool = False,
                  scale: Optional[float] = None, impl: str = "reference") -> tuple[Tensor, Tensor]:
    """Both branches of the LoGo layer from the pre-RoPE q, k, v (N, H, D) and the transforms A (3, H, D, D):
    o_local = SWA_window(RoPE(q), RoPE(k), v) over every row, and o_global = the query-sparse attention of
    RoPE(q A_0) at the selected rows (rows, cu_seqlens_q, q_pos: `logo.kernels.reference`'s contract) over
    RoPE(k A_1), v A_2; zero at unselected rows. cos/sin (T, D/2) as in `ops.rope_transform`. The same values as
    `ops.rope_transform` followed by `ops.sliding_window_attention` and `ops.query_sparse_attention`;
    differentiable in q, k, v and A."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    ops.check_rope_transform_inputs(q, k, v, A, cos, sin, impl != "reference")
    scale = ops._prepare(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale, impl)
    o_local, o_global = logo_branches_fwd(q, k, v, A, cos, sin, ops._i32(q_pos), ops._i32(rows),
                                          ops._i32(cu_seqlens_q), ops._i32(cu_seqlens_k), scale, int(window),
                                          bool(keep_rotated), impl)[:2]
    return o_local, o_global
