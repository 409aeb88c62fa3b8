"""The embedded default corpus: real text that ships with Python itself, prepared once and cached.

Contents (deterministic, sorted): every documentation topic of `pydoc_data.topics` (the language reference
prose behind `help()`), one document per topic, and the standard library's own .py source files (code), one
document per file, excluding test suites and site-packages. About 0.5 MB of prose and 12 MB of code on
CPython 3.11: ~800 documents, ~3.5M cl100k tokens. It is prepared into the ordinary shard format under
`$LOGO_CACHE/default_corpus/<fingerprint>` (default `~/.cache/logo`), keyed by the Python version, the file
list and the tokenizer, and reused afterwards.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

from data.format import DataError

log = logging.getLogger("logo.data")
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("LOGO_CACHE", Path.home() / ".cache" / "logo"))


def source_files(max_files: Optional[int] = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if not (EXCLUDED_DIRS & set(p.relative_to(root).parts))]
    return files[:max_files] if max_files is not None else files


def documents(files: list[Path], stats: Counter) -> Iterator[str]:
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


def ensure_default_corpus(cache_dir: Optional[Path] = None, max_files: Optional[int] = None,
                          tokenizer: str = "cl100k_base", workers: Optional[int] = None) -> Path:
    """Path of the prepared default corpus, building it on first use."""
    from data.prepare import prepare
    files = source_files(max_files)
    if not files:
        raise DataError(f"no standard-library source files found under {sysconfig.get_paths()['stdlib']}")
    key = hashlib.sha256("\n".join([sys.version, tokenizer] + [str(f) for f in files]).encode()).hexdigest()[:12]
    out = Path(cache_dir or default_cache_dir()) / "default_corpus" / key
    if (out / "manifest.json").exists():
        return out
    log.info("building the embedded default corpus (Python docs + stdlib sources) in %s", out)
    stats: Counter = Counter()
    prepare(documents(files, stats), out, source=dict(embedded="python-stdlib-docs-and-source",
                                                       python=sys.version.split()[0], files=len(files)),
            tokenizer=tokenizer, workers=workers or max(1, (os.cpu_count() or 2)), val_fraction=0.02,
            shard_tokens=50_000_000, progress=False, stats=stats)
    return out
