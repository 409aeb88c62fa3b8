"""On-disk format of a prepared corpus, and its validation.

DIR/manifest.json          written last (atomically): the corpus exists only once it is there
DIR/{split}_{i:05d}.bin    uint32 tokens, documents back to back, each ending with EOS
DIR/{split}_{i:05d}.idx    uint64 end offset (exclusive, within the shard) of every document

manifest = {"format": 1, "tokenizer": {"name", "fingerprint", "eos"}, "source": {...},
            "num_tokens", "num_documents", "splits": {split: {"num_tokens", "num_documents",
            "shards": [{"name", "num_tokens", "num_documents", "sha256", "idx_sha256"}]}}, "skipped": {...}}
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

FORMAT_VERSION = 2  # 2: per-shard idx_sha256
TOKEN_DTYPE = np.uint32
INDEX_DTYPE = np.uint64


class DataError(ValueError):
    """Bad data input: the message names the file and the problem."""


def shard_name(split: str, i: int) -> str:
    return f"{split}_{i:05d}"


def atomic_write_json(path: Path, obj) -> None:
    """Write `obj` to `path` through a .tmp beside it; an interruption (Ctrl-C included) leaves no .tmp behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path, what: str) -> dict:
    """A JSON object from a file; DataError in one line naming it when it cannot be read, is not UTF-8, is not
    JSON or not an object."""
    try:
        m = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{what} {path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(m, dict):
        raise DataError(f"{path} is not a JSON object: not a logo {what}")
    return m


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(root: Path) -> dict:
    path = Path(root) / "manifest.json"
    if not Path(root).is_dir():
        raise DataError(f"data directory {root} does not exist (prepare it with `python -m data.prepare`)")
    if not path.exists():
        raise DataError(f"{path} is missing: {root} is not a prepared corpus, or its preparation did not finish "
                        f"(re-run `python -m data.prepare ... --out {root}`)")
    m = read_json(path, "manifest.json")
    for key in ("format", "tokenizer", "splits", "num_tokens", "num_documents"):
        if key not in m:
            raise DataError(f"{path} has no {key!r} field: not a logo corpus manifest")
    if m["format"] != FORMAT_VERSION:
        raise DataError(f"{path} has format {m['format']}, this code reads format {FORMAT_VERSION}")
    return m


def check_shard(root: Path, shard: dict, verify_checksum: bool) -> None:
    """Raise DataError if the shard's files do not match the manifest."""
    bin_path, idx_path = Path(root) / f"{shard['name']}.bin", Path(root) / f"{shard['name']}.idx"
    for p in (bin_path, idx_path):
        if not p.exists():
            raise DataError(f"shard file {p} listed in the manifest is missing")
    want = shard["num_tokens"] * np.dtype(TOKEN_DTYPE).itemsize
    if bin_path.stat().st_size != want:
        raise DataError(f"shard {bin_path} is truncated or corrupted: {bin_path.stat().st_size} bytes, "
                        f"the manifest says {shard['num_tokens']} tokens ({want} bytes)")
    want_idx = shard["num_documents"] * np.dtype(INDEX_DTYPE).itemsize
    if idx_path.stat().st_size != want_idx:
        raise DataError(f"document index {idx_path} has {idx_path.stat().st_size} bytes, the manifest says "
                        f"{shard['num_documents']} documents ({want_idx} bytes)")
    if verify_checksum:
        if file_sha256(bin_path) != shard["sha256"]:
            raise DataError(f"shard {bin_path} is corrupted: its sha256 does not match the manifest")
        if file_sha256(idx_path) != shard.get("idx_sha256"):
            raise DataError(f"document index {idx_path} is corrupted: its sha256 does not match the manifest")
