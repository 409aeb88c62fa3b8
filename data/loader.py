"""Deterministic, resumable loader over prepared shards.

Training instances are windows of seq_len + 1 tokens of the split's token stream: instance i starts at token
i * seq_len (inputs = window[:-1], labels = window[1:]). Each epoch visits all instances in the order
`permutation(num_instances)` drawn from (seed, epoch); global batch b of an epoch is order[b*G:(b+1)*G],
whatever the number of data-parallel ranks, and rank r takes its contiguous slice, split into micro-batches.
The state is (batches consumed, epoch, seed) plus the corpus fingerprint: resuming is exact.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from data.format import INDEX_DTYPE, TOKEN_DTYPE, DataError, check_shard, read_manifest

IGNORE_INDEX = -100


@dataclass
class Batch:
    inputs: torch.Tensor  # (M, T) int64
    labels: torch.Tensor  # (M, T) int64, IGNORE_INDEX where not valid
    cu_seqlens: Optional[torch.Tensor]  # (S+1,) int32 document offsets over the flattened M*T tokens
    valid: torch.Tensor  # (M, T) bool

    def to(self, device) -> "Batch":
        cu = None if self.cu_seqlens is None else self.cu_seqlens.to(device, non_blocking=True)
        return Batch(self.inputs.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), cu,
                     self.valid.to(device, non_blocking=True))


class ShardDataset:
    """One split of a prepared corpus, memory-mapped, as one flat token stream with document ends."""

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
        self.tokens: list[np.memmap] = []
        ends, offset = [], 0
        for shard in info["shards"]:
            check_shard(self.root, shard, verify_checksums)
            t = np.memmap(self.root / f"{shard['name']}.bin", dtype=TOKEN_DTYPE, mode="r")
            e = np.fromfile(self.root / f"{shard['name']}.idx", dtype=INDEX_DTYPE).astype(np.int64)
            if e.size and (e[-1] != t.size or np.any(np.diff(e) <= 0)):
                raise DataError(f"document index of shard {shard['name']} in {self.root} does not match its tokens")
            self.tokens.append(t)
            ends.append(e + offset)
            offset += t.size
        self.num_tokens = offset
        if self.num_tokens != info["num_tokens"]:
            raise DataError(f"{self.root}: shards hold {self.num_tokens} tokens, the manifest says {info['num_tokens']}")
        self.doc_ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)  # global exclusive ends
        self.shard_starts = np.cumsum([0] + [t.size for t in self.tokens])
        fp = json.dumps({k: self.manifest[k] for k in ("tokenizer", "splits")}, sort_keys=True)
        self.fingerprint = hashlib.sha256(fp.encode()).hexdigest()[:16] + f":{split}"

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split's stream (may span shards)."""
        out = np.empty(length, dtype=np.int64)
        s = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pos, filled = start - self.shard_starts[s], 0
        while filled < length:
            take = min(length - filled, self.tokens[s].size - pos)
            out[filled:filled + take] = self.tokens[s][pos:pos + take]
            filled, s, pos = filled + take, s + 1, 0
        return out

    def doc_boundaries(self, start: int, length: int) -> np.ndarray:
        """Offsets (relative to start) in (0, length) where a new document begins."""
        lo = np.searchsorted(self.doc_ends, start, side="right")
        hi = np.searchsorted(self.doc_ends, start + length, side="left")
        return self.doc_ends[lo:hi] - start


class TokenLoader:
    def __init__(self, dataset: ShardDataset, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0, document_mask: bool = True):
        if global_batch % (micro_batch * dp_world) != 0:
            raise DataError(f"global batch of {global_batch} sequences is not divisible by micro_batch={micro_batch}"
                            f" x dp_world={dp_world}")
        self.ds, self.T, self.G, self.M = dataset, seq_len, global_batch, micro_batch
        self.rank, self.world, self.seed, self.document_mask = dp_rank, dp_world, seed, document_mask
        self.num_instances = (dataset.num_tokens - 1) // seq_len
        self.batches_per_epoch = self.num_instances // global_batch
        if self.batches_per_epoch == 0:
            raise DataError(f"{dataset.root} split {dataset.split!r} has {dataset.num_tokens} tokens: fewer than one "
                            f"global batch of {global_batch} x {seq_len + 1} tokens")
        self.batches_consumed = 0
        self._order_epoch, self._order = -1, None

    @property
    def epoch(self) -> int:
        return self.batches_consumed // self.batches_per_epoch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order, self._order_epoch = rng.permutation(self.num_instances), epoch
        return self._order

    def global_batch_instances(self, b: int) -> np.ndarray:
        """Instance ids of global batch b (counted from the start of training), for every rank."""
        epoch, i = divmod(b, self.batches_per_epoch)
        return self._epoch_order(epoch)[i * self.G:(i + 1) * self.G]

    def _make_batch(self, instances: np.ndarray) -> Batch:
        T = self.T
        windows = np.stack([self.ds.read(int(i) * T, T + 1) for i in instances])  # (M, T+1)
        inputs = torch.from_numpy(windows[:, :-1].copy())
        labels = torch.from_numpy(windows[:, 1:].copy())
        valid = torch.ones(inputs.shape, dtype=torch.bool)
        cu = None
        if self.document_mask:
            offs = [0]
            for r, i in enumerate(instances):
                offs.extend((self.ds.doc_boundaries(int(i) * T, T) + r * T).tolist())
                offs.append((r + 1) * T)
            cu = torch.tensor(offs, dtype=torch.int32)
        return Batch(inputs, labels, cu, valid)

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next global batch."""
        inst = self.global_batch_instances(self.batches_consumed)
        per_rank = self.G // self.world
        mine = inst[self.rank * per_rank:(self.rank + 1) * per_rank]
        self.batches_consumed += 1
        return [self._make_batch(mine[j:j + self.M]) for j in range(0, per_rank, self.M)]

    def iter_eval(self, max_batches: Optional[int] = None) -> Iterator[Batch]:
        """Sequential, unshuffled micro-batches of this rank's share of the split (for perplexity)."""
        ids = np.arange(self.num_instances)[self.rank::self.world]
        for n, j in enumerate(range(0, len(ids), self.M)):
            if max_batches is not None and n >= max_batches:
                return
            yield self._make_batch(ids[j:j + self.M])

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
