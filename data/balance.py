"""Which rows of a global batch each data-parallel rank takes, so that the ranks finish a step together.

With document masking a row's attention costs sum over its documents of L(L+1)/2 (causal, inside documents), not
T(T+1)/2: rows of one long document cost several times rows of many short ones. Every rank waits for the slowest
at the gradient reduction, so contiguous slices of the global batch lose the difference at every step
(`benchmarks/document_work.py` measures how much on a corpus). `assign_rows` instead deals the rows by that work:
heaviest first, each to the rank with the least work so far that still has room, every rank the same number of
rows. Only which rank computes a row changes: the global batch, its target count and the averaged gradient are
the same as with slices (up to the order of the floating-point sum), for any number of ranks, and the
assignment is a function of the global batch alone, so resuming reproduces it.
"""
from __future__ import annotations

import heapq
from typing import Optional

import numpy as np


def segment_work(offsets: np.ndarray) -> float:
    """Causal attention work (query-key pairs) inside the segments of one row whose boundaries are `offsets`
    (0, ..., n), ascending."""
    lengths = np.diff(offsets).astype(np.float64)
    return float((lengths * (lengths + 1) / 2).sum())


def row_work(ds, instance: int, T: int, valid: int) -> float:
    """The work of row `instance` of a token stream `ds` (`ShardDataset` or a synthetic stream: its
    `doc_boundaries`) with `valid` valid positions: its documents' causal attention; its padding costs nothing
    that differs between rows. A padding row (-1, or no valid position) costs 0."""
    if instance < 0 or valid <= 0:
        return 0.0
    inner = ds.doc_boundaries(int(instance) * T, int(valid))
    return segment_work(np.concatenate(([0], inner, [valid])))


def assign_rows(work: np.ndarray, world: int) -> np.ndarray:
    """(world, G / world) int64: the global batch's row indices each rank takes (ascending within a rank), every
    rank the same count. Rows are dealt heaviest first to the rank with the least `work` (G,) so far that has
    room, then the heaviest rank swaps rows with others while that lowers it; where contiguous slices would leave
    a lighter heaviest rank, the slices. Deterministic (ties go to the lower row index and rank). world == 1:
    every row in order."""
    G = work.shape[0]
    if G % world:
        raise ValueError(f"a global batch of {G} rows does not split over {world} ranks")
    slices = np.arange(G, dtype=np.int64).reshape(world, G // world)
    if world == 1:
        return slices
    work = np.asarray(work, dtype=np.float64)
    dealt = _swap_down(work, _deal(work, world))
    return dealt if work[dealt].sum(1).max() < work[slices].sum(1).max() else slices


def _deal(work: np.ndarray, world: int) -> np.ndarray:
    """Heaviest first to the least-loaded rank with room: (world, G / world) row indices."""
    per = work.shape[0] // world
    heap = [(0.0, r) for r in range(world)]  # (work so far, rank) of the ranks with room
    rows = [[] for _ in range(world)]
    for i in np.argsort(-work, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        rows[r].append(i)
        if len(rows[r]) < per:
            heapq.heappush(heap, (load + float(work[i]), r))
    return np.array(rows, dtype=np.int64)


def _swap_down(work: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Swap one row of the heaviest rank for a lighter row of another rank while the pair's heavier side ends
    below the heaviest rank's load; returns the rows sorted within each rank."""
    rows = rows.copy()
    for _ in range(rows.size):
        loads = work[rows].sum(1)  # (world,)
        h = int(loads.argmax())
        d = work[rows[h]][:, None, None] - work[rows][None, :, :]  # (per, world, per): what a swap moves
        after = np.maximum(loads[h] - d, loads[None, :, None] + d)  # the pair's heavier load after the swap
        after[:, h, :] = np.inf
        best = np.unravel_index(int(after.argmin()), after.shape)
        if not after[best] < loads[h] - 1e-9 * max(loads[h], 1.0):
            break
        i, o, j = (int(x) for x in best)
        rows[h, i], rows[o, j] = rows[o, j], rows[h, i]
    return np.sort(rows, axis=1)


def rank_rows(G: int, rank: int, world: int, work: Optional[np.ndarray] = None) -> np.ndarray:
    """Rank `rank`'s rows of a global batch of G rows (indices, ascending): its contiguous slice, or with the rows'
    `work` (G,) its share of `assign_rows`."""
    if work is None:
        per = G // world
        return np.arange(rank * per, (rank + 1) * per, dtype=np.int64)
    return assign_rows(work, world)[rank]
