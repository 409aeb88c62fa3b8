"""The LoGo layer's routing mechanics: the decisions z (`logo.model.logo_attention.route`, paper Eq. 7) as a
partition of the rows, selected first (the query-sparse global branch's input, Eq. 8), and the routing statistics.

Static shapes, no host synchronisation: the partition is a permutation of all N rows and the selected count
lives in device memory (the last entry of cu_seqlens_q), which the attention kernels read themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from logo.config import AttentionConfig
from logo.model.controller import gate_histogram
from logo.model.layers import PackedSeqs


@dataclass
class Selection:
    """The rows routed to the global branch, as a partition of all N packed rows.

    rows (N,) int32: a permutation of the rows, the selected ones first in packed (sequence, then position)
    order, then the unselected ones; cu_seqlens_q (S+1,) int32: offsets of each sequence's selected rows among
    them (cu_seqlens_q[-1] = number selected, on the device).
    """

    rows: torch.Tensor
    cu_seqlens_q: torch.Tensor


def partition(z: torch.Tensor, seqs: PackedSeqs) -> Selection:
    """Stable partition of the rows by z (selected first) by two prefix sums and one scatter: O(N), on device."""
    n = z.shape[0]
    idx = torch.arange(n, device=z.device, dtype=torch.int32)
    csum = torch.cumsum(z, 0, dtype=torch.int32)  # (N,) selected rows up to and including each row
    n_sel = csum[-1:]  # (1,)
    dest = torch.where(z, csum - 1, n_sel + idx - csum)  # selected: their rank; others: after all selected
    rows = torch.empty_like(idx).scatter_(0, dest.long(), idx)
    cu_q = torch.nn.functional.pad(csum, (1, 0))[seqs.cu_seqlens.long()]  # (S+1,) selected before each start
    return Selection(rows=rows, cu_seqlens_q=cu_q)


def routing_stats(z: torch.Tensor, p: torch.Tensor, valid: torch.Tensor, threshold: torch.Tensor,
                  cfg: AttentionConfig) -> torch.Tensor:
    """(K,) fp32 over valid tokens, summed over micro-batches and ranks: [selected, valid, sum p, sum p^2,
    gates within gamma of b], then for budget_control=quantile a gate-logit histogram (logo.model.controller)."""
    vf = valid.float()
    pd = p.detach().float()
    pv = pd * vf
    near = ((pd - threshold.detach()).abs() <= cfg.gamma).float() * vf
    stats = torch.stack((z.float().sum(), vf.sum(), pv.sum(), (pv * pd).sum(), near.sum()))
    if cfg.budget_control != "quantile":
        return stats
    return torch.cat((stats, gate_histogram(pd, vf, cfg.quantile_bins)))


def soft_ratio(p: torch.Tensor, threshold: torch.Tensor, valid: torch.Tensor, temperature: float) -> torch.Tensor:
    """Differentiable surrogate of the realized ratio F: mean over valid tokens of sigmoid((p - b) / tau)."""
    vf = valid.float()
    return (torch.sigmoid((p - threshold) / temperature) * vf).sum() / vf.sum().clamp_min(1.0)
