"""LoGo's attention ops as PyTorch custom ops, so `torch.compile(fullgraph=True)` captures whole blocks.

One op pair serves every kind ("range attention": each query slot sees a contiguous key range of its sequence):

    logo::range_attention_fwd(q, k, v, q_pos?, rows?, cu_q, cu_k, scale, window, impl, seqlen) -> (o, lse)
    logo::range_attention_bwd(do, q, k, v, o, lse, q_pos?, rows?, cu_q, cu_k, scale, window, impl, seqlen)
        -> (dq, dk, dv)

and the LoGo layer's branch inputs (RoPE of the local q or k and of its per-head global transform, and the
global v, one pass):

    logo::rope_transform_fwd(q, k, v, A, cos, sin, use_triton)
        -> (RoPE(q), RoPE(k), RoPE(q A_0), RoPE(k A_1), v A_2)
    logo::rope_transform_bwd(gq, gk, gqy, gky, gvy, q, k, v, A, cos, sin, use_triton) -> (dq, dk, dv, dA)

and decoding's attention (one query per row over a static KV cache, no backward):

    logo::decode_attention(q, k, v, lengths, active, scale, impl) -> o

(`logo.kernels.branches` runs rope_transform and both attention ops of a LoGo layer as one op pair.)

rows None: every row a query (sliding window with window > 0, causal with window 0; seqlen > 0 says every sequence
is a whole row of seqlen tokens, a layout hint the "flash" implementation's dense causal kernel takes); else
query-sparse with
the static-shape contract of `logo.kernels.reference` (o (N, H, D), zero at unselected rows; the selected count
cu_q[-1] stays on the device). `impl` names the implementation run inside the op (IMPLS): "flash"
(FlashAttention-4 on Hopper, `logo.kernels.flash`), "triton" (`logo.kernels.triton`: CUDA, or the CPU
interpreter) or "reference" (pure PyTorch), so the op (and `opcheck`) also runs on CPU; `logo.kernels.dispatch`
chooses it. The log-sum-exp is private to each implementation's backward (its shape (H, N) float32 is the same
for all). Output shapes depend only on input shapes (`register_fake`); the backward is the second op
(`register_autograd`). q, k, v, o and dO may have any row and head strides as long as the head dim is contiguous
(the kernels take the strides: the global branch's transformed q, k, v come out of a per-head batched matmul as
(H, N, D) memory viewed as (N, H, D), and copying them cost two strided copies per layer); the small index
tensors and lse are made contiguous.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from logo.kernels import reference

IMPLS = ("reference", "triton", "flash")


def _impl(impl: str):
    """The module running the attention kernels for `impl` (each has attn_forward, attn_backward, validate)."""
    if impl == "flash":
        from logo.kernels import flash
        return flash
    if impl == "triton":
        from logo.kernels import triton as triton_ops
        return triton_ops
    if impl == "reference":
        return reference
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of {list(IMPLS)}")


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _rows(t: Tensor) -> Tensor:
    """t (N, H, D) with a contiguous last dim (any row and head strides): a copy only where D is strided."""
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("logo::range_attention_fwd", mutates_args=())
def range_attention_fwd(q: Tensor, k: Tensor, v: Tensor, q_pos: Optional[Tensor], rows: Optional[Tensor],
                        cu_q: Tensor, cu_k: Tensor, scale: float, window: int, impl: str,
                        seqlen: int = 0) -> tuple[Tensor, Tensor]:
    """o (N, H, D) and the log-sum-exp per query slot (H, N) (private to the backward)."""
    return attention_forward(q, k, v, q_pos, rows, cu_q, cu_k, scale, window, impl, seqlen)


def _layout(impl: str, seqlen: int) -> dict:
    """The layout hint for the implementations that take it."""
    return {"seqlen": seqlen} if impl == "flash" and seqlen else {}


def attention_forward(q, k, v, q_pos, rows, cu_q, cu_k, scale: float, window: int, impl: str, seqlen: int = 0):
    """`range_attention_fwd`'s body (also run inside `logo.kernels.branches`' op): `impl`'s kernels on q, k, v with
    any row and head strides."""
    return _impl(impl).attn_forward(_rows(q), _rows(k), _rows(v), _c(q_pos), _c(rows), cu_q.contiguous(),
                                    cu_k.contiguous(), scale, window, **_layout(impl, seqlen))


def fake_lse(q: Tensor) -> Tensor:
    """The (H, N) log-sum-exp an attention forward returns for q (N, H, D), as a fake output."""
    return q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


@range_attention_fwd.register_fake
def _(q, k, v, q_pos, rows, cu_q, cu_k, scale, window, impl, seqlen=0):
    return torch.empty_like(q, memory_format=torch.contiguous_format), fake_lse(q)


@torch.library.custom_op("logo::range_attention_bwd", mutates_args=())
def range_attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                        q_pos: Optional[Tensor], rows: Optional[Tensor], cu_q: Tensor, cu_k: Tensor, scale: float,
                        window: int, impl: str, seqlen: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """dq (zero at unselected rows), dk, dv."""
    return attention_backward(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, scale, window, impl, seqlen)


def attention_backward(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, scale: float, window: int, impl: str,
                       seqlen: int = 0):
    """`range_attention_bwd`'s body (also run inside `logo.kernels.branches`' op)."""
    return _impl(impl).attn_backward(_rows(do), _rows(q), _rows(k), _rows(v), _rows(o), lse.contiguous(),
                                     _c(q_pos), _c(rows), cu_q.contiguous(), cu_k.contiguous(), scale, window,
                                     **_layout(impl, seqlen))


@range_attention_bwd.register_fake
def _(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, scale, window, impl, seqlen=0):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, rows, cu_q, cu_k, scale, window, impl, seqlen = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, q_pos, rows, cu_q, cu_k)
    ctx.cfg = (scale, window, impl, seqlen)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, q_pos, rows, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = range_attention_bwd(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, *ctx.cfg)
    return dq, dk, dv, None, None, None, None, None, None, None, None


range_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _prepare(q, k, v, q_pos, rows, cu_q, cu_k, scale, impl: str):
    reference.check_inputs(q, k, v, q_pos, rows, cu_q, cu_k)
    if impl != "reference":
        _impl(impl).validate(q, k, v)
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _i32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(torch.int32)


def query_sparse_attention(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale: Optional[float] = None,
                           impl: str = "reference") -> Tensor:
    """Causal attention of the selected rows over dense keys/values: (N, H, D), zero at unselected rows (the
    contract is in `logo.kernels.reference`). No host synchronisation with the GPU implementations."""
    scale = _prepare(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale, impl)
    return range_attention_fwd(q, k, v, _i32(q_pos), _i32(rows), _i32(cu_seqlens_q), _i32(cu_seqlens_k), scale, 0,
                               impl)[0]


def sliding_window_attention(q, k, v, cu_seqlens, window: int, scale: Optional[float] = None,
                             impl: str = "reference") -> Tensor:
    """Causal sliding-window attention over packed sequences: (N, H, D)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return _every_row_a_query(q, k, v, cu_seqlens, int(window), scale, impl)


