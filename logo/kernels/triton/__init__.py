"""Triton GPU kernels for LoGo attention: `attn_forward` / `attn_backward`, the same op pair (and static-shape
contract) as `logo.kernels.reference`. The differentiable ops are the custom ops in `logo.kernels.ops`, which
call these on CUDA. See `_attn.py` for the design.
"""
from logo.kernels.triton._attn import attn_backward, attn_forward, validate

__all__ = ["attn_forward", "attn_backward", "validate"]
