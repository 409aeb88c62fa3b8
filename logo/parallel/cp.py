"""Context parallelism: the tokens of a micro-batch split over the cp ranks, attention ops wrapped with their
communication.

Sharding (`shard_batch`): every document of the micro-batch (the packed rows' documents, cut at the row edges) is
cut into 2*cp pieces of (nearly) equal length; rank r keeps pieces r and 2cp-1-r (a head and a tail piece), so
causal attention inside every document costs the same on every rank whatever the documents' lengths. (A split of
each row into 2cp chunks balances one document per row only: `benchmarks/document_work.py --cp` measures both on a
corpus.) Pieces one token longer than
others are dealt out so that every rank keeps exactly B*T/cp tokens. The model sees a (1, B*T/cp) batch of
pieces (each piece a "sequence" of the local metadata), with each token's true rotary position (`positions`).

Attention (`apply_cp` installs one `ContextParallelOps` on every attention module of the model; `context_parallel`
sets the micro-batch's layout on it for the forward and backward; without a layout, e.g. in evaluation, the ops
run on the local rows like the plain ones):
- global / full attention: the keys and values of every rank are all-gathered (autograd: their gradients are
  reduce-scattered back) and put in sequence order; the local queries attend them at their true positions
  in their true documents (query-sparse op), so document masking holds across pieces;
- sliding window: each piece needs the `window - 1` keys/values before it in its document (its halo), held by
  other pieces, of this or another rank: every rank all-gathers the rows that other ranks' halos need, and each
  piece attends [halo, piece] as one packed sequence.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch.nn as nn
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from data.loader import Batch
from logo.kernels import dispatch
from logo.kernels.reference import positions_in_sequence
from logo.config import ConfigError


def split_documents(cu: np.ndarray, cp: int) -> list[np.ndarray]:
    """Document offsets cu (S+1,) over the flattened micro-batch -> per rank, its pieces as an (P_r, 3) int64
    array of (start, length, document), in document order (piece r before piece 2cp-1-r), empty pieces left out.

    A document of length L becomes 2cp pieces of L // 2cp tokens; its L % 2cp extra tokens go one per piece to
    the ranks that have received the fewest extras so far (at most two per rank: its two pieces). The ranks'
    extra counts then never differ by more than one, and with T divisible by 2cp every row's extras are a
    multiple of cp, so every rank keeps the same number of tokens of every row."""
    n = 2 * cp
    got = np.zeros(cp, dtype=np.int64)  # extra tokens dealt to each rank so far
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        base, rem = divmod(e - s, n)
        extra = [0] * n
        taken = [0] * cp
        for _ in range(rem):
            r = min((r for r in range(cp) if taken[r] < 2), key=lambda r: (got[r], r))
            extra[r if taken[r] == 0 else n - 1 - r] = 1
            taken[r] += 1
            got[r] += 1
        start = s
        for k in range(n):
            length = base + extra[k]
            if length:
                out[k if k < cp else n - 1 - k].append((start, length, d))
            start += length
    # appended in document order, and inside a document piece r before piece 2cp-1-r: already sorted by start
    return [np.array(p, dtype=np.int64).reshape(-1, 3) for p in out]


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(start, start + length) over the spans."""
    if lengths.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return offsets + np.arange(lengths.sum())


def gather_inverse(index: np.ndarray, n_src: int, used: Optional[np.ndarray] = None) -> torch.Tensor:
    """The backward map of the row gather out = src[index]: (m, n_src) int64 whose row j holds, for every source
    row, the output row of its j-th use (len(index), a zero row, where it has fewer than j+1; m = the most uses of
    one row). `used` (len(index),) bool: outputs whose gradient is known to be zero, left out when False."""
    out = np.arange(len(index)) if used is None else np.nonzero(used)[0]
    src = index[out]
    order = np.argsort(src, kind="stable")
    src, out = src[order], out[order]
    j = np.arange(len(src)) - np.searchsorted(src, src, side="left")  # the use's number among its row's uses
    inverse = np.full((int(j.max()) + 1 if len(src) else 1, n_src), len(index), dtype=np.int64)
    inverse[j, src] = out
    return torch.from_numpy(inverse)