def causal_attention(q, k, v, cu_seqlens, scale: Optional[float] = None, impl: str = "reference",
                     seqlen: int = 0) -> Tensor:
    """Dense causal attention inside each packed sequence (every row a query): (N, H, D). seqlen > 0: the sequences
    are whole rows of seqlen tokens (cu_seqlens = 0, seqlen, 2 seqlen, ...), a layout hint."""
    if seqlen and q.shape[0] % seqlen:
        raise ValueError(f"seqlen={seqlen} does not divide the {q.shape[0]} packed rows")
    return _every_row_a_query(q, k, v, cu_seqlens, 0, scale, impl, seqlen)


def _every_row_a_query(q, k, v, cu_seqlens, window: int, scale, impl: str, seqlen: int = 0) -> Tensor:
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same rows when every row is a query, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    scale = _prepare(q, k, v, None, None, cu_seqlens, cu_seqlens, scale, impl)
    cu = _i32(cu_seqlens)
    return range_attention_fwd(q, k, v, None, None, cu, cu, scale, window, impl, int(seqlen))[0]


@torch.library.custom_op("logo::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, active: Tensor, scale: float,
                     impl: str) -> Tensor:
    """Decoding's attention (`logo.kernels.reference.decode_attention`): one query per row q (B, H, D) over its
    cache k, v (B, H, S, D), keys 0..lengths[b]-1, zeros for inactive rows. "triton": the split-K kernel
    (`logo.kernels.triton._decode`), else the reference. No backward (inference only)."""
    if impl == "reference":
        return reference.decode_attention(q, k, v, lengths, active, scale)
    from logo.kernels.triton import _decode
    return _decode.decode_attention(q, k, v, lengths, active, scale)


@decode_attention.register_fake
def _(q, k, v, lengths, active, scale, impl):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _rope_impl(use_triton: bool):
    if use_triton:
        from logo.kernels.triton import _rope
        return _rope
    return reference


