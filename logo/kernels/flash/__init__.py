"""LoGo's attention ops on FlashAttention-4 (`flash-attn-4`, CuTe DSL kernels for Hopper): `attn_forward` /
`attn_backward`, the same op pair and static-shape contract as `logo.kernels.reference` and `logo.kernels.triton`.

Used on Hopper GPUs (compute capability 9.x) for bf16/fp16 inputs with head dim 64 or 128 when the package is
installed (`pip install -e ".[gpu]"`); `logo.kernels.dispatch` falls back to the Triton kernels otherwise. Nothing
here imports the package until a GPU call needs it, so CPU installs never see it.

- query-sparse global branch: FlashAttention-4 with a per-slot key-interval mask and 128 x 128 tile lists
  (`blocks.py`: pure PyTorch, tested on the CPU against the brute-force masks);
- dense causal (full attention, the hybrids' global heads): FlashAttention-4 varlen causal;
- sliding window: FlashAttention-4 varlen with a left window.
"""
from __future__ import annotations

import functools
import importlib.metadata

import torch

HEAD_DIMS = (64, 128)  # head dims measured and tested with the FlashAttention-4 kernels here
DTYPES = (torch.bfloat16, torch.float16)
PACKAGE = "flash-attn-4"


@functools.cache
def _import_error() -> str:
    """'' when FlashAttention-4's CuTe kernels import, else why not (one line)."""
    try:
        from logo.kernels.flash import _fa4  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a missing or broken optional package is a reason, not a crash
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    return ""


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


@functools.cache
def version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.cache
def unavailable_reason(device: torch.device) -> str:
    """'' when the FlashAttention-4 kernels run on `device`, else a short reason (for the start-up report)."""
    if device.type != "cuda":
        return "not a CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _hopper(index):
        major, minor = torch.cuda.get_device_capability(index)
        return f"needs a Hopper GPU (compute capability 9.x), this one is {major}.{minor}"
    if not version():
        return f"{PACKAGE} is not installed (pip install -e '.[gpu]')"
    err = _import_error()
    return f"{PACKAGE} {version()} does not import ({err})" if err else ""


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the FlashAttention-4 kernels take attention inputs of this dtype and head dim on `device`: a Hopper
    GPU with the package, bf16/fp16, a tested head dim."""
    return dtype in DTYPES and head_dim in HEAD_DIMS and not unavailable_reason(device)


def validate(q, k, v):
    """What the kernels support beyond the op contract's shapes (one-line errors)."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ValueError(f"the FlashAttention-4 kernels take q, k, v of one 16-bit dtype (bfloat16/float16); got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"the FlashAttention-4 kernels are used for head dims {HEAD_DIMS}, got {q.shape[-1]}")
    if torch.compiler.is_compiling():  # traced code: the dispatch chose "flash" where it runs (`usable`)
        return
    reason = unavailable_reason(q.device)
    if reason:
        raise ValueError(f"the FlashAttention-4 kernels cannot run here: {reason}")


def attn_forward(q, k, v, q_pos, rows, cu_q, cu_k, scale: float, window: int, seqlen: int = 0):
    """o (N, H, D) (zero at unselected rows) and the log-sum-exp per slot (H, N) float32 (private to the
    backward). rows None: every row a query (window > 0: sliding window; 0: causal). seqlen > 0: every sequence
    is a whole row of seqlen tokens (a layout hint for dense causal attention)."""
    from logo.kernels.flash import _fa4
    return _fa4.attn_forward(q, k, v, q_pos, rows, cu_q, cu_k, scale, window, seqlen)


def attn_backward(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, scale: float, window: int, seqlen: int = 0):
    """dq (zero at unselected rows), dk, dv of `attn_forward`."""
    from logo.kernels.flash import _fa4
    return _fa4.attn_backward(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, scale, window, seqlen)


__all__ = ["attn_forward", "attn_backward", "validate", "usable", "unavailable_reason", "version"]
