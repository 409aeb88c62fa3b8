"""Token routing for LoGo: gate -> hard decision -> compacted global queries (paper Eq. 7-8)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from logo.config import AttentionConfig
from logo.model.controller import gate_histogram
from logo.model.layers import PackedSeqs


@dataclass
class Selection:
    """The rows routed to the global branch, compacted in packed (sequence) order.

    index (Nq,) int64 rows of the flattened batch; q_pos (Nq,) int32 their positions inside their sequences;
    cu_seqlens_q (S+1,) int32 offsets of each sequence's selected rows.
    """

    index: torch.Tensor
    q_pos: torch.Tensor
    cu_seqlens_q: torch.Tensor


def route(p: torch.Tensor, threshold: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
    """z_t = [p_t > b] for valid tokens. p (N,) fp32, threshold (1,) fp32 -> (N,) bool."""
    return (p > threshold) & seqs.valid


def compact(z: torch.Tensor, seqs: PackedSeqs) -> Selection:
    """Gather the selected rows (ascending, hence sorted by sequence then position) and their offsets."""
    index = torch.nonzero(z).squeeze(1)  # (Nq,)
    counts = torch.bincount(seqs.seq_id[index], minlength=seqs.num_seqs)  # (S,)
    cu_q = torch.zeros(seqs.num_seqs + 1, dtype=torch.int32, device=z.device)
    cu_q[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return Selection(index=index, q_pos=seqs.pos[index], cu_seqlens_q=cu_q)


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
