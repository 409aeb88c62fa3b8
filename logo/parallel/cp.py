"""Context parallelism: one sequence split over the cp ranks, attention ops wrapped with their communication.

Sharding (`shard_batch`): each row of T tokens is cut into 2*cp chunks of c = T / (2 cp); rank r keeps chunks r
and 2cp-1-r (a head and a tail chunk), so causal attention costs the same on every rank. The model sees a
(B, 2c) batch whose documents are cut at the chunk edges (so every piece is a "sequence" for its local
metadata), with each column's true rotary position (`positions`).

Attention (`apply_cp` installs one `ContextParallelOps` on every attention module of the model; `context_parallel`
sets the micro-batch's layout on it for the forward and backward; without a layout, e.g. in evaluation, the ops
run on the local rows like the plain ones):
- global / full attention: the keys and values of every rank are all-gathered (autograd: their gradients are
  reduce-scattered back) and put in sequence order; the local queries attend them at their true positions
  in their true documents (query-sparse op), so document masking holds across shard edges;
- sliding window: each chunk needs only the `window - 1` keys/values before it, the tail of the previous
  chunk (on a neighbouring rank): the chunk tails are all-gathered (2 x (window-1) rows per rank) and each
  chunk attends [halo, chunk] as one packed sequence, cut at the true document edges.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from data.loader import Batch
from logo.kernels import dispatch
from logo.kernels.reference import positions_in_sequence
from logo.config import ConfigError


def chunk_owner(j: int, cp: int) -> tuple[int, int]:
    """(rank, half) holding chunk j of 2*cp: rank r holds chunks r (half 0) and 2cp-1-r (half 1)."""
    return (j, 0) if j < cp else (2 * cp - 1 - j, 1)


def local_columns(T: int, cp: int, rank: int) -> torch.Tensor:
    """(T / cp,) int64: the columns (= rotary positions) of a row that rank keeps, in local order."""
    c = T // (2 * cp)
    ar = torch.arange(c)
    return torch.cat((rank * c + ar, (2 * cp - 1 - rank) * c + ar))


def _cut(bounds: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Sorted offsets of [lo, hi) cut at the given global offsets, relative to lo."""
    inner = bounds[(bounds > lo) & (bounds < hi)]
    return torch.cat((torch.tensor([lo]), inner, torch.tensor([hi]))) - lo


@dataclass
class CPLayout:
    """Host-built metadata of one sharded micro-batch (every tensor on the device at `to`)."""

    cp: int
    rows: int  # B
    chunk: int  # c
    window: int
    cu_global: torch.Tensor  # (S+1,) int32 documents over the full B*T rows
    piece_doc: torch.Tensor  # (P,) int64 global document of each local piece
    piece_offset: torch.Tensor  # (P,) int32 position of the piece's first token inside its document
    piece_pos: torch.Tensor  # (N_local,) int32 position of each local row inside its piece
    gather_index: torch.Tensor  # (B*T,) int64: global row g = cat(all ranks' local rows)[gather_index[g]]
    scatter_index: torch.Tensor  # (B*T,) int64: its inverse (row j of that concatenation is global row scatter_index[j])
    cu_halo: torch.Tensor  # (.,) int32 offsets over the (B, 2, window-1+c) [halo, chunk] rows

    def to(self, device) -> CPLayout:
        return CPLayout(self.cp, self.rows, self.chunk, self.window,
                        *(t.to(device, non_blocking=True) for t in (self.cu_global, self.piece_doc, self.piece_offset,
                                                                    self.piece_pos, self.gather_index,
                                                                    self.scatter_index, self.cu_halo)))


