"""Weighted data mixtures: every row of a global batch comes from one source, chosen by weight.

Sources are prepared corpora (`ShardDataset`: the embedded default corpus or shards at a path) and synthetic
streams (`data.synthetic.SyntheticStream`). Each source is a stream of rows of its own: a corpus's rows are its
windows in the shuffled order of `TokenLoader` (a global batch of one row, its epochs drawn from (seed, epoch)),
a synthetic source's row p is window p of its episode stream. Global batch b assigns its G rows to sources by
systematic sampling from `default_rng([seed, b, MIX_STREAM])`: G evenly spaced points with one random offset over
the cumulative weights (each source gets floor or ceil of G x share rows), in a random order; the k-th row of
source s in the batch is that source's row `rows_s(b) + k`, where rows_s(b) counts its rows before batch b. The
global batch is the same for any number of data-parallel ranks (rank r takes its contiguous slice, or with
`balance` the rows `data.balance.assign_rows` deals it by work, as in `TokenLoader`), and the state, (batches consumed, every source's rows consumed), resumes exactly.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from data.balance import rank_rows, row_work
from data.format import DataError
from data.loader import Batch, StepData, TokenLoader, concat_rows, rows_batch, valid_lengths

MIX_STREAM = 0x6D6978  # the seed word of the row-to-source assignment


@dataclass
class MixSource:
    """One source of a mixture: its rows come from `ds` (a ShardDataset or a SyntheticStream)."""

    name: str
    kind: str  # default | shards | synthetic
    weight: float
    ds: object
    seed: int = 0  # a corpus's shuffle seed
    info: dict = field(default_factory=dict)  # what plan.json records besides name, kind, weight, fingerprint
    _order: Optional[TokenLoader] = None

    def bind(self, seq_len: int) -> None:
        """Rows of seq_len tokens: a corpus's shuffled window order (one row per 'global batch')."""
        if self.kind != "synthetic":
            self._order = TokenLoader(self.ds, seq_len, 1, 1, seed=self.seed, document_mask=False)

    def instances(self, rows: np.ndarray) -> np.ndarray:
        """Window ids of the source's rows `rows` (its own count, from 0) -> (n,) int64."""
        if self._order is None:
            return rows.astype(np.int64)
        return np.array([self._order.global_batch_instances(int(r))[0] for r in rows], dtype=np.int64)

    def describe(self, share: float) -> dict:
        return {"name": self.name, "kind": self.kind, "weight": self.weight, "share": share,
                "fingerprint": self.ds.fingerprint, **self.info}


