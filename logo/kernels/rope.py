"""Rotary position embeddings in PyTorch: the model's RoPE, and the one the attention ops compose with when no
fused kernel applies (so both round the same way)."""
from __future__ import annotations

from typing import Optional

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64, so float64 reference checks stay exact)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Optional[int] = None) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by position-dependent angles (T, D/2): x (B, T, H, D), or x (B*T, H, D)
    flattened rows when `batch` = B is given."""
    if batch is not None:
        return apply_rope(x.unflatten(0, (batch, -1)), cos, sin).flatten(0, 1)
    return _rotate(x, cos[None, :, None, :], sin[None, :, None, :])


def apply_rope_rows(x: torch.Tensor, cos_rows: torch.Tensor, sin_rows: torch.Tensor) -> torch.Tensor:
    """RoPE for gathered rows: x (n, H, D), each row's own angles cos_rows/sin_rows (n, D/2)."""
    return _rotate(x, cos_rows[:, None, :], sin_rows[:, None, :])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (x0, x1) rotated: (x0 c - x1 s, x0 s + x1 c), in at least fp32. Compiled: the real formula,
    which inductor fuses into one kernel (it has no code generation for complex ops). Eager: the same products
    as one complex multiply (x0 + i x1)(c + i s), 3 kernels instead of 9, 6 of them strided (eager LoGo runs 4
    RoPEs per layer). They agree within rounding (the complex kernel may fuse multiply-adds)."""
    xf = upcast(x).unflatten(-1, (-1, 2))  # (..., D/2, 2)
    c, s = cos.to(xf.dtype), sin.to(xf.dtype)
    if torch.compiler.is_compiling():
        x0, x1 = xf[..., 0], xf[..., 1]
        out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    else:
        out = torch.view_as_real(torch.view_as_complex(xf.contiguous()) * torch.complex(c, s))
    return out.flatten(-2).to(x.dtype)