def shard_batch(mb: Batch, cp: int, rank: int, window: int) -> tuple[Batch, torch.Tensor, CPLayout]:
    """This rank's share of a (B, T) micro-batch (on the host) -> (local batch (B, T/cp), positions (T/cp,),
    layout). `window`: the sliding window of the model's local attention (1 when it has none)."""
    B, T = mb.inputs.shape
    c = T // (2 * cp)
    cols = local_columns(T, cp, rank)
    cu_g = (mb.cu_seqlens.long() if mb.cu_seqlens is not None else torch.arange(0, B * T + 1, T)).cpu()
    halo = max(window - 1, 0)
    pieces, halo_cuts, docs, offsets = [0], [0], [], []
    for m in range(B):
        for h, j in enumerate((rank, 2 * cp - 1 - rank)):
            lo = m * T + j * c
            cut = _cut(cu_g, lo, lo + c)
            base = (2 * m + h) * c
            pieces.extend((base + cut[1:]).tolist())
            starts = lo + cut[:-1]
            d = torch.searchsorted(cu_g[1:], starts, right=True)
            docs.append(d)
            offsets.append(starts - cu_g[d])
            hcut = _cut(cu_g, lo - halo, lo + c)
            if j == 0 and halo:  # no halo before a row's first chunk: the zero rows form their own piece
                hcut = torch.unique(torch.cat((hcut, torch.tensor([halo]))))
            halo_cuts.extend(((2 * m + h) * (halo + c) + hcut[1:]).tolist())
    cu_local = torch.tensor(pieces, dtype=torch.int32)
    local = Batch(mb.inputs[:, cols].contiguous(), mb.labels[:, cols].contiguous(), cu_local,
                  mb.valid[:, cols].contiguous())
    n_local = B * 2 * c
    gather = torch.empty(B * T, dtype=torch.int64)
    for s in range(cp):  # global row of each of rank s's local rows
        g = (torch.arange(B)[:, None] * T + local_columns(T, cp, s)[None, :]).flatten()
        gather[g] = s * n_local + torch.arange(n_local)
    scatter = torch.empty_like(gather)
    scatter[gather] = torch.arange(B * T)
    layout = CPLayout(cp, B, c, window, cu_g.to(torch.int32), torch.cat(docs), torch.cat(offsets).to(torch.int32),
                      positions_in_sequence(cu_local, n_local), gather, scatter,
                      torch.tensor(halo_cuts, dtype=torch.int32))
    return local, cols, layout


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(n, ...) per rank -> (cp * n, ...) in rank order; backward: reduce-scatter of the gradient (gloo too).
    (`torch.distributed.nn.functional.all_gather`'s gloo backward fails on a subgroup.)"""
    return funcol.wait_tensor(funcol.all_gather_tensor_autograd(x.contiguous(), 0, group))


class _PermuteRows(torch.autograd.Function):
    """x[index] for a permutation `index` of x's rows, whose backward gathers the gradient with the inverse
    permutation (autograd's own backward of indexing accumulates into zeros with atomic adds)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class ContextParallelOps(dispatch.AttentionOps):
    """The attention ops of `logo.kernels.dispatch.AttentionOps` for a sharded micro-batch (see the module doc):
    `layout` is the current micro-batch's (None: the plain ops). The LoGo branches run as the separate ops (the
    base class's composition), each with its communication."""

    def __init__(self, group: dist.ProcessGroup, layout: Optional[CPLayout] = None):
        self.group, self.layout = group, layout

    def fuses_branches(self, q, A, backend: str) -> bool:
        return self.layout is None and super().fuses_branches(q, A, backend)

    def _gather_all(self, x: torch.Tensor) -> torch.Tensor:
        """Local rows (N_local, H, D) -> every row of the micro-batch in sequence order (B*T, H, D)."""
        L = self.layout
        return _PermuteRows.apply(_all_gather(x, self.group), L.gather_index, L.scatter_index)

    def query_sparse_attention(self, q, k, v, q_pos, rows, cu_q, cu_k, scale: Optional[float] = None,
                               backend: str = "auto"):
        """Local rows (N_local, H, D) over every rank's keys/values. `q_pos`, `cu_q`, `cu_k` come in local-piece
        terms (cu_k: the local pieces' offsets); they are mapped to true positions and per-document offsets of
        the whole micro-batch. The selected slots stay in order: local pieces follow their documents' order."""
        L = self.layout
        if L is None:
            return super().query_sparse_attention(q, k, v, q_pos, rows, cu_q, cu_k, scale, backend)
        n = q.shape[0]
        piece = torch.searchsorted(cu_k[1:].long(), torch.arange(n, device=q.device), right=True)  # (N_local,)
        pos = (q_pos + L.piece_offset[piece]).to(torch.int32)  # true positions inside the true documents
        counts = (cu_q[1:] - cu_q[:-1]).long()  # (P,) selected rows of each local piece
        per_doc = torch.zeros(L.cu_global.shape[0] - 1, dtype=torch.int64, device=q.device)
        per_doc.index_add_(0, L.piece_doc, counts)
        cu_qg = torch.zeros_like(L.cu_global)
        cu_qg[1:] = torch.cumsum(per_doc, 0).to(torch.int32)
        kg, vg = self._gather_all(k), self._gather_all(v)
        # Local query rows (static shapes, `rows` selected first) over the gathered keys/values of every document
        # (global offsets). With no selected row here the op still takes kg/vg, so the gathers' backward runs.
        return super().query_sparse_attention(q, kg, vg, pos, rows, cu_qg, L.cu_global, scale, backend)

    def causal_attention(self, q, k, v, cu_seqlens, scale: Optional[float] = None, backend: str = "auto",
                         seqlen: int = 0):
        if self.layout is None:
            return super().causal_attention(q, k, v, cu_seqlens, scale, backend, seqlen)
        rows = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)  # every row a query, in order
        return self.query_sparse_attention(q, k, v, self.layout.piece_pos, rows, cu_seqlens, cu_seqlens, scale,
                                           backend)

    def sliding_window_attention(self, q, k, v, cu_seqlens, window: int, scale: Optional[float] = None,
                                 backend: str = "auto"):
        L = self.layout
        if L is None:
            return super().sliding_window_attention(q, k, v, cu_seqlens, window, scale, backend)
        if window != L.window:
            raise ValueError(f"context parallel layout was built for window {L.window}, the op asks for {window}")
        halo, c = window - 1, L.chunk
        if halo == 0:
            return super().sliding_window_attention(q, k, v, cu_seqlens, window, scale, backend)
        rank = dist.get_rank(self.group)
        ext = [self._with_halo(t, rank, gather=i > 0) for i, t in enumerate((q, k, v))]
        o = super().sliding_window_attention(*ext, L.cu_halo, window, scale, backend)
        return o.unflatten(0, (L.rows, 2, halo + c))[:, :, halo:].flatten(0, 2)

    def _with_halo(self, x: torch.Tensor, rank: int, gather: bool) -> torch.Tensor:
        """(B*2c, H, D) -> (B*2*(halo+c), H, D): each local chunk preceded by the previous chunk's last rows
        (zeros for queries, `gather=False`: the halo rows' outputs are dropped)."""
        L = self.layout
        halo, c, cp = L.window - 1, L.chunk, L.cp
        xs = x.unflatten(0, (L.rows, 2, c))  # (B, 2, c, H, D)
        tails = None  # (cp, B, 2, halo, H, D): every rank's chunk tails
        if gather:
            tails = _all_gather(xs[:, :, c - halo:], self.group).unflatten(0, (cp, L.rows))
        parts = []
        for h, j in enumerate((rank, 2 * cp - 1 - rank)):
            if j == 0 or tails is None:
                prev = xs.new_zeros(L.rows, halo, *x.shape[1:])
            else:
                s, hh = chunk_owner(j - 1, cp)
                prev = tails[s][:, hh]
            parts.append(torch.cat((prev, xs[:, h]), dim=1))  # (B, halo+c, H, D)
        return torch.stack(parts, dim=1).flatten(0, 2)