class MixLoader:
    """`TokenLoader`'s interface (step_data, next_step, batches_consumed, state_dict) over weighted sources."""

    def __init__(self, sources: list[MixSource], seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0, document_mask: bool = True,
                 balance: bool = False):
        if global_batch % (micro_batch * dp_world) != 0:
            raise DataError(f"global batch of {global_batch} sequences is not divisible by micro_batch={micro_batch}"
                            f" x dp_world={dp_world}")
        if not sources or any(not s.weight > 0 for s in sources):
            raise DataError(f"a mixture needs sources with positive weights, got "
                            f"{[(s.name, s.weight) for s in sources]}")
        self.sources, self.T, self.G, self.M = sources, seq_len, global_batch, micro_batch
        self.rank, self.world, self.seed, self.document_mask = dp_rank, dp_world, seed, document_mask
        self.balance = balance and document_mask and dp_world > 1
        for s in sources:
            s.bind(seq_len)
        w = np.array([s.weight for s in sources], dtype=np.float64)
        self.shares = w / w.sum()  # (S,)
        self._bounds = np.cumsum(self.shares)[:-1]  # (S-1,) where source s's share of [0, 1) ends
        self.batches_consumed = 0
        self._rows = {0: np.zeros(len(sources), np.int64)}  # b -> (S,) rows each source gave before batch b
        self._first = 0  # the earliest batch whose position is known (the resumed one)
        self._lock = threading.Lock()  # a prefetch thread and the main thread may both ask

    def batch_sources(self, b: int) -> np.ndarray:
        """(G,) int64: the source of each row of global batch b."""
        rng = np.random.default_rng([self.seed, int(b), MIX_STREAM])
        points = (np.arange(self.G) + rng.random()) / self.G  # (G,) evenly spaced in [0, 1)
        return np.searchsorted(self._bounds, points, side="right")[rng.permutation(self.G)]

    def rows_before(self, b: int) -> np.ndarray:
        """(S,) int64: rows each source gave to global batches before b."""
        with self._lock:
            if b < self._first:
                raise DataError(f"global batch {b} comes before this loader's resumed position {self._first}")
            known = max(k for k in self._rows if k <= b)
            rows = self._rows[known]
            for k in range(known, b):
                rows = rows + np.bincount(self.batch_sources(k), minlength=len(self.sources))
                self._rows[k + 1] = rows
            stale = [k for k in self._rows if k < min(self.batches_consumed, b)]  # never needed again
            for k in stale:
                del self._rows[k]
            return rows

    def _global_rows(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source (G,), the source's row number (G,)) of every row of global batch b."""
        src = self.batch_sources(b)
        start = self.rows_before(b)
        row = np.empty(self.G, np.int64)
        for s in range(len(self.sources)):
            mine = np.flatnonzero(src == s)
            row[mine] = start[s] + np.arange(mine.size)
        return src, row

    def step_data(self, b: int) -> StepData:
        """This rank's micro-batches of global batch b and its target count (every rank computes the same).
        Does not move the position: safe on a prefetch thread."""
        src, row = self._global_rows(b)
        inst, valid = np.empty(self.G, np.int64), np.empty(self.G, np.int64)
        for s, source in enumerate(self.sources):
            mine = np.flatnonzero(src == s)
            inst[mine] = source.instances(row[mine])
            valid[mine] = valid_lengths(source.ds, inst[mine], self.T)
        work = np.array([row_work(self.sources[s].ds, i, self.T, n) for s, i, n in zip(src, inst, valid)]) \
            if self.balance else None
        mine = rank_rows(self.G, self.rank, self.world, work)
        src, inst = src[mine], inst[mine]
        micro = [self._rows_of(src[j:j + self.M], inst[j:j + self.M]) for j in range(0, len(mine), self.M)]
        return StepData(micro, int(valid.sum()))

    def _rows_of(self, src: np.ndarray, inst: np.ndarray) -> Batch:
        """One micro-batch: row r is window inst[r] of source src[r]."""
        return concat_rows([rows_batch(self.sources[s].ds, np.array([i]), self.T, self.document_mask)
                            for s, i in zip(src.tolist(), inst.tolist())])

    def next_step(self) -> list[Batch]:
        data = self.step_data(self.batches_consumed)
        self.batches_consumed += 1
        return data.micro_batches

    def source_tokens(self, b: Optional[int] = None) -> dict[str, int]:
        """Tokens (rows x seq_len) each source gave to the global batches before b (default: those consumed)."""
        rows = self.rows_before(self.batches_consumed if b is None else b)
        return {s.name: int(n) * self.T for s, n in zip(self.sources, rows)}

    def describe(self) -> list[dict]:
        """The resolved sources, for plan.json."""
        return [s.describe(float(p)) for s, p in zip(self.sources, self.shares)]

    def state_dict(self) -> dict:
        rows = self.rows_before(self.batches_consumed)
        return {"kind": "mix", "batches_consumed": self.batches_consumed, "seed": self.seed, "seq_len": self.T,
                "global_batch": self.G,
                "sources": [{"name": s.name, "fingerprint": s.ds.fingerprint, "weight": s.weight, "rows": int(n)}
                            for s, n in zip(self.sources, rows)]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "mix" or not isinstance(state.get("sources"), list):
            raise DataError("data-loader state is of a single-corpus run, this run reads a mixture (data=mix); "
                            "resume with the same data settings, or start the stage fresh")
        for key, mine in (("seq_len", self.T), ("global_batch", self.G), ("seed", self.seed)):
            if state.get(key) != mine:
                raise DataError(f"data-loader state does not match this run: {key}={state.get(key)!r} in the "
                                f"checkpoint, {mine!r} now; resume with the same data and batch settings, or start "
                                f"the stage fresh")
        saved = [(s.get("name"), s.get("fingerprint"), s.get("weight")) for s in state["sources"]]
        now = [(s.name, s.ds.fingerprint, s.weight) for s in self.sources]
        if saved != now:
            raise DataError(f"data-loader state does not match this run: the checkpoint's mixture is (name, "
                            f"fingerprint, weight) {saved}, this run's {now}; resume with the same sources, or start "
                            f"the stage fresh")
        b = int(state["batches_consumed"])
        with self._lock:
            self.batches_consumed, self._first = b, b
            self._rows = {b: np.array([int(s["rows"]) for s in state["sources"]], np.int64)}
