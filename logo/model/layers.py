"""Small building blocks: RMSNorm, rotary embeddings, SwiGLU feed-forward, packed-sequence metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from logo.kernels.rope import upcast


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x cast once to the autocast dtype when autocast is on (else x itself). Autocast caches its casts of leaf
    tensors only: three projections of one activation would each cast it and keep their own low-precision copy
    for the backward; projecting the returned tensor keeps one."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and x.is_floating_point() and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32. `shape` is the weight's shape: (D,) for the residual
    stream, (H, D) for head-wise ContextNorm (each head normalized over its own D channels)."""

    def __init__(self, shape, eps: float = 1e-5):
        super().__init__()
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).to(x.dtype)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype=torch.float32,
                 positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, D/2) for positions 0..T-1, or for the given row positions (T,). Computed per call:
    cheap, and safe with meta-device init."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    pos = torch.arange(seq_len, device=device) if positions is None else positions.to(device)
    angles = torch.outer(pos.to(torch.float64), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        x = autocast_input(x)  # one low-precision copy kept for w1's and w3's gradients, not two
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float):
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=out_std)


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> None:
    """ValueError unless cu_seqlens (a CPU tensor) holds non-decreasing offsets over the flattened batch x seqlen
    rows that include every row boundary (documents never cross rows)."""
    rows = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32)
    cu = cu_seqlens.to(torch.int32)
    if cu.dim() != 1 or not bool(torch.isin(rows, cu).all()) or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be increasing offsets over the flattened {batch}x{seqlen} batch that "
                         f"include every row boundary (multiples of {seqlen}); got {cu.flatten().tolist()[:16]}")


@dataclass
class PackedSeqs:
    """Document layout of a (B, T) batch flattened to N = B*T rows. Built on the host side of the forward, before
    the compiled blocks (`build` reads offsets given on the CPU to check them).

    cu_seqlens (S+1,) int32 offsets; seq_id (N,) int64 sequence of each row; pos (N,) int32 position inside
    its sequence; valid (N,) bool (False for padding).
    """

    batch: int
    seqlen: int
    cu_seqlens: torch.Tensor
    seq_id: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    has_documents: bool  # True when some sequence is shorter than a row

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @staticmethod
    def build(batch: int, seqlen: int, device, cu_seqlens: Optional[torch.Tensor] = None,
              valid: Optional[torch.Tensor] = None) -> PackedSeqs:
        n = batch * seqlen
        rows = torch.arange(0, n + 1, seqlen, device=device, dtype=torch.int32)
        has_docs = cu_seqlens is not None and cu_seqlens.shape[0] != rows.shape[0]
        if cu_seqlens is not None and cu_seqlens.device.type == "cpu":
            # Offsets already on an accelerator are not read here: that would synchronise every forward with the
            # device. The trainer checks each micro-batch's offsets on the host before its copy (logo.train.step).
            check_cu_seqlens(cu_seqlens, batch, seqlen)
        cu = cu_seqlens.to(device=device, dtype=torch.int32) if has_docs else rows
        # The document count changes from batch to batch (a batch of whole-row documents has B): compiled graphs
        # take it as a symbol instead of recompiling on the second batch.
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        idx = torch.arange(n, device=device)
        seq_id = torch.searchsorted(cu[1:].long(), idx, right=True)
        pos = (idx - cu.long()[seq_id]).to(torch.int32)
        v = valid.reshape(n).to(device=device, dtype=torch.bool) if valid is not None else \
            torch.ones(n, dtype=torch.bool, device=device)
        return PackedSeqs(batch, seqlen, cu, seq_id, pos, v, has_docs)
