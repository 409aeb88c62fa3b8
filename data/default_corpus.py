"""The embedded default corpus: real text that ships with Python itself, prepared once and cached.

Contents (deterministic, sorted): the 79 documentation topics of `pydoc_data.topics` (the language-reference
prose behind `help()`), one document per topic, then the standard library's own .py source files (code), one
document per file, excluding test suites and site-packages. On CPython 3.11.7: 0.47 MB of prose, 734 files /
12.1 MB of code -> 810 documents, 3,093,403 cl100k tokens. It is written in the ordinary shard format to
`$LOGO_CACHE/default_corpus/<key>` (default `~/.cache/logo`), where the key hashes the format version, the
tokenizer (name and fingerprint) and every document's content; later calls reuse it.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from data.format import FORMAT_VERSION, DataError
from data.tokenizer import canonical_name, load_tokenizer, tokenizer_fingerprint

log = logging.getLogger("logo.data")
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("LOGO_CACHE", Path.home() / ".cache" / "logo"))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(max_files: Optional[int] = None) -> list[Path]:
    """The standard library's .py files, sorted, without test suites (the first max_files if given)."""
    root = stdlib_root()
    files = []
    for folder, subdirs, names in os.walk(root):  # pruned walk: never enters site-packages (rglob would)
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    files.sort()  # Path order (by parts), as before: the documents' order is the data order
    return files[:max_files] if max_files is not None else files


def documents(files: list[Path], stats: Counter) -> Iterator[str]:
    """Documentation topics (prose), then source files (code): one document each."""
    from pydoc_data.topics import topics
    for name in sorted(topics):
        yield topics[name]
    for path in files:
        raw = path.read_bytes()
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            stats["documents_with_bad_bytes"] += 1
            yield raw.decode("utf-8", errors="ignore")


def corpus_key(files: list[Path], tokenizer_name: str, tokenizer_fp: str) -> str:
    """Fingerprint of what the corpus is made of: format, tokenizer, and every document's content."""
    from pydoc_data.topics import topics
    h = hashlib.sha256(f"format={FORMAT_VERSION};tokenizer={tokenizer_name}:{tokenizer_fp}".encode())
    for name in sorted(topics):
        h.update(name.encode() + b"\0" + topics[name].encode("utf-8", "surrogatepass") + b"\0")
    root = stdlib_root()
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@contextmanager
def _exclusive(lock_path: Path):
    """An advisory lock, so that concurrent processes build the corpus once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_default_corpus(cache_dir: Optional[Path] = None, max_files: Optional[int] = None,
                          tokenizer: str = "cl100k_base", workers: Optional[int] = None) -> Path:
    """Path of the prepared default corpus, building it on first use (max_files: the first N source files
    only, for tests)."""
    from data.prepare import prepare
    files = source_files(max_files)
    if not files:
        raise DataError(f"no standard-library source files found under {stdlib_root()}")
    enc = load_tokenizer(tokenizer)
    key = corpus_key(files, canonical_name(enc), tokenizer_fingerprint(enc))
    out = Path(cache_dir or default_cache_dir()) / "default_corpus" / key
    if (out / "manifest.json").exists():
        return out
    with _exclusive(out.parent / f".{key}.lock"):
        if (out / "manifest.json").exists():  # another process built it while we waited
            return out
        log.info("building the embedded default corpus (Python docs + stdlib sources) in %s", out)
        t0 = time.time()
        stats: Counter = Counter()
        prepare(documents(files, stats), out, source=dict(embedded="python-stdlib-docs-and-source",
                                                           python=sys.version.split()[0], files=len(files), key=key),
                tokenizer=tokenizer, workers=workers or max(1, (os.cpu_count() or 2)), val_fraction=0.02,
                shard_tokens=50_000_000, progress=False, stats=stats)
        log.info("default corpus ready in %.1fs", time.time() - t0)
    return out