@dataclass
class CPLayout:
    """Host-built metadata of one sharded micro-batch (every tensor on the device at `to`)."""

    cp: int
    window: int
    cu_global: torch.Tensor  # (S+1,) int32 documents over the full B*T rows
    piece_doc: torch.Tensor  # (P,) int64 global document of each local piece
    piece_offset: torch.Tensor  # (P,) int32 position of the piece's first token inside its document
    piece_pos: torch.Tensor  # (N_local,) int32 position of each local row inside its piece
    gather_index: torch.Tensor  # (B*T,) int64: global row g = cat(all ranks' local rows)[gather_index[g]]
    scatter_index: torch.Tensor  # (B*T,) int64: its inverse: row j of that concatenation is global row scatter_index[j]
    export_index: torch.Tensor  # (E,) int64 local rows that other ranks' halos need (padded with row 0)
    kv_index: torch.Tensor  # (N_ext,) int64 rows of cat(every rank's exports (cp*E), local rows), [halo, piece]s
    q_index: torch.Tensor  # (N_ext,) int64 rows of cat(one zero row, local rows) in the same order (halo rows: 0)
    keep_index: torch.Tensor  # (N_local,) int64 the local rows' places among the N_ext rows
    cu_halo: torch.Tensor  # (P+1,) int32 offsets of the [halo, piece] sequences
    # the inverses of the four gathers above (`gather_inverse`), for their backward
    export_inverse: torch.Tensor
    kv_inverse: torch.Tensor
    q_inverse: torch.Tensor
    keep_inverse: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor field, in declaration order."""
        return tuple(getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor))

    def to(self, device) -> CPLayout:
        """On `device`; to a GPU through page-locked host memory, so the copies do not make the host wait."""
        pin = torch.device(device).type == "cuda"
        return CPLayout(self.cp, self.window,
                        *((t.pin_memory() if pin else t).to(device, non_blocking=True) for t in self.tensors()))


def shard_batch(mb: Batch, cp: int, rank: int, window: int) -> tuple[Batch, torch.Tensor, CPLayout]:
    """This rank's share of a (B, T) micro-batch (on the host) -> (local batch (1, B*T/cp), the local tokens'
    rotary positions (B*T/cp,), layout). `window`: the sliding window of the model's local attention (1 when it
    has none)."""
    B, T = mb.inputs.shape
    cu_g = (mb.cu_seqlens.long() if mb.cu_seqlens is not None else torch.arange(0, B * T + 1, T)).cpu()
    cu = cu_g.numpy()
    pieces = split_documents(cu, cp)
    rows = [_spans(p[:, 0], p[:, 1]) for p in pieces]  # (N_local,) global rows of each rank, in local order
    n_local = B * T // cp
    if any(len(r) != n_local for r in rows):
        raise ValueError(f"context-parallel split gave {[len(r) for r in rows]} rows per rank, not {n_local}")
    mine, idx = pieces[rank], torch.from_numpy(rows[rank])
    cu_local = torch.from_numpy(np.concatenate(([0], np.cumsum(mine[:, 1])))).to(torch.int32)
    local = Batch(*(t.flatten()[idx].unsqueeze(0) for t in (mb.inputs, mb.labels)), cu_local,
                  mb.valid.flatten()[idx].unsqueeze(0))
    owner = np.empty(B * T, dtype=np.int64)  # the rank holding each global row, and its place there
    place = np.empty(B * T, dtype=np.int64)
    for s, r in enumerate(rows):
        owner[r], place[r] = s, np.arange(n_local)
    gather = torch.from_numpy(owner * n_local + place)
    scatter = torch.empty_like(gather)
    scatter[gather] = torch.arange(B * T)
    halo = _halo_indices(pieces, cu, owner, place, rank, max(window - 1, 0), n_local)
    doc = torch.from_numpy(mine[:, 2])
    offset = (torch.from_numpy(mine[:, 0]) - cu_g[doc]).to(torch.int32)
    layout = CPLayout(cp, window, cu_g.to(torch.int32), doc, offset, positions_in_sequence(cu_local, n_local), gather,
                      scatter, *halo)
    return local, idx % T, layout


def _halo_indices(pieces: list[np.ndarray], cu: np.ndarray, owner: np.ndarray, place: np.ndarray, rank: int,
                  halo: int, n_local: int) -> tuple[torch.Tensor, ...]:
    """(export_index, kv_index, q_index, keep_index, cu_halo and the four inverses) of `rank` (CPLayout): each
    piece's halo is the `halo` rows before it inside its document; rows of other ranks come through their exports,
    which hold, for every rank, the rows that any other rank's halos need (the same on every rank)."""
    def halo_rows(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # (rows, per-piece halo lengths)
        lengths = np.minimum(halo, p[:, 0] - cu[p[:, 2]])
        return _spans(p[:, 0] - lengths, lengths), lengths
    halos = [halo_rows(p) for p in pieces]
    needed = [r for r, _ in halos]
    exports = [np.unique(np.concatenate([np.zeros(0, np.int64)] + [n[owner[n] == s] for t, n in enumerate(needed)
                                                                   if t != s])) for s in range(len(pieces))]
    E = max(1, max(len(x) for x in exports))
    slot = np.zeros(owner.shape[0], dtype=np.int64)  # a row's place among its owner's exports
    for s, x in enumerate(exports):
        slot[x] = s * E + np.arange(len(x))
    mine = pieces[rank]
    rows, lengths = halos[rank]
    cp_e = len(pieces) * E
    halo_kv = np.where(owner[rows] == rank, cp_e + place[rows], slot[rows])
    cu_halo = np.concatenate(([0], np.cumsum(lengths + mine[:, 1])))  # offsets of the [halo, piece] sequences
    starts = cu_halo[:-1]
    piece_rows = np.arange(n_local)  # the pieces tile the local rows in order
    keep = _spans(starts + lengths, mine[:, 1])  # (N_local,) the piece rows' places in the extended order
    n_ext = int(cu_halo[-1])
    kv = np.empty(n_ext, dtype=np.int64)
    q = np.zeros(n_ext, dtype=np.int64)
    is_halo = np.ones(n_ext, dtype=bool)
    is_halo[keep] = False
    kv[is_halo], kv[keep] = halo_kv, cp_e + piece_rows
    q[keep] = 1 + piece_rows
    export = np.zeros(E, dtype=np.int64)
    export[:len(exports[rank])] = place[exports[rank]]
    keep_of_ext = np.full(n_ext, n_local, dtype=np.int64)  # keep's inverse: each extended row's local row
    keep_of_ext[keep] = piece_rows
    inverses = (gather_inverse(export, n_local, np.arange(E) < len(exports[rank])),  # padding: no one reads it
                gather_inverse(kv, cp_e + n_local), gather_inverse(q, 1 + n_local, ~is_halo),  # halo queries: zeros
                torch.from_numpy(keep_of_ext[None]))
    return (torch.from_numpy(export), torch.from_numpy(kv), torch.from_numpy(q), torch.from_numpy(keep),
            torch.from_numpy(cu_halo).to(torch.int32), *inverses)


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(n, ...) per rank -> (cp * n, ...) in rank order; backward: reduce-scatter of the gradient (gloo too).
    (`torch.distributed.nn.functional.all_gather`'s gloo backward fails on a subgroup.)"""
    return funcol.wait_tensor(funcol.all_gather_tensor_autograd(x.contiguous(), 0, group))


class _GatherRows(torch.autograd.Function):
    """x[index] (rows) whose backward sums each source row's uses with m gathers over the host-built inverse
    (`gather_inverse`): no atomic adds (autograd's own backward of indexing accumulates into zeros with them)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        padded = torch.cat((grad, grad.new_zeros(1, *grad.shape[1:])))  # row len(index): no use
        out = padded.index_select(0, inverse[0])
        for uses in inverse[1:]:
            out = out + padded.index_select(0, uses)
        return out, None, None


class ContextParallelOps(dispatch.AttentionOps):
    """The attention ops of `logo.kernels.dispatch.AttentionOps` for a sharded micro-batch (see the module doc):
    `layout` is the current micro-batch's (None: the plain ops). The LoGo branches run as the separate ops (the
    base class's composition), each with its communication."""

    def __init__(self, group: dist.ProcessGroup, layout: Optional[CPLayout] = None):
        self.group, self.layout = group, layout

    def fuses_branches(self, q, A, backend: str) -> bool:
        return self.layout is None and super().fuses_branches(q, A, backend)

    def recomputes_branch_inputs(self) -> bool:
        """Not while the ops communicate: the collectives would sit in a selective-recomputation region, where
        torch.compile's partitioner may rerun one in the backward of some graphs (with dynamic shapes) and not of
        others; ranks whose pieces differ in shape hold different graphs for one micro-batch, and a collective
        issued by one rank only hangs NCCL. Outside such regions the partitioner never reruns a collective (under
        full activation checkpointing every rank reruns them all)."""
        return self.layout is None and super().recomputes_branch_inputs()

    def _gather_all(self, x: torch.Tensor) -> torch.Tensor:
        """Local rows (N_local, H, D) -> every row of the micro-batch in sequence order (B*T, H, D)."""
        L = self.layout
        return _GatherRows.apply(_all_gather(x, self.group), L.gather_index, L.scatter_index[None])

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
        if L is None or window == 1:  # no halo: every piece attends only itself
            return super().sliding_window_attention(q, k, v, cu_seqlens, window, scale, backend)
        if window != L.window:
            raise ValueError(f"context parallel layout was built for window {L.window}, the op asks for {window}")
        H = k.shape[1]
        kv = torch.cat((k, v), dim=1)  # (N_local, 2H, D): one all-gather for both
        exported = _all_gather(_GatherRows.apply(kv, L.export_index, L.export_inverse), self.group)  # (cp*E, 2H, D)
        kv_ext = _GatherRows.apply(torch.cat((exported, kv)), L.kv_index, L.kv_inverse)  # (N_ext, 2H, D)
        q_ext = _GatherRows.apply(torch.cat((q.new_zeros(1, *q.shape[1:]), q)), L.q_index, L.q_inverse)  # halo: 0
        o = super().sliding_window_attention(q_ext, kv_ext[:, :H], kv_ext[:, H:], L.cu_halo, window, scale, backend)
        return _GatherRows.apply(o, L.keep_index, L.keep_inverse)  # the halo rows' outputs dropped


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


def check_cp(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ConfigError(f"invalid config parallel.cp={cp}: stage.seq_len={seq_len} is not divisible by 2*cp")
