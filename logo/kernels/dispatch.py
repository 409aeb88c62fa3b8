"""The one place the model calls attention ops through: picks the Triton kernels or the reference.

backend: "auto" -> Triton when the tensors are on CUDA and `logo.kernels.triton` imports, else the reference;
"reference" -> always the pure-PyTorch reference; "triton" -> always Triton (error if unavailable).

`override(ops)` routes the three public ops to `ops` (an object with the same three methods) inside a `with`
block: context parallelism (`logo/parallel/cp.py`) uses it to add its communication around the same kernels,
which it reaches through `local_ops` (never overridden).
"""
from __future__ import annotations

import contextlib
import functools
import types
from typing import Optional

import torch

from logo.kernels import reference


@functools.lru_cache(maxsize=1)
def _triton_ops():
    try:
        from logo.kernels import triton as triton_ops
        return triton_ops
    except Exception:  # noqa: BLE001 - Triton missing or broken: the reference still works
        return None


def _ops(q: torch.Tensor, backend: str):
    if backend == "reference":
        return reference
    if backend not in ("auto", "triton"):
        raise ValueError(f"unknown attention backend {backend!r}; choose auto, reference or triton")
    ops = _triton_ops()
    if ops is not None and hasattr(ops, "query_sparse_attention") and (q.is_cuda or backend == "triton"):
        return ops
    if backend == "triton":
        raise RuntimeError("attention.backend='triton' but logo.kernels.triton could not be imported")
    return reference


_override = None  # set by `override`


@contextlib.contextmanager
def override(ops):
    """Within the block, the public ops below call `ops.<same name>(...)` with the same arguments."""
    global _override
    before, _override = _override, ops
    try:
        yield
    finally:
        _override = before


def query_sparse_attention(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale: Optional[float] = None,
                           backend: str = "auto"):
    """Causal attention for packed selected query rows over dense keys/values: (Nq, H, D)."""
    if _override is not None:
        return _override.query_sparse_attention(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale, backend)
    return _query_sparse(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale, backend)


def sliding_window_attention(q, k, v, cu_seqlens, window: int, scale: Optional[float] = None,
                             backend: str = "auto"):
    """Causal sliding-window attention over packed sequences: (N, H, D)."""
    if _override is not None:
        return _override.sliding_window_attention(q, k, v, cu_seqlens, window, scale, backend)
    return _sliding_window(q, k, v, cu_seqlens, window, scale, backend)


def causal_attention(q, k, v, cu_seqlens, scale: Optional[float] = None, backend: str = "auto"):
    """Dense causal attention inside each packed sequence: every row is a query (N, H, D)."""
    if _override is not None:
        return _override.causal_attention(q, k, v, cu_seqlens, scale, backend)
    return _causal(q, k, v, cu_seqlens, scale, backend)


def _query_sparse(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale, backend):
    return _ops(q, backend).query_sparse_attention(q, k, v, q_pos, cu_seqlens_q, cu_seqlens_k, scale)


def _sliding_window(q, k, v, cu_seqlens, window, scale, backend):
    return _ops(q, backend).sliding_window_attention(q, k, v, cu_seqlens, window, scale)


def _causal(q, k, v, cu_seqlens, scale, backend):
    ops = _ops(q, backend)
    if ops is not reference:  # Triton: every row a query, dense-query kernels, no host sync
        return ops.causal_attention(q, k, v, cu_seqlens, scale)
    pos = reference.positions_in_sequence(cu_seqlens, q.shape[0])
    return reference.query_sparse_attention(q, k, v, pos, cu_seqlens, cu_seqlens, scale)


# The ops without any override (what an override calls after its own work).
local_ops = types.SimpleNamespace(query_sparse_attention=_query_sparse, sliding_window_attention=_sliding_window,
                                  causal_attention=_causal)
