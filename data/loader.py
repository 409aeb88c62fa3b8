"""Deterministic, resumable loader over prepared shards.

Training instances are windows of seq_len + 1 tokens of the split's token stream: instance i starts at token
i * seq_len (inputs = window[:-1], labels = window[1:]). Each epoch visits all instances in the order
`permutation(num_instances)` drawn from (seed, epoch); global batch b of an epoch is order[b*G:(b+1)*G],
whatever the number of data-parallel ranks. Rank r takes its contiguous slice of it, or with `balance` the rows
`data.balance.assign_rows` deals it by attention work inside documents (the ranks then finish a step together);
either way split into micro-batches.
The state is (batches consumed, epoch, seed) plus the corpus fingerprint: resuming is exact. The tail of the
stream after the last whole window, and the instances after the last whole global batch of an epoch, are
not trained on that epoch. iter_eval() walks the split in order instead, tail included (padded).
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from data.balance import rank_rows, row_work
from data.format import INDEX_DTYPE, TOKEN_DTYPE, DataError, check_shard, read_manifest

IGNORE_INDEX = -100


@dataclass
class Batch:
    inputs: torch.Tensor  # (M, T) int64
    labels: torch.Tensor  # (M, T) int64, IGNORE_INDEX where not valid
    cu_seqlens: Optional[torch.Tensor]  # (S+1,) int32 document offsets over the flattened M*T tokens
    valid: torch.Tensor  # (M, T) bool

    def to(self, device) -> Batch:
        cu = None if self.cu_seqlens is None else self.cu_seqlens.to(device, non_blocking=True)
        return Batch(self.inputs.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), cu,
                     self.valid.to(device, non_blocking=True))

    def with_bucketed_offsets(self) -> Batch:
        """This batch with its document offsets padded to a bucketed length (`bucket_doc_offsets`)."""
        if self.cu_seqlens is None:
            return self
        return Batch(self.inputs, self.labels, bucket_doc_offsets(self.cu_seqlens, self.inputs.shape[0]),
                     self.valid)

    def pin_memory(self) -> Batch:
        """A copy in page-locked memory, so that `to(cuda)` is a true asynchronous copy."""
        cu = None if self.cu_seqlens is None else self.cu_seqlens.pin_memory()
        return Batch(self.inputs.pin_memory(), self.labels.pin_memory(), cu, self.valid.pin_memory())


def bucket_doc_offsets(cu: torch.Tensor, rows: int, smallest: int = 16) -> torch.Tensor:
    """Document offsets cu (S+1,) padded to a power-of-two length (at least `smallest`) with copies of the last
    offset: empty documents at the end, which the model and its kernels skip (same outputs and gradients).

    CUDA graphs (train.compile_mode=reduce-overhead) record one graph per distinct input shape, and the number
    of documents in a micro-batch changes from batch to batch: without buckets every new count costs a recording
    (a slow step and the graph's memory), with them one per power of two (at most log2 of the rows' tokens).
    Offsets of a batch without documents inside its rows (rows + 1 entries: the row boundaries) are returned
    unchanged, since the model runs those as plain rows."""
    n = cu.shape[0]
    if n == rows + 1:
        return cu
    size = max(smallest, 1 << (n - 1).bit_length())
    if size == n:
        return cu
    return torch.cat((cu, cu[-1:].expand(size - n)))


@dataclass
class StepData:
    """One optimizer step's data for one rank."""

    micro_batches: list[Batch]  # this rank's micro-batches of the global batch
    target_tokens: int  # valid targets (labels != IGNORE_INDEX) of the whole global batch, every rank


