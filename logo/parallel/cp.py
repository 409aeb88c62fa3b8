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
- global / full attention (query-sparse op, `_SplitKeyAttention`): each query's keys are those of its document up
  to itself, split in two ranges: the keys this rank holds (its pieces of the document, in order) and those the
  other ranks hold (every other piece before the query's, in sequence order). The local keys' attention runs while
  the other ranks' keys and values are all-gathered, the remote keys' attention after, and the two are merged by
  their log-sum-exps; in the backward the remote keys' gradients are reduce-scattered while the local keys'
  backward runs. Both collectives thus overlap attention work; queries with no remote key (the first piece of a
  document) skip the second range;
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

_c10d = torch.ops._c10d_functional

from data.loader import Batch
from logo.kernels import dispatch, ops
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
    scatter_index: torch.Tensor  # (B*T,) int64: row j of cat(all ranks' local rows) is global row scatter_index[j]
    row_doc: torch.Tensor  # (N_local,) int64 global document of each local row
    local_cu: torch.Tensor  # (S+1,) int32 offsets of each document's local rows (the local keys)
    local_pos: torch.Tensor  # (N_local,) int32 each local row's place among its document's local rows
    remote_index: torch.Tensor  # ((cp-1)*N_local,) int64 rows of cat(all ranks' local rows) held by the other
    #                             ranks, in sequence order (the remote keys, grouped by document)
    remote_cu: torch.Tensor  # (S+1,) int32 offsets of each document's remote keys
    remote_pos: torch.Tensor  # (N_local,) int32 remote keys before each local row in its document, minus 1 (>= 0)
    has_remote: torch.Tensor  # (N_local,) bool whether a local row has a remote key before it
    export_index: torch.Tensor  # (E,) int64 local rows that other ranks' halos need (padded with row 0)
    kv_index: torch.Tensor  # (N_ext,) int64 rows of cat(every rank's exports (cp*E), local rows), [halo, piece]s
    q_index: torch.Tensor  # (N_ext,) int64 rows of cat(one zero row, local rows) in the same order (halo rows: 0)
    keep_index: torch.Tensor  # (N_local,) int64 the local rows' places among the N_ext rows
    cu_halo: torch.Tensor  # (P+1,) int32 offsets of the [halo, piece] sequences
    # the inverses of the five gathers above (`gather_inverse`), for their backward
    remote_inverse: torch.Tensor
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
    split = _key_split(cu, owner, rank, rows[rank], gather.numpy())
    layout = CPLayout(cp, window, cu_g.to(torch.int32), doc, offset, positions_in_sequence(cu_local, n_local),
                      scatter, *split[:-1], *halo[:5], split[-1], *halo[5:])
    return local, idx % T, layout


def _key_split(cu: np.ndarray, owner: np.ndarray, rank: int, mine: np.ndarray, gather: np.ndarray):
    """(row_doc, local_cu, local_pos, remote_index, remote_cu, remote_pos, has_remote, remote_inverse) of `rank`
    (CPLayout): `mine` its global rows in local order, `gather` each global row's place in cat(all local rows)."""
    n_docs = len(cu) - 1

    def offsets(global_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # (documents, offsets per document)
        docs = np.searchsorted(cu, global_rows, side="right") - 1
        return docs, np.concatenate(([0], np.cumsum(np.bincount(docs, minlength=n_docs))))

    row_doc, local_cu = offsets(mine)
    remote = np.nonzero(owner != rank)[0]  # the other ranks' rows in sequence order: documents stay contiguous
    _, remote_cu = offsets(remote)
    before = np.searchsorted(remote, mine) - remote_cu[row_doc]  # remote keys of the document before each row
    remote_index = gather[remote]
    as_tensors = (torch.from_numpy(row_doc), torch.from_numpy(local_cu).to(torch.int32),
                  torch.from_numpy(np.arange(len(mine)) - local_cu[row_doc]).to(torch.int32),
                  torch.from_numpy(remote_index), torch.from_numpy(remote_cu).to(torch.int32),
                  torch.from_numpy(np.maximum(before - 1, 0)).to(torch.int32), torch.from_numpy(before > 0))
    return (*as_tensors, gather_inverse(remote_index, len(owner)))


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


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """Counts (S,) -> offsets (S+1,) int32."""
    return torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)


def _merge(o_local, lse_local, o_remote, lse_remote, live, remote_live, order, rows, base2: bool):
    """The attention over both key ranges from each range's output (N, H, D) (row order) and log-sum-exp (H, N)
    (slot order of `rows` for the local range, of rows[order] for the remote one): (o in q's dtype, lse (H, N) in
    slot order of `rows`). Slots outside `live` / `remote_live` are not read."""
    back = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    a = torch.where(live, lse_local, 0.0)
    b = torch.where(remote_live, lse_remote[:, back], float("-inf"))
    lse = torch.logaddexp2(a, b) if base2 else torch.logaddexp(a, b)
    exp = torch.exp2 if base2 else torch.exp
    slot_of_row = torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.shape[0], device=rows.device))
    w_local = exp(a - lse)[:, slot_of_row].t().unsqueeze(-1)  # (N, H, 1)
    w_remote = exp(b - lse)[:, slot_of_row].t().unsqueeze(-1)
    o = o_local.to(lse.dtype) * w_local + o_remote.to(lse.dtype) * w_remote
    return o.to(o_local.dtype), lse


