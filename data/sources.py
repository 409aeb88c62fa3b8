"""Document sources for preparation: local files (jsonl, parquet, txt; glob patterns) or a Hugging Face dataset.

Each source yields documents as str. Bad bytes are dropped (counted); a missing text field or an unreadable
file raises DataError naming the file.
"""
from __future__ import annotations

import glob
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from data.format import DataError

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "txt", ".md": "txt",
            ".py": "txt"}


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Glob patterns and paths -> sorted unique files; errors name the pattern that matched nothing."""
    files: list[Path] = []
    for pat in patterns:
        matches = sorted(glob.glob(pat, recursive=True)) if any(c in pat for c in "*?[") else [pat]
        if not matches:
            raise DataError(f"input pattern {pat!r} matched no file")
        for m in matches:
            p = Path(m)
            if not p.exists():
                raise DataError(f"input file {p} does not exist")
            if p.is_dir():
                raise DataError(f"input {p} is a directory: pass files or a glob such as '{p}/*.jsonl'")
            if p.stat().st_size == 0:
                raise DataError(f"input file {p} is empty")
            if p.suffix.lower() not in SUFFIXES:
                raise DataError(f"input file {p} has an unsupported type {p.suffix!r}; use one of "
                                f"{sorted(SUFFIXES)}")
            files.append(p)
    return list(dict.fromkeys(files))


def _decode(raw: bytes, stats: Counter) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats["documents_with_bad_bytes"] += 1
        return raw.decode("utf-8", errors="ignore")


def _clean(text, stats: Counter) -> str:
    """str(text), with lone surrogates (from JSON escapes such as \\ud800) dropped and counted."""
    text = "" if text is None else str(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        stats["documents_with_bad_bytes"] += 1
        text = text.encode("utf-8", errors="ignore").decode("utf-8")
    return text


def _jsonl(path: Path, field: str, stats: Counter) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(_decode(raw, stats))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or field not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise DataError(f"{path}:{lineno}: no text field {field!r} (fields: {keys}); "
                                f"choose one with --text-field")
            yield _clean(row[field], stats)


def _parquet(path: Path, field: str, stats: Counter) -> Iterator[str]:
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no text field {field!r} (columns: {pf.schema_arrow.names}); "
                        f"choose one with --text-field")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield _clean(text, stats)


def _txt(path: Path, stats: Counter) -> Iterator[str]:
    yield _decode(path.read_bytes(), stats)  # one document per file


def iter_files(files: list[Path], field: str, stats: Counter) -> Iterator[str]:
    for path in files:
        kind = SUFFIXES[path.suffix.lower()]
        if kind == "jsonl":
            yield from _jsonl(path, field, stats)
        elif kind == "parquet":
            yield from _parquet(path, field, stats)
        else:
            yield from _txt(path, stats)


def iter_hf(name: str, config: Optional[str], split: str, field: str, streaming: bool, stats: Counter,
            data_files: Optional[list[str]] = None) -> Iterator[str]:
    """A Hugging Face dataset by hub name (or a packaged builder with `data_files`), or a local
    `save_to_disk` directory."""
    import datasets
    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"dataset {name} has no split {split!r} (splits: {list(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, config, split=split, streaming=streaming, data_files=data_files)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - network, missing dataset, bad config...
        raise DataError(f"could not open Hugging Face dataset {name!r} (config={config}, split={split}): "
                        f"{type(e).__name__}: {e}") from None
    names = getattr(ds, "column_names", None)
    if names is not None and field not in names:
        raise DataError(f"dataset {name!r} has no text field {field!r} (columns: {names}); use --text-field")
    for i, row in enumerate(ds):
        if field not in row:  # streaming datasets may not know their columns up front
            raise DataError(f"dataset {name!r} row {i}: no text field {field!r} (fields: {sorted(row)}); "
                            f"use --text-field")
        yield _clean(row[field], stats)