@torch.library.custom_op("logo::rope_transform_fwd", mutates_args=())
def rope_transform_fwd(q: Tensor, k: Tensor, v: Tensor, A: Tensor, cos: Tensor, sin: Tensor,
                       use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """RoPE(q), RoPE(k), RoPE(q A_0), RoPE(k A_1), v A_2: contiguous (N, H, D) in q's dtype."""
    return rope_transform_forward(q, k, v, A, cos, sin, use_triton)


def rope_transform_forward(q, k, v, A, cos, sin, use_triton: bool):
    """`rope_transform_fwd`'s body (also run inside `logo.kernels.branches`' op)."""
    return _rope_impl(use_triton).rope_transform_forward(_rows(q), _rows(k), _rows(v), A.contiguous(),
                                                         cos.contiguous(), sin.contiguous())


@rope_transform_fwd.register_fake
def _(q, k, v, A, cos, sin, use_triton):
    return tuple(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(5))


@torch.library.custom_op("logo::rope_transform_bwd", mutates_args=())
def rope_transform_bwd(gq: Tensor, gk: Tensor, gqy: Tensor, gky: Tensor, gvy: Tensor, q: Tensor, k: Tensor,
                       v: Tensor, A: Tensor, cos: Tensor, sin: Tensor,
                       use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (N, H, D) in q's dtype, dA (3, H, D, D) in A's dtype."""
    return rope_transform_backward(gq, gk, gqy, gky, gvy, q, k, v, A, cos, sin, use_triton)


def rope_transform_backward(gq, gk, gqy, gky, gvy, q, k, v, A, cos, sin, use_triton: bool,
                            gv: Optional[Tensor] = None):
    """`rope_transform_bwd`'s body (also run inside `logo.kernels.branches`' op, which passes gv, v's gradient
    from elsewhere, to be added into dv)."""
    dq, dk, dv, dA = _rope_impl(use_triton).rope_transform_backward(
        _c(gq), _c(gk), _c(gqy), _c(gky), _c(gvy), _rows(q), _rows(k), _rows(v), _c(A), _c(cos), _c(sin), gv=_c(gv))
    return dq, dk, dv, dA.to(A.dtype)


@rope_transform_bwd.register_fake
def _(gq, gk, gqy, gky, gvy, q, k, v, A, cos, sin, use_triton):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, A))


def _rope_setup_context(ctx, inputs, output):
    q, k, v, A, cos, sin, use_triton = inputs
    ctx.save_for_backward(q, k, v, A, cos, sin)
    ctx.use_triton = use_triton


def _rope_backward(ctx, gq, gk, gqy, gky, gvy):
    q, k, v, A, cos, sin = ctx.saved_tensors
    grads = [torch.zeros_like(q) if g is None else g for g in (gq, gk, gqy, gky, gvy)]
    dq, dk, dv, dA = rope_transform_bwd(*grads, q, k, v, A, cos, sin, ctx.use_triton)
    return dq, dk, dv, dA, None, None, None


rope_transform_fwd.register_autograd(_rope_backward, setup_context=_rope_setup_context)


def rope_transform(q: Tensor, k: Tensor, v: Tensor, A: Tensor, cos: Tensor, sin: Tensor,
                   use_triton: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """RoPE(q), RoPE(k), RoPE(q A_0), RoPE(k A_1), v A_2 in one pass: q, k, v (N, H, D) of one dtype,
    A (3, H, D, D) (the q, k and v transforms), cos/sin (T, D/2) float32 with T dividing N (row n is at position
    n mod T: B rows of T tokens flattened). Differentiable in q, k, v and A."""
    check_rope_transform_inputs(q, k, v, A, cos, sin, use_triton)
    return rope_transform_fwd(q, k, v, A, cos, sin, use_triton)


def check_rope_transform_inputs(q: Tensor, k: Tensor, v: Tensor, A: Tensor, cos: Tensor, sin: Tensor,
                                use_triton: bool):
    """`rope_transform`'s contract, one-line errors naming the offending shapes."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape or A.shape != (3, q.shape[1], q.shape[2],
                                                                                q.shape[2]):
        raise ValueError(f"q, k and v must be (N, H, D) of one shape and A (3, H, D, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} and {tuple(A.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype; got {q.dtype}, {k.dtype} and {v.dtype}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] * 2 != q.shape[2] or q.shape[0] % cos.shape[0]:
        raise ValueError(f"cos and sin must be (T, D/2) = (T, {q.shape[2] // 2}) with T dividing the {q.shape[0]} "
                         f"rows; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if use_triton:
        _rope_impl(True).validate(q)


def _fuse_impl(use_triton: bool):
    if use_triton:
        from logo.kernels.triton import _fuse
        return _fuse
    return reference


@torch.library.custom_op("logo::context_fuse_fwd", mutates_args=())
def context_fuse_fwd(o_local: Tensor, o_global: Tensor, p: Tensor, z: Tensor, w_local: Tensor, w_global: Tensor,
                     eps: float, weighted: bool, use_triton: bool) -> Tensor:
    """Both ContextNorms and the fusion: o (N, H, D) contiguous in o_local's dtype."""
    return _fuse_impl(use_triton).context_fuse_forward(o_local.contiguous(), o_global.contiguous(), p.contiguous(),
                                                       z.contiguous(), w_local.contiguous(), w_global.contiguous(),
                                                       eps, weighted)


@context_fuse_fwd.register_fake
def _(o_local, o_global, p, z, w_local, w_global, eps, weighted, use_triton):
    return torch.empty_like(o_local, memory_format=torch.contiguous_format)


@torch.library.custom_op("logo::context_fuse_bwd", mutates_args=())
def context_fuse_bwd(grad: Tensor, o_local: Tensor, o_global: Tensor, p: Tensor, z: Tensor, w_local: Tensor,
                     w_global: Tensor, eps: float, weighted: bool,
                     use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients in o_local, o_global (their dtype), p (its dtype), w_local, w_global (their dtype)."""
    d_l, d_g, dp, dw_l, dw_g = _fuse_impl(use_triton).context_fuse_backward(
        grad.contiguous(), o_local.contiguous(), o_global.contiguous(), p.contiguous(), z.contiguous(),
        w_local.contiguous(), w_global.contiguous(), eps, weighted)
    return d_l, d_g, dp, dw_l.to(w_local.dtype), dw_g.to(w_global.dtype)


@context_fuse_bwd.register_fake
def _(grad, o_local, o_global, p, z, w_local, w_global, eps, weighted, use_triton):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (o_local, o_global, p, w_local, w_global))


def _fuse_setup_context(ctx, inputs, output):
    o_local, o_global, p, z, w_local, w_global, eps, weighted, use_triton = inputs
    ctx.save_for_backward(o_local, o_global, p, z, w_local, w_global)
    ctx.cfg = (eps, weighted, use_triton)


def _fuse_backward(ctx, grad):
    o_local, o_global, p, z, w_local, w_global = ctx.saved_tensors
    d_l, d_g, dp, dw_l, dw_g = context_fuse_bwd(grad, o_local, o_global, p, z, w_local, w_global, *ctx.cfg)
    return d_l, d_g, dp, None, dw_l, dw_g, None, None, None


context_fuse_fwd.register_autograd(_fuse_backward, setup_context=_fuse_setup_context)


def context_fuse(o_local: Tensor, o_global: Tensor, p: Tensor, z: Tensor, w_local: Tensor, w_global: Tensor,
                 eps: float, weighted: bool = True, use_triton: bool = False) -> Tensor:
    """Norm^L(O^L) at unselected rows, (1 - p) Norm^L(O^L) + p Norm^G(O^G) at selected ones (additive: without
    the 1 - p) in one pass: o_local, o_global (N, H, D), p (N,) float, z (N,) bool, w_* (H, D) the head-wise
    RMSNorm weights. Differentiable in o_local, o_global, p and both weights."""
    rows = o_local.shape[:1]
    if o_local.dim() != 3 or o_global.shape != o_local.shape or p.shape != rows or z.shape != rows:
        raise ValueError(f"o_local and o_global must be (N, H, D), p and z (N,); got {tuple(o_local.shape)}, "
                         f"{tuple(o_global.shape)}, {tuple(p.shape)} and {tuple(z.shape)}")
    N, H, D = o_local.shape
    if w_local.shape != (H, D) or w_global.shape != (H, D) or z.dtype != torch.bool:
        raise ValueError(f"the norm weights must be (H, D) = ({H}, {D}) and z bool; got {tuple(w_local.shape)}, "
                         f"{tuple(w_global.shape)} and {z.dtype}")
    if use_triton:
        _fuse_impl(True).validate(o_local)
    return context_fuse_fwd(o_local, o_global, p, z, w_local, w_global, float(eps), bool(weighted), use_triton)