class ShardDataset:
    """One split of a prepared corpus as one flat token stream; shards and document indexes memory-mapped."""

    def __init__(self, path, split: str = "train", tokenizer: Optional[str] = None,
                 verify_checksums: Optional[bool] = None):
        self.root = Path(path)
        self.manifest = read_manifest(self.root)
        if split not in self.manifest["splits"]:
            raise DataError(f"{self.root} has no split {split!r} (splits: {list(self.manifest['splits'])})")
        tok = self.manifest["tokenizer"]
        if tokenizer is not None and tokenizer != tok["name"]:
            raise DataError(f"{self.root} was tokenized with {tok['name']!r} but the config asks for "
                            f"{tokenizer!r}: prepare the corpus again or change the tokenizer")
        info = self.manifest["splits"][split]
        if verify_checksums is None:  # full checksums for small corpora, sizes only for large ones
            verify_checksums = info["num_tokens"] < (1 << 28)
        self.split = split
        self.eos = tok["eos"]
        self.vocab_size = tok.get("vocab_size")
        # token ids must be below this (the tokenizer's vocabulary; the trainer sets the model's when the
        # manifest has none): a corrupt shard that passed a sizes-only check fails here, naming shard and offset
        self.token_limit: Optional[int] = self.vocab_size
        self.shard_names = [shard["name"] for shard in info["shards"]]
        self.tokens: list[np.ndarray] = []  # per shard: (n_s,) uint32
        self.ends: list[np.ndarray] = []  # per shard: (docs_s,) uint64 exclusive document ends, local
        for shard in info["shards"]:
            check_shard(self.root, shard, verify_checksums)
            t = np.memmap(self.root / f"{shard['name']}.bin", dtype=TOKEN_DTYPE, mode="r")
            e = np.memmap(self.root / f"{shard['name']}.idx", dtype=INDEX_DTYPE, mode="r")
            bad_order = verify_checksums and np.any(np.diff(e.astype(np.int64)) <= 0)
            if int(e[-1]) != t.size or bad_order:
                raise DataError(f"document index {self.root / shard['name']}.idx does not match its shard "
                                f"(last end {int(e[-1])}, {t.size} tokens{', ends not increasing' if bad_order else ''})")
            self.tokens.append(t.view(np.ndarray))  # plain views of the maps: no memmap overhead per slice
            self.ends.append(e.view(np.ndarray))
        self.shard_starts = np.cumsum([0] + [t.size for t in self.tokens])  # (n_shards+1,) int64
        self.num_tokens = int(self.shard_starts[-1])
        if self.num_tokens != info["num_tokens"]:
            raise DataError(f"{self.root}: shards hold {self.num_tokens} tokens, the manifest says {info['num_tokens']}")
        self.num_documents = int(info["num_documents"])
        fp = json.dumps({k: self.manifest[k] for k in ("tokenizer", "splits")}, sort_keys=True)
        self.fingerprint = hashlib.sha256(fp.encode()).hexdigest()[:16] + f":{split}"

    def _shard_of(self, pos: int) -> int:
        return int(np.searchsorted(self.shard_starts, pos, side="right")) - 1

    def read(self, start: int, length: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Tokens [start, start+length) of the split's stream (may span shards) -> (length,) int64."""
        out = np.empty(length, dtype=np.int64) if out is None else out
        s = self._shard_of(start)
        pos, filled = start - int(self.shard_starts[s]), 0
        while filled < length:
            take = min(length - filled, self.tokens[s].size - pos)
            chunk = self.tokens[s][pos:pos + take]
            out[filled:filled + take] = chunk
            if self.token_limit is not None and take and int(chunk.max()) >= self.token_limit:
                self._out_of_range(s, pos, chunk)
            filled, s, pos = filled + take, s + 1, 0
        return out

    def _out_of_range(self, s: int, pos: int, chunk: np.ndarray) -> None:
        j = int(np.argmax(chunk >= self.token_limit))
        raise DataError(f"token id {int(chunk[j])} at token offset {pos + j} of shard "
                        f"{self.root / self.shard_names[s]}.bin is outside the vocabulary ({self.token_limit} ids): "
                        f"the shard is corrupt or from another tokenizer; restore it or prepare the corpus again")

    def doc_boundaries(self, start: int, length: int) -> np.ndarray:
        """Offsets (relative to start) in (0, length) where a new document begins -> (k,) int64."""
        found, stop = [], start + length
        s = self._shard_of(start)
        while s < len(self.tokens) and self.shard_starts[s] < stop:
            base = int(self.shard_starts[s])
            e = self.ends[s]  # searched in place: dtype-matched keys keep it a binary search on the map
            lo = int(np.searchsorted(e, np.uint64(max(start - base, 0)), side="right"))
            hi = int(np.searchsorted(e, np.uint64(stop - base), side="left"))
            if hi > lo:
                found.append(e[lo:hi].astype(np.int64) + (base - start))
            s += 1
        return np.concatenate(found) if found else np.zeros(0, np.int64)


def valid_lengths(ds, instances: np.ndarray, T: int) -> np.ndarray:
    """(M,) int64 valid positions (= valid targets) of the rows for instance ids (M,) of a token stream `ds`
    (instance i = tokens [i*T, i*T+T+1)); -1 (padding) -> 0."""
    avail = np.minimum(T + 1, ds.num_tokens - instances.astype(np.int64) * T)
    return np.where(instances < 0, 0, avail - 1)


def rows_batch(ds, instances: np.ndarray, T: int, document_mask: bool = True) -> Batch:
    """Rows for instance ids (M,) of a token stream `ds` (a `ShardDataset`, or any object with its `read`,
    `doc_boundaries`, `num_tokens` and `eos`); an id of -1 is a padding row. Windows cut by the end of the stream
    (eval only) are padded with EOS, valid=False, label -100. `cu_seqlens`: every document start inside the rows
    plus every row boundary (and the start of a row's padding), when `document_mask`."""
    windows = np.full((len(instances), T + 1), ds.eos, dtype=np.int64)  # (M, T+1)
    n_valid = valid_lengths(ds, instances, T)  # (M,) valid input positions per row
    for r, i in enumerate(instances.tolist()):
        if i >= 0:
            ds.read(i * T, int(n_valid[r]) + 1, out=windows[r, :n_valid[r] + 1])
    inputs = torch.from_numpy(windows[:, :-1].copy())
    labels = torch.from_numpy(windows[:, 1:].copy())
    if (n_valid == T).all():
        valid = torch.ones(inputs.shape, dtype=torch.bool)
    else:
        valid = torch.arange(T)[None, :] < torch.from_numpy(n_valid)[:, None]  # (M, T) bool
        labels[~valid] = IGNORE_INDEX
    cu = None
    if document_mask:
        offs = [0]
        for r, i in enumerate(instances.tolist()):
            nv = int(n_valid[r])
            if nv > 0:
                offs.extend((ds.doc_boundaries(i * T, nv) + r * T).tolist())
            if 0 < nv < T:
                offs.append(r * T + nv)  # padding is a segment of its own
            offs.append((r + 1) * T)
        cu = torch.tensor(offs, dtype=torch.int32)  # (S+1,) int32
    return Batch(inputs, labels, cu, valid)


def concat_rows(parts: list[Batch]) -> Batch:
    """The rows of several batches of one row length, in order, as one batch (document offsets shifted)."""
    if len(parts) == 1:
        return parts[0]
    T = parts[0].inputs.shape[1]
    cu = None
    if parts[0].cu_seqlens is not None:
        offs, base = [], 0
        for b in parts:
            offs.append(b.cu_seqlens[:-1] + base * T)
            base += b.inputs.shape[0]
        cu = torch.cat(offs + [torch.tensor([base * T], dtype=torch.int32)])  # (S+1,) int32
    return Batch(torch.cat([b.inputs for b in parts]), torch.cat([b.labels for b in parts]), cu,
                 torch.cat([b.valid for b in parts]))


class TokenLoader:
    def __init__(self, dataset: ShardDataset, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0, document_mask: bool = True,
                 balance: bool = False):
        if global_batch % (micro_batch * dp_world) != 0:
            raise DataError(f"global batch of {global_batch} sequences is not divisible by micro_batch={micro_batch}"
                            f" x dp_world={dp_world}")
        self.ds, self.T, self.G, self.M = dataset, seq_len, global_batch, micro_batch
        self.rank, self.world, self.seed, self.document_mask = dp_rank, dp_world, seed, document_mask
        self.balance = balance and document_mask and dp_world > 1  # without documents every row costs the same
        self.num_instances = (dataset.num_tokens - 1) // seq_len
        self.batches_per_epoch = self.num_instances // global_batch  # may be 0 for an eval-only loader
        self.batches_consumed = 0
        self._order_epoch, self._order = -1, None
        self._order_lock = threading.Lock()  # a prefetch thread and the main thread may both ask

    @property
    def epoch(self) -> int:
        return self.batches_consumed // max(self.batches_per_epoch, 1)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        with self._order_lock:
            if self._order_epoch != epoch:
                rng = np.random.default_rng([self.seed, epoch])
                self._order, self._order_epoch = rng.permutation(self.num_instances), epoch
            return self._order

    def global_batch_instances(self, b: int) -> np.ndarray:
        """Instance ids of global batch b (counted from the start of training), for every rank."""
        if self.batches_per_epoch == 0:
            raise DataError(f"{self.ds.root} split {self.ds.split!r} has {self.ds.num_tokens} tokens: fewer than "
                            f"one global batch of {self.G} x {self.T + 1} tokens to train on")
        epoch, i = divmod(b, self.batches_per_epoch)
        return self._epoch_order(epoch)[i * self.G:(i + 1) * self.G]

    def _valid_lengths(self, instances: np.ndarray) -> np.ndarray:
        return valid_lengths(self.ds, instances, self.T)

    def _make_batch(self, instances: np.ndarray) -> Batch:
        return rows_batch(self.ds, instances, self.T, self.document_mask)

    def step_data(self, b: int) -> StepData:
        """This rank's micro-batches of global batch b and the global batch's target count (all ranks: from
        the instance ids alone, so no communication). Does not move the position: safe on a prefetch thread."""
        inst = self.global_batch_instances(b)
        valid = self._valid_lengths(inst)
        work = np.array([row_work(self.ds, i, self.T, n) for i, n in zip(inst, valid)]) if self.balance else None
        mine = inst[rank_rows(self.G, self.rank, self.world, work)]
        micro = [self._make_batch(mine[j:j + self.M]) for j in range(0, len(mine), self.M)]
        return StepData(micro, int(valid.sum()))

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next global batch."""
        data = self.step_data(self.batches_consumed)
        self.batches_consumed += 1
        return data.micro_batches

    def num_eval_batches(self) -> int:
        """Micro-batches iter_eval() yields on every rank (equal on all ranks)."""
        n_inst = -(-(self.ds.num_tokens - 1) // self.T)  # the last window may be short
        per_rank = -(-n_inst // self.world)
        return -(-per_rank // self.M)

    def iter_eval(self, max_batches: Optional[int] = None) -> Iterator[Batch]:
        """The whole split once, in order, no shuffle, for perplexity: window i = tokens [i*T, i*T+T+1), the
        last one short; rank r takes windows r, r+W, ... Every rank yields num_eval_batches() micro-batches of
        shape (M, T): missing rows are padding (valid False, labels -100), so collectives stay in step.
        Each predicted token is counted exactly once over all ranks."""
        n_inst = -(-(self.ds.num_tokens - 1) // self.T)
        n_batches = self.num_eval_batches()
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        ids = np.full(n_batches * self.M, -1, dtype=np.int64)
        mine = np.arange(self.rank, n_inst, self.world)[: len(ids)]
        ids[: len(mine)] = mine
        for j in range(n_batches):
            yield self._make_batch(ids[j * self.M:(j + 1) * self.M])

    def state_dict(self) -> dict:
        return dict(batches_consumed=self.batches_consumed, epoch=self.epoch, seed=self.seed,
                    fingerprint=self.ds.fingerprint, seq_len=self.T, global_batch=self.G)

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("fingerprint", self.ds.fingerprint), ("seq_len", self.T), ("global_batch", self.G),
                          ("seed", self.seed)):
            if state.get(key) != mine:
                raise DataError(f"data-loader state does not match this run: {key}={state.get(key)!r} in the "
                                f"checkpoint, {mine!r} now (dataset {self.ds.root}); resume with the same data "
                                f"and batch settings, or start the stage fresh")
        self.batches_consumed = int(state["batches_consumed"])
