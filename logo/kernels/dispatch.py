"""The one place the model calls attention ops through: the custom ops of `logo.kernels.ops`, running the Triton
kernels or the pure-PyTorch reference inside.

backend: "auto" -> Triton when the tensors are on CUDA and `logo.kernels.triton` imports, else the reference;
"reference" -> always the reference; "triton" -> always Triton (error if unavailable; on CPU tensors it needs
TRITON_INTERPRET=1). The choice is made from the device and the module's import status, both fixed while a
graph is compiled, so `torch.compile(fullgraph=True)` sees only the custom ops.
"""
from __future__ import annotations

from typing import Optional

from logo.kernels import ops

try:  # Triton missing or broken: the reference still works
    from logo.kernels import triton as _triton_ops  # noqa: F401
    _TRITON = True
except Exception:  # noqa: BLE001
    _TRITON = False


def _use_triton(q, backend: str) -> bool:
    if backend == "reference":
        return False
    if backend not in ("auto", "triton"):
        raise ValueError(f"unknown attention backend {backend!r}; choose auto, reference or triton")
    if backend == "triton" and not _TRITON:
        raise RuntimeError("attention.backend='triton' but logo.kernels.triton could not be imported")
    return _TRITON and (q.is_cuda or backend == "triton")


def query_sparse_attention(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale: Optional[float] = None,
                           backend: str = "auto"):
    """Causal attention of the selected rows rows[:cu_seqlens_q[-1]] over dense keys/values: (N, H, D), zero at
    unselected rows. Static shapes, no host synchronisation (contract in `logo.kernels.reference`)."""
    return ops.query_sparse_attention(q, k, v, q_pos, rows, cu_seqlens_q, cu_seqlens_k, scale,
                                      use_triton=_use_triton(q, backend))


def sliding_window_attention(q, k, v, cu_seqlens, window: int, scale: Optional[float] = None,
                             backend: str = "auto"):
    """Causal sliding-window attention over packed sequences: (N, H, D)."""
    return ops.sliding_window_attention(q, k, v, cu_seqlens, window, scale, use_triton=_use_triton(q, backend))


def causal_attention(q, k, v, cu_seqlens, scale: Optional[float] = None, backend: str = "auto"):
    """Dense causal attention inside each packed sequence: every row a query (N, H, D)."""
    return ops.causal_attention(q, k, v, cu_seqlens, scale, use_triton=_use_triton(q, backend))
