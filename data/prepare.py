"""Tokenize a corpus into resumable uint32 token shards.

    python -m data.prepare 'corpus/*.jsonl' --out DIR [--text-field text] [--workers N] [--val-fraction 0.005]
    python -m data.prepare --hf-dataset NAME [--hf-config C] [--hf-split train] [--streaming] --out DIR
    python -m data.prepare --hf-dataset json --hf-data-files 'dir/*.jsonl' --streaming --out DIR

Documents are tokenized in parallel worker processes (order preserved), each followed by EOS, and streamed
into shards of --shard-tokens tokens: memory stays bounded whatever the corpus size. Every document goes to
the validation split when its index is a multiple of round(1 / val_fraction), else to train. A shard becomes
visible (renamed from .tmp) only once complete and fsynced; `progress.json` records finished shards, so an
interrupted run (Ctrl-C: one line, exit code 130, the unfinished shards removed) re-run with the same arguments
continues after the last finished shard; with other arguments it refuses (or restarts with --overwrite). The
manifest is written last. --out must be new, empty or a corpus of this module's (nothing else in it) and hold
none of the inputs (`data.outputs`); --overwrite deletes only this module's own files there.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Optional

import numpy as np

from data.format import (FORMAT_VERSION, INDEX_DTYPE, TOKEN_DTYPE, DataError, atomic_write_json, read_json,
                         shard_name)
from data.outputs import INTERRUPTED, OutputError, OutputKind, check_out, one_line
from data.sources import expand_inputs, iter_files, iter_hf
from data.tokenizer import canonical_name, load_tokenizer, tokenizer_fingerprint

log = logging.getLogger("logo.data")
_ENC = None
SHARD_FILES = tuple(f"{split}_[0-9][0-9][0-9][0-9][0-9].{ext}" for split in ("train", "val")
                    for ext in ("bin", "idx", "bin.tmp", "idx.tmp"))
CORPUS = OutputKind("a prepared corpus", ("manifest.json", "progress.json"),
                    ("manifest.json", "manifest.json.tmp", "progress.json", "progress.json.tmp", *SHARD_FILES))


def _init_worker(name: str):
    global _ENC
    _ENC = load_tokenizer(name)


def _init_pool_worker(name: str):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent alone handles it
    _init_worker(name)


def _tokenize(docs: list[str]) -> list[np.ndarray]:
    eos = _ENC.eot_token
    return [np.asarray(_ENC.encode_ordinary(d) + [eos], dtype=TOKEN_DTYPE) for d in docs]


class ShardWriter:
    """Appends documents of one split to shards; finishes a shard atomically when it is full."""

    def __init__(self, out: Path, split: str, shard_tokens: int, done: list[dict]):
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.done = done  # finished shards (from progress.json when resuming)
        self._open()

    def _open(self):
        name = shard_name(self.split, len(self.done))
        self.name = name
        self.bin_tmp = self.out / f"{name}.bin.tmp"
        self.f = open(self.bin_tmp, "wb")
        self.hash = hashlib.sha256()
        self.ends: list[int] = []
        self.n = 0

    def add(self, tokens: np.ndarray):
        data = tokens.tobytes()
        self.f.write(data)
        self.hash.update(data)
        self.n += tokens.size
        self.ends.append(self.n)

    @property
    def full(self) -> bool:
        return self.n >= self.shard_tokens

    def finish(self, reopen: bool = False) -> Optional[dict]:
        """Close the current shard; publish it if it holds any document."""
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if not self.ends:
            self.bin_tmp.unlink()
            if reopen:
                self._open()
            return None
        idx_tmp = self.out / f"{self.name}.idx.tmp"
        idx_bytes = np.asarray(self.ends, dtype=INDEX_DTYPE).tobytes()  # (docs,) uint64 exclusive ends
        with open(idx_tmp, "wb") as f:
            f.write(idx_bytes)
            f.flush()
            os.fsync(f.fileno())
        idx_tmp.replace(self.out / f"{self.name}.idx")
        self.bin_tmp.replace(self.out / f"{self.name}.bin")  # the .bin appears last: complete shard
        _fsync_dir(self.out)
        shard = dict(name=self.name, num_tokens=self.n, num_documents=len(self.ends), sha256=self.hash.hexdigest(),
                     idx_sha256=hashlib.sha256(idx_bytes).hexdigest())
        self.done.append(shard)
        if reopen:
            self._open()
        return shard

    def discard(self):
        """Close and remove the shard being written (an interrupted or failed preparation), its index too when the
        interruption came while `finish` wrote it."""
        self.f.close()
        self.bin_tmp.unlink(missing_ok=True)
        (self.out / f"{self.name}.idx.tmp").unlink(missing_ok=True)


def _our_files(out: Path, suffix: str = "*") -> list[Path]:
    """Shard files (and their .tmp) this module writes in `out`; nothing else there is touched."""
    return [p for split in ("train", "val") for p in out.glob(f"{split}_[0-9][0-9][0-9][0-9][0-9].{suffix}")]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(it)
    while batch := list(islice(it, n)):
        yield batch


def _bounded_ordered_map(pool, fn, items: Iterable, max_pending: int) -> Iterator:
    """pool.imap with back-pressure: at most `max_pending` items in flight, results in input order.

    (Pool.imap reads its whole input ahead, which would pull a corpus larger than RAM into memory.)"""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def prepare(documents: Iterable[str], out: Path, source: dict, tokenizer: str = "cl100k_base",
            workers: int = 1, val_fraction: float = 0.005, shard_tokens: int = 100_000_000,
            overwrite: bool = False, progress: bool = True, stats: Optional[Counter] = None,
            inputs: Iterable[Path] = ()) -> dict:
    """Tokenize `documents` into shards under `out`; returns the manifest. `inputs`: the local files and folders
    the documents come from (`out` must hold none of them).

    `stats` is the source's own counter (bad bytes...), filled while `documents` is iterated; it is merged
    into the manifest's `skipped`. The source must yield the same documents in the same order when re-run."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction={val_fraction} must be in [0, 1)")
    try:
        check_out(out, CORPUS, inputs, in_place=True)
    except OutputError as e:
        raise DataError(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    stats = stats if stats is not None else Counter()
    enc = load_tokenizer(tokenizer)
    settings = dict(source=source, tokenizer=canonical_name(enc), val_fraction=val_fraction,
                    shard_tokens=shard_tokens)
    if (out / "manifest.json").exists() and not overwrite:
        m = read_json(out / "manifest.json", "corpus manifest")
        if m.get("settings") == settings:
            log.info("%s is already prepared (%d tokens); nothing to do", out, m["num_tokens"])
            return m
        raise DataError(f"{out} already holds a prepared corpus with other settings; use --overwrite or "
                        f"another --out")
    prog_path = out / "progress.json"
    resume = {"settings": None}
    if prog_path.exists() and not overwrite:
        resume = read_json(prog_path, "preparation progress record")
        if not {"settings", "documents_read", "shards"} <= resume.keys():
            raise DataError(f"{prog_path} is not a progress record of data.prepare; use --overwrite or another "
                            f"--out")
        if resume["settings"] != settings and resume["documents_read"] == 0:
            resume = {"settings": None}  # nothing finished yet (e.g. a run that failed on a bad argument)
        elif resume["settings"] != settings:
            raise DataError(f"{out} holds an interrupted preparation with other settings; use --overwrite "
                            f"or another --out")
    if overwrite or resume["settings"] is None:
        for p in _our_files(out) + [out / "manifest.json", prog_path]:
            p.unlink(missing_ok=True)
        resume = {"settings": settings, "documents_read": 0, "counts": {}, "shards": {"train": [], "val": []}}
    for p in _our_files(out, "*.tmp"):  # half-written shards from an interrupted run
        p.unlink()
    atomic_write_json(prog_path, resume)
    skip_docs = resume["documents_read"]
    if skip_docs:
        log.info("resuming %s after %d documents (%d finished shards)", out, skip_docs,
                 sum(len(v) for v in resume["shards"].values()))
    # Our own counts are restored; the source's are recounted as it re-reads the documents it skips.
    counts = Counter(resume.get("counts", {}))
    val_every = round(1 / val_fraction) if val_fraction > 0 else 0
    writers = {s: ShardWriter(out, s, shard_tokens, resume["shards"][s]) for s in ("train", "val")}

    def checkpoint(docs_read: int):
        atomic_write_json(prog_path, dict(settings=settings, documents_read=docs_read, counts=dict(counts),
                                          shards={s: w.done for s, w in writers.items()}))

    docs_iter = islice(iter(documents), skip_docs, None)
    doc_index = skip_docs
    t0, tokens_done, bar = time.time(), 0, None
    if progress:
        from tqdm import tqdm
        bar = tqdm(unit="doc", desc=f"tokenizing -> {out.name}", dynamic_ncols=True, file=sys.stderr)
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    pool = ctx.Pool(workers, initializer=_init_pool_worker, initargs=(tokenizer,)) if workers > 1 else None
    if pool is None:
        _init_worker(tokenizer)
    try:
        batches = _batched(docs_iter, 64)
        results = _bounded_ordered_map(pool, _tokenize, batches, 4 * workers) if pool else map(_tokenize, batches)
        for toks in results:
            for t in toks:
                i, doc_index = doc_index, doc_index + 1
                if t.size == 1:  # only EOS: an empty document
                    counts["empty_documents_skipped"] += 1
                    continue
                split = "val" if val_every and i % val_every == val_every - 1 else "train"
                writers[split].add(t)
                tokens_done += t.size
                if writers[split].full:  # publish both splits' shards so every document read is on disk
                    for w in writers.values():
                        w.finish(reopen=True)
                    checkpoint(doc_index)
            if bar is not None:
                bar.update(len(toks))
                el = max(time.time() - t0, 1e-9)
                bar.set_postfix_str(f"{tokens_done / el / 1e6:.2f}M tok/s")
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    for w in writers.values():
        w.finish()
    skipped = dict(sorted((stats + counts).items()))
    splits = {s: dict(num_tokens=sum(x["num_tokens"] for x in w.done),
                      num_documents=sum(x["num_documents"] for x in w.done), shards=w.done)
              for s, w in writers.items()}
    if splits["train"]["num_tokens"] == 0:
        raise DataError(f"no training tokens: every document from {source} was empty or went to validation")
    if splits["val"]["num_tokens"] == 0:
        log.warning("the validation split is empty (%d documents read%s): training's eval.interval and `python -m "
                    "logo.eval perplexity` need one; prepare again with a larger --val-fraction",
                    sum(s["num_documents"] for s in splits.values()),
                    f", every {val_every}th goes to validation" if val_every else ", --val-fraction 0")
    manifest = dict(format=FORMAT_VERSION, settings=settings, source=source,
                    tokenizer=dict(name=canonical_name(enc), fingerprint=tokenizer_fingerprint(enc),
                                   eos=enc.eot_token, vocab_size=enc.n_vocab),
                    num_tokens=sum(s["num_tokens"] for s in splits.values()),
                    num_documents=sum(s["num_documents"] for s in splits.values()),
                    splits=splits, skipped=skipped)
    atomic_write_json(out / "manifest.json", manifest)
    prog_path.unlink(missing_ok=True)
    for k, v in skipped.items():
        log.warning("%s: %d", k.replace("_", " "), v)
    log.info("prepared %s: %d documents, %d tokens (train %d / val %d) in %.1fs", out, manifest["num_documents"],
             manifest["num_tokens"], splits["train"]["num_tokens"], splits["val"]["num_tokens"], time.time() - t0)
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", help="files or glob patterns (.jsonl/.json, .parquet, .txt/.md/.py)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--hf-dataset", help="Hugging Face dataset name, or a local save_to_disk directory")
    ap.add_argument("--hf-config")
    ap.add_argument("--hf-split", default="train")
    ap.add_argument("--hf-data-files", nargs="+", help="data_files for a packaged builder, e.g. "
                    "--hf-dataset json --hf-data-files 'a/*.jsonl'")
    ap.add_argument("--streaming", action="store_true", help="stream the HF dataset (preparation only)")
    ap.add_argument("--tokenizer", default="cl100k_base")
    ap.add_argument("--workers", type=int, default=max(1, mp.cpu_count() - 1))
    ap.add_argument("--val-fraction", type=float, default=0.005)
    ap.add_argument("--shard-tokens", type=int, default=100_000_000)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stats: Counter = Counter()
    try:
        if args.hf_dataset:
            if args.inputs:
                raise DataError("give either input files or --hf-dataset, not both")
            source = dict(hf_dataset=args.hf_dataset, config=args.hf_config, split=args.hf_split,
                          data_files=args.hf_data_files, text_field=args.text_field)
            docs = iter_hf(args.hf_dataset, args.hf_config, args.hf_split, args.text_field, args.streaming, stats,
                           data_files=args.hf_data_files)
            inputs = [Path(args.hf_dataset)] if Path(args.hf_dataset).exists() else []  # a local dataset folder
        else:
            if not args.inputs:
                raise DataError("no input: give files/globs or --hf-dataset NAME")
            files = expand_inputs(args.inputs)
            source = dict(files=[str(f) for f in files], text_field=args.text_field)
            docs = iter_files(files, args.text_field, stats)
            inputs = files
        prepare(docs, args.out, source, args.tokenizer, args.workers, args.val_fraction, args.shard_tokens,
                args.overwrite, stats=stats, inputs=inputs)
    except (DataError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {args.out} holds no prepared corpus yet (no manifest.json); the same command "
              f"continues after its last finished shard", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
