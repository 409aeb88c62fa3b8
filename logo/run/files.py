"""Durable writes: a file's and a directory's contents reach the disk before anything relies on them."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path) -> None:
    """Flush a written file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    """Make a directory's entries (created, renamed or removed files) durable."""
    fsync_file(path)  # a directory is opened and fsynced like a file


def write_durably(path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (the caller renames or fsyncs the folder)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def dir_bytes(path) -> int:
    """Total size of the files under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
