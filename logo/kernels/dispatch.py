"""The one place the model calls attention ops through: the custom ops of `logo.kernels.ops`, running one of the
attention implementations inside (`ops.IMPLS`).

backend (attention.backend):
- "auto": on a Hopper GPU with FlashAttention-4 installed, "flash" for bf16/fp16 inputs with head dim 64 or 128
  (`logo.kernels.flash.usable`); else "triton" on CUDA (when `logo.kernels.triton` imports); else "reference";
- "flash", "triton", "reference": that implementation (a one-line error where it cannot run).
The RoPE + transform and ContextNorm kernels (`fuses_rope_transform`, `fuses_context_norm`) are Triton under both
"flash" and "triton". The choice is made from the device, dtype, head dim and the packages present, all fixed
while a graph is compiled, so `torch.compile(fullgraph=True)` sees only the custom ops. `describe` states it in
one line for the start-up report.

Modules call the attention ops through an `AttentionOps` object they own (`attention_ops`): the plain one runs
the functions below; a parallelism plan installs its own subclass on the modules (context parallelism,
`logo/parallel/cp.py`, adds its communication around the same kernels). `AttentionOps.logo_branches` is the LoGo
layer's two branches as one op pair (`logo.kernels.branches`), used where `fuses_branches` says the fused RoPE +
transform kernel applies; everywhere else (the reference backend, the non-LP transforms, head dims the kernels do
not take, tensor-parallel DTensor transforms, context parallelism) the layer composes the separate ops itself.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from logo.kernels import branches, flash, ops

try:  # Triton missing or broken: the reference still works
    from logo.kernels import triton as _triton_ops  # noqa: F401
    _TRITON = True
except Exception:  # noqa: BLE001
    _TRITON = False

BACKENDS = ("auto", "reference", "triton", "flash")


def attention_impl(q: torch.Tensor, backend: str) -> str:
    """The implementation (`ops.IMPLS`) the attention ops run for inputs like q (N, H, D) under `backend`."""
    return _impl_for(backend, q.device, q.dtype, q.shape[-1])


@torch.compiler.assume_constant_result  # decided once per (backend, device, dtype, head dim): a constant in graphs
def _impl_for(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    if backend == "reference":
        return "reference"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend == "flash":
        describe("flash", device, dtype, head_dim)  # one-line ValueError where it cannot run
        return "flash"
    if backend == "triton" and not _TRITON:
        raise RuntimeError("attention.backend='triton' but logo.kernels.triton could not be imported")
    if backend == "auto" and device.type == "cuda" and flash.usable(device, dtype, head_dim):
        return "flash"
    return "triton" if _TRITON and (device.type == "cuda" or backend == "triton") else "reference"


def _use_triton(q, backend: str) -> bool:
    """Whether the GPU kernels run (Triton's RoPE + transform and ContextNorm kernels with either GPU attention)."""
    return attention_impl(q, backend) != "reference"


def describe(backend: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> str:
    """One line for the start-up report: the attention kernels a run with `backend` uses on `device` for attention
    inputs of `dtype` and `head_dim`, and why FlashAttention-4 is not used where it is not. ValueError (one line)
    for backend="flash" where it cannot run."""
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return "reference (PyTorch)"
    if backend in ("auto", "flash"):
        reason = flash.unavailable_reason(device)
        if not reason and (dtype not in flash.DTYPES or head_dim not in flash.HEAD_DIMS):
            reason = f"it is used for 16-bit inputs of head dim {flash.HEAD_DIMS}, not {dtype} of {head_dim}"
        if not reason:
            return f"flash (FlashAttention-4 {flash.version()}; RoPE and ContextNorm kernels: Triton)"
        if backend == "flash":
            raise ValueError(f"FlashAttention-4 cannot run here: {reason}")
        return f"triton (FlashAttention-4 not used: {reason})"
    return "triton"


def query_sparse_attention(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale: Optional[float] = None,
                           backend: str = "auto"):
    """Causal attention of the selected rows rows[:cu_seqlens_q[-1]] over dense keys/values: (N, H, D), zero at
    unselected rows. Static shapes, no host synchronisation (contract in `logo.kernels.reference`)."""
    return ops.query_sparse_attention(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale,
                                      impl=attention_impl(q, backend))


def sliding_window_attention(q, k, v, cu_seqlens, window: int, scale: Optional[float] = None,
                             backend: str = "auto"):
    """Causal sliding-window attention over packed sequences: (N, H, D)."""
    return ops.sliding_window_attention(q, k, v, cu_seqlens, window, scale, impl=attention_impl(q, backend))


def causal_attention(q, k, v, cu_seqlens, scale: Optional[float] = None, backend: str = "auto", seqlen: int = 0):
    """Dense causal attention inside each packed sequence: every row a query (N, H, D). seqlen > 0: the sequences are
    whole rows of seqlen tokens (a layout hint; context parallelism, which cuts rows, ignores it)."""
    return ops.causal_attention(q, k, v, cu_seqlens, scale, impl=attention_impl(q, backend), seqlen=seqlen)


def fuses_rope_transform(x, A, backend: str = "auto") -> bool:
    """Whether `rope_transform` runs the fused Triton kernel for x (N, H, D) and A: the Triton backend, a plain
    tensor A (a DTensor under tensor parallelism is not), and a head dim the kernel's dots take on a GPU
    (32..256; 16 under the CPU interpreter)."""
    return _use_triton(x, backend) and _plain(A) and _kernel_head_dim(x.shape[-1], 32 if x.is_cuda else 16)


def _plain(*tensors) -> bool:
    """Plain tensors (a parameter's DTensor under tensor parallelism is not: the fused kernels take only local
    memory)."""
    return all(type(t.data) is torch.Tensor for t in tensors)


def _kernel_head_dim(D: int, lowest: int = 16) -> bool:
    """A head dim the fused Triton kernels take: a power of two in lowest..256 (`_check_dims` raises for the rest;
    dispatch must not raise, so the callers fall back to their PyTorch path instead)."""
    return lowest <= D <= 256 and not D & (D - 1)


def rope_transform(q, k, v, A, cos, sin, backend: str = "auto"):
    """RoPE(q), RoPE(k), RoPE(q A_0), RoPE(k A_1), v A_2 in one pass (logo::rope_transform_fwd); see
    `fuses_rope_transform`."""
    return ops.rope_transform(q, k, v, A, cos, sin, use_triton=_use_triton(q, backend))


def decode_attention(q, k, v, lengths, active, scale: Optional[float] = None, backend: str = "auto"):
    """Decoding: one query per row over its cache, q (B, H, D), k/v (B, H, S, D), lengths (B,), active (B,) bool
    (inactive rows: zeros, no work): the Triton split-K kernel on CUDA (both GPU implementations), the reference
    elsewhere. Not differentiable; static shapes, no host synchronisation (a decode step replays as one CUDA
    graph)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    impl = "reference" if attention_impl(q, backend) == "reference" else "triton"
    return ops.decode_attention(q, k, v, lengths, active, scale, impl)


def fuses_context_norm(o, weights, backend: str = "auto") -> bool:
    """Whether `context_fuse` runs the fused Triton kernels for branch outputs o (N, H, D): the Triton backend,
    16/32-bit o, plain-tensor norm weights (DTensors under tensor parallelism are not) and a head dim that is a
    power of two in 16..256."""
    return (_use_triton(o, backend) and o.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _plain(*weights) and _kernel_head_dim(o.shape[-1]))


def context_fuse(o_local, o_global, p, z, w_local, w_global, eps: float, weighted: bool, backend: str = "auto"):
    """Both ContextNorms and the fusion in one pass (logo::context_fuse_fwd); see `fuses_context_norm`."""
    return ops.context_fuse(o_local, o_global, p, z, w_local, w_global, eps, weighted,
                            use_triton=_use_triton(o_local, backend))


class AttentionOps:
    """The attention ops one attention module calls (its `attention_ops`): the functions above, and the LoGo
    layer's two branches. A parallelism plan replaces a module's object with a subclass (`logo/parallel/cp.py`)
    or sets `block_recomputed` (activation checkpointing); the modules never look at which one they hold."""

    # The whole block is recomputed in the backward (activation checkpointing): its rerun forward lives only for
    # that block's backward, so the branch inputs are kept for it rather than recomputed a second time.
    block_recomputed: bool = False

    def query_sparse_attention(self, q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale: Optional[float] = None,
                               backend: str = "auto"):
        return query_sparse_attention(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale, backend)

    def sliding_window_attention(self, q, k, v, cu_seqlens, window: int, scale: Optional[float] = None,
                                 backend: str = "auto"):
        return sliding_window_attention(q, k, v, cu_seqlens, window, scale, backend)

    def causal_attention(self, q, k, v, cu_seqlens, scale: Optional[float] = None, backend: str = "auto",
                         seqlen: int = 0):
        return causal_attention(q, k, v, cu_seqlens, scale, backend, seqlen)

    def fuses_branches(self, q, A: Optional[torch.Tensor], backend: str) -> bool:
        """Whether `logo_branches` runs (the op pair): LP transforms A where the fused RoPE + transform runs."""
        return A is not None and fuses_rope_transform(q, A, backend)

    def fuses_rope_transform(self, q, A: torch.Tensor, backend: str) -> bool:
        """Whether the separate ops' branch inputs come from the fused RoPE + transform kernel (`rope_transform`)."""
        return fuses_rope_transform(q, A, backend)

    def recomputes_branch_inputs(self) -> bool:
        """Whether the backward recomputes the branch inputs (rotated local q, k; transformed, rotated global q, k,
        v) from q, k, v instead of keeping them: in a compiled training graph, unless the block is recomputed.
        The layer then runs its separate ops under `logo.kernels.recompute.recompute_all_but_attention`."""
        return torch.is_grad_enabled() and torch.compiler.is_compiling() and not self.block_recomputed

    def logo_branches(self, q, k, v, A, cos, sin, q_pos, rows, cu_seqlens_q, cu_seqlens_k, window: int,
                      backend: str = "auto"):
        """The LoGo layer's two branches as one op pair (`logo.kernels.branches.logo_branches`) from its pre-RoPE
        q, k, v (N, H, D) and LP transforms A (3, H, D, D): o_local = SWA_window(RoPE(q), RoPE(k), v) over every
        row, o_global = the query-sparse attention of RoPE(q A_0) at the selected rows (rows, cu_seqlens_q, q_pos:
        `logo.kernels.reference`'s contract) over RoPE(k A_1), v A_2, zero elsewhere; (N, H, D) each. The rotated
        inputs are kept for the backward unless `recomputes_branch_inputs`."""
        return branches.logo_branches(q, k, v, A, cos, sin, q_pos, rows, cu_seqlens_q, cu_seqlens_k, window,
                                      not self.recomputes_branch_inputs(), impl=attention_impl(q, backend))
