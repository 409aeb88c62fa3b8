"""Output folders written next to their target and renamed into place, with the permissions of ordinary files.

A folder from `tempfile.mkdtemp` is private (0700), and some writers create files through private temporary
files (0600); a finished export or report gets the mode the user's umask gives a new file or folder instead
(0644 / 0755 under umask 022). Used by `logo.export` and `logo.report`; imports nothing heavy.
"""
from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask (reading it means setting it: it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give `path`, and everything below it when it is a folder, the mode the umask gives a new file (0666 minus
    the umask) or folder (0777 minus the umask). Symbolic links are left alone."""
    path = Path(path)
    mask = current_umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