def apply_cp(model: nn.Module, group: dist.ProcessGroup) -> ContextParallelOps:
    """In place: every attention module of the model calls one `ContextParallelOps` over `group` (returned)."""
    cp_ops = ContextParallelOps(group)
    for module in model.modules():
        if isinstance(getattr(module, "attention_ops", None), dispatch.AttentionOps):
            module.attention_ops = cp_ops
    return cp_ops


def _cp_ops(model: nn.Module) -> ContextParallelOps:
    for module in model.modules():
        ops = getattr(module, "attention_ops", None)
        if isinstance(ops, ContextParallelOps):
            return ops
    raise ValueError("the model has no context-parallel attention ops: apply the plan first (`apply_cp`)")


@contextmanager
def context_parallel(model: nn.Module, layout: CPLayout):
    """Within the block (forward and backward of one micro-batch), the model's attention ops (`apply_cp`) run
    context-parallel over `layout`."""
    cp_ops = _cp_ops(model)
    before, cp_ops.layout = cp_ops.layout, layout
    try:
        yield
    finally:
        cp_ops.layout = before


def check_cp(seq_len: int, cp: int, window: int) -> None:
    if seq_len % (2 * cp):
        raise ConfigError(f"invalid config parallel.cp={cp}: stage.seq_len={seq_len} is not divisible by 2*cp")
    if cp > 1 and seq_len // (2 * cp) < window - 1:
        raise ConfigError(f"invalid config parallel.cp={cp}: chunks of {seq_len // (2 * cp)} tokens are shorter "
                          f"than the sliding window halo ({window - 1})")