class _SplitKeyAttention(torch.autograd.Function):
    """Query-sparse attention of this rank's rows q (N_local, H, D) over their documents' keys on every rank, split
    into the local keys k, v (N_local, H, D) and the other ranks' (all-gathered while the local keys' attention
    runs); the backward reduce-scatters the remote keys' gradients while the local keys' backward runs. meta: the
    slot orders, offsets and positions of both ranges (`ContextParallelOps.query_sparse_attention`).

    The collectives are the functional ops themselves, each waited for where its result is used: `funcol`'s
    wrappers wait at once while torch.compile traces, which would leave nothing to overlap."""

    @staticmethod
    def forward(ctx, q, k, v, meta, group, impl: str, scale: float):
        (rows, cu_q, rows_remote, cu_q_remote, order, live, remote_live, local_pos, local_cu, remote_pos, remote_cu,
         remote_index, remote_inverse) = meta
        H = k.shape[1]
        gathered = _c10d.all_gather_into_tensor(torch.cat((k, v), 1), group.size(), group.group_name)  # in flight
        o_local, lse_local = ops.range_attention_fwd(q, k, v, local_pos, rows, cu_q, local_cu, scale, 0, impl)
        kv_remote = _c10d.wait_tensor(gathered).index_select(0, remote_index)  # ((cp-1)*N_local, 2H, D)
        o_remote, lse_remote = ops.range_attention_fwd(q, kv_remote[:, :H], kv_remote[:, H:], remote_pos,
                                                       rows_remote, cu_q_remote, remote_cu, scale, 0, impl)
        o, lse = _merge(o_local, lse_local, o_remote, lse_remote, live, remote_live, order, rows.long(),
                        ops.lse_base2(impl))
        ctx.save_for_backward(q, k, v, kv_remote, o, lse, *meta)
        ctx.cfg = (group, impl, scale)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, kv_remote, o, lse, *meta = ctx.saved_tensors
        (rows, cu_q, rows_remote, cu_q_remote, order, _, _, local_pos, local_cu, remote_pos, remote_cu, _,
         remote_inverse) = meta
        group, impl, scale = ctx.cfg
        H = k.shape[1]
        dq_remote, dk_remote, dv_remote = ops.range_attention_bwd(
            do, q, kv_remote[:, :H], kv_remote[:, H:], o, lse[:, order], remote_pos, rows_remote, cu_q_remote,
            remote_cu, scale, 0, impl)
        dkv = torch.cat((dk_remote, dv_remote), 1)
        dkv = torch.cat((dkv, dkv.new_zeros(1, *dkv.shape[1:]))).index_select(0, remote_inverse[0])  # rank order
        reduced = _c10d.reduce_scatter_tensor(dkv, "sum", group.size(), group.group_name)  # (N_local, 2H, D)
        dq, dk, dv = ops.range_attention_bwd(do, q, k, v, o, lse, local_pos, rows, cu_q, local_cu, scale, 0, impl)
        reduced = _c10d.wait_tensor(reduced)
        return dq + dq_remote, dk + reduced[:, :H], dv + reduced[:, H:], None, None, None, None


class ContextParallelOps(dispatch.AttentionOps):
    """The attention ops of `logo.kernels.dispatch.AttentionOps` for a sharded micro-batch (see the module doc):
    `layout` is the current micro-batch's (None: the plain ops). The LoGo branches run as the separate ops (the
    base class's composition), each with its communication."""

    def __init__(self, group: dist.ProcessGroup, layout: Optional[CPLayout] = None):
        self.group, self.layout = group, layout

    def fuses_branches(self, q, A, backend: str) -> bool:
        return self.layout is None and super().fuses_branches(q, A, backend)

    def query_sparse_attention(self, q, k, v, q_pos, rows, cu_q, cu_k, scale: Optional[float] = None,
                               backend: str = "auto"):
        """Local rows (N_local, H, D) over every rank's keys/values of their documents. `rows` and `cu_q` come in
        local-piece terms (the selected rows first, counted per local piece), `q_pos` and `cu_k` too; the layout
        gives the positions and key ranges in the split's terms (`_SplitKeyAttention`)."""
        L = self.layout
        if L is None:
            return super().query_sparse_attention(q, k, v, q_pos, rows, cu_q, cu_k, scale, backend)
        impl = dispatch.attention_impl(q, backend)
        scale = ops._prepare(q, k, v, q_pos, rows, cu_q, cu_k, scale, impl)
        n_docs = L.cu_global.shape[0] - 1
        rows = rows.long()
        counts = (cu_q[1:] - cu_q[:-1]).long()  # (P,) selected rows of each local piece
        per_doc = torch.zeros(n_docs, dtype=torch.int64, device=q.device).index_add_(0, L.piece_doc, counts)
        # The queries with remote keys, in the same order: a stable partition of the slots (static shapes).
        live = torch.arange(rows.shape[0], device=q.device) < cu_q[-1]  # (N,) selected slots
        remote_live = live & L.has_remote[rows]
        order = torch.sort((~remote_live).to(torch.uint8), stable=True).indices  # remote slot i: slot order[i]
        per_doc_remote = torch.zeros_like(per_doc).index_add_(0, L.row_doc[rows], remote_live.long())
        meta = (rows.to(torch.int32), _offsets(per_doc), rows[order].to(torch.int32), _offsets(per_doc_remote), order,
                live, remote_live, L.local_pos, L.local_cu, L.remote_pos, L.remote_cu, L.remote_index,
                L.remote_inverse)
        return _SplitKeyAttention.apply(q, k, v, meta, self.group, impl, scale)

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
