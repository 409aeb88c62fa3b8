"""A run's training data from its config: one corpus (`TokenLoader`) or a weighted mixture (`MixLoader`).

`check_data` runs before the run directory is touched (every prepared corpus the config names exists and was
tokenized with data.tokenizer); `build_loader` opens the sources on every rank (the embedded corpus is built by
rank 0 first); `heldout_corpus` is the corpus whose validation split the held-out loss reads: the corpus of a
single-corpus run, the first default or shards source of a mixture.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch.distributed as dist

from data.default_corpus import ensure_default_corpus
from data.format import DataError, read_manifest
from data.loader import ShardDataset, TokenLoader
from data.mix import MixLoader, MixSource
from data.synthetic import SyntheticStream, SyntheticTask, train_stream
from logo.config import ConfigError
from logo.run.config import Config, SourceConfig, synthetic_params


def corpus_sources(cfg: Config) -> list[tuple[str, SourceConfig]]:
    """(config key, source) of every corpus the run reads: data itself, or each default/shards source of a mix."""
    d = cfg.data
    if d.kind != "mix":
        return [("data", SourceConfig(name=d.kind, kind=d.kind, path=d.path))]
    return [(f"data.sources.{i}", s) for i, s in enumerate(d.sources) if s.kind in ("default", "shards")]


def check_data(cfg: Config) -> None:
    """Before the run directory is touched: a prepared corpus of data.tokenizer wherever the config points one
    (one-line DataError naming the key)."""
    for key, src in corpus_sources(cfg):
        if src.kind != "shards":
            continue
        if not src.path:
            raise ConfigError(f"invalid config {key}.path='': a shards corpus needs a path DIR, prepared with "
                              "python -m data.prepare")
        try:
            tok = read_manifest(Path(src.path))["tokenizer"].get("name")
        except DataError as e:
            raise DataError(f"invalid config {key}.path={src.path!r}: {e}") from None
        if tok != cfg.data.tokenizer:
            raise DataError(f"invalid config {key}.path={src.path!r}: the corpus was tokenized with {tok!r}, the "
                            f"run uses data.tokenizer={cfg.data.tokenizer!r}; prepare it again with that tokenizer")


def default_corpus(cfg: Config, rank: int, world: int) -> Path:
    """The embedded corpus: rank 0 builds it on first use while the other ranks wait, then find it."""
    if rank == 0:
        path = ensure_default_corpus(tokenizer=cfg.data.tokenizer)
    if world > 1:
        dist.barrier()
    if rank != 0:
        path = ensure_default_corpus(tokenizer=cfg.data.tokenizer)
    return path


def heldout_corpus(cfg: Config, rank: int, world: int) -> Optional[Path]:
    """The corpus whose validation split the held-out loss reads (None: the run reads none)."""
    found = corpus_sources(cfg)
    if not found:
        return None
    src = found[0][1]
    return default_corpus(cfg, rank, world) if src.kind == "default" else Path(src.path)


def open_corpus(cfg: Config, key: str, path: Path) -> ShardDataset:
    """The training split, its token ids checked against the model's vocabulary."""
    ds = ShardDataset(path, "train", tokenizer=cfg.data.tokenizer)
    if ds.token_limit is None:
        ds.token_limit = cfg.model.vocab_size
    if ds.vocab_size and ds.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"invalid config model.vocab_size={cfg.model.vocab_size}: the corpus {path} ({key}) has a "
                          f"vocabulary of {ds.vocab_size} tokens")
    return ds


def synthetic_source(cfg: Config, i: int, src: SourceConfig) -> MixSource:
    m = cfg.model
    task = SyntheticTask(synthetic_params(src, cfg.stage.seq_len, m.attention.window, m.n_layers),
                         cfg.data.tokenizer)
    if task.vocab.max_id >= m.vocab_size:
        raise ConfigError(f"invalid config model.vocab_size={m.vocab_size}: data.sources.{i} ({src.name}) uses token "
                          f"ids up to {task.vocab.max_id} of the tokenizer {cfg.data.tokenizer!r}")
    stream = SyntheticStream(task, train_stream(cfg.data.seed, src.name), src.name)
    return MixSource(src.name, "synthetic", src.weight, stream, info={"params": task.params.relevant()})


def mix_sources(cfg: Config, rank: int, world: int) -> list[MixSource]:
    out = []
    for i, src in enumerate(cfg.data.sources):
        if src.kind == "synthetic":
            out.append(synthetic_source(cfg, i, src))
            continue
        path = default_corpus(cfg, rank, world) if src.kind == "default" else Path(src.path)
        ds = open_corpus(cfg, f"data.sources.{i}", path)
        out.append(MixSource(src.name, src.kind, src.weight, ds, seed=cfg.data.seed + i, info={"path": str(path)}))
    return out


def build_loader(cfg: Config, seq_len: int, global_batch: int, micro_batch: int, rank: int, world: int,
                 data_rank: int, data_world: int):
    """The run's loader (TokenLoader or MixLoader); `rank`/`world`: the process's, `data_rank`/`data_world`: its
    data shard (ranks of one shard, its tp x cp ranks, read the same sequences)."""
    d = cfg.data
    if d.kind == "mix":
        return MixLoader(mix_sources(cfg, rank, world), seq_len, global_batch, micro_batch, data_rank, data_world,
                         d.seed, d.document_mask, d.balance)
    path = default_corpus(cfg, rank, world) if d.kind == "default" else Path(d.path)
    return TokenLoader(open_corpus(cfg, "data", path), seq_len, global_batch, micro_batch, data_rank, data_world,
                       d.seed, d.document_mask, d.balance)


def describe_loader(cfg: Config, loader) -> list[dict]:
    """The sources a loader reads, for plan.json: name, kind, weight, share, fingerprint and path or params."""
    if isinstance(loader, MixLoader):
        return loader.describe()
    ds = loader.ds
    return [{"name": cfg.data.kind, "kind": cfg.data.kind, "weight": 1.0, "share": 1.0,
             "fingerprint": ds.fingerprint, "path": str(ds.root)}]


def data_metrics(loader) -> dict:
    """data/tokens/<source>: tokens each source gave to the consumed global batches (mixtures only)."""
    if not isinstance(loader, MixLoader):
        return {}
    return {f"data/tokens/{name}": n for name, n in loader.source_tokens().items()}
