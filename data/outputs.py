"""Output folders of the commands that write (`data.prepare`, `logo.export`, `logo.eval span`, `logo.report`).

No command deletes or overwrites what it did not create: an `--out` is used only when it is new, empty, or that
command's own earlier output holding nothing else (recognized by its marker file), and never when it overlaps
what the command reads. A folder output is built in a temporary sibling and swapped in whole, with the
permissions of the user's umask; a Ctrl-C during the swap takes effect once it is done. Imports nothing heavy:
at the bottom of the packages, so every command, the torch-free report included, makes the same check.
"""
from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

INTERRUPTED = 130  # exit code of a command stopped by Ctrl-C (128 + SIGINT)

# What a folder is, told by the files that mark it (the first match names it in a refusal).
FOLDER_KINDS = (("a run directory", ("config.yaml", "checkpoints", "metrics.jsonl", "plan.json")),
                ("a checkpoint", (".metadata", "train_state.pt", "digests.json")),
                ("a prepared corpus", ("manifest.json", "progress.json")),
                ("a report", ("report.json",)),
                ("a model folder", ("config.json",)))


class OutputError(ValueError):
    """An output path that must not be written or replaced; the message names it and why."""


@dataclass(frozen=True)
class OutputKind:
    """The folder one command writes: a file named in `markers` identifies it (`is_own` may look inside that
    file), `files` are the name patterns of everything it writes there."""
    what: str
    markers: tuple[str, ...]
    files: tuple[str, ...]
    is_own: Optional[Callable[[Path], bool]] = None

    def owns(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.files)


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def folder_kind(path: Path) -> Optional[str]:
    """'a run directory', 'a checkpoint', ... for a folder holding such a marker; None otherwise."""
    names = {p.name for p in path.iterdir()}
    return next((what for what, markers in FOLDER_KINDS if names & set(markers)), None)


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def overlap(out: Path, sources: Iterable[Path]) -> Optional[str]:
    """How `out` overlaps one of `sources` (the same path, inside it, or holding it), or None."""
    o = Path(os.path.abspath(out)).resolve()
    for src in sources:
        s = Path(os.path.abspath(src)).resolve()
        if o == s:
            return f"is the source {src}"
        if _inside(o, s):
            return f"is inside the source {src}"
        if _inside(s, o):
            return f"holds the source {src}"
    return None


def check_writable(out: Path, folder: Path) -> None:
    """OutputError in one line unless `folder` (where `out` is written) exists as a writable folder or can be
    created in one: its nearest existing ancestor must be a folder this process may write."""
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        raise OutputError(f"--out {out} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out} cannot be written: {existing} is not writable (read-only or no "
                          f"permission)")


def check_out(out: Path, kind: OutputKind, sources: Iterable[Path] = (), in_place: bool = False) -> bool:
    """Whether `out` holds an earlier output of `kind` (False: it is new or an empty folder); OutputError in one
    line when it may be neither written nor replaced: it overlaps a source, is a file or a link, cannot be
    written, or holds anything that is not this kind's own output. in_place: the command writes into `out`
    itself (else into a sibling swapped in)."""
    out = Path(out)
    why = overlap(out, sources)
    if why:
        raise OutputError(f"--out {out} {why}; choose a folder outside what is read")
    if out.is_symlink():
        raise OutputError(f"--out {out} is a symbolic link; pass a new folder or the folder itself")
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file, not a folder; pass a new or empty folder")
    check_writable(out, out if in_place and out.is_dir() else out.parent)
    if not out.exists():
        return False
    entries = sorted(out.iterdir())
    if not entries:
        return False
    foreign = [p.name + ("/" if p.is_dir() else "") for p in entries
               if p.is_symlink() or not p.is_file() or not kind.owns(p.name)]
    own = any((out / m).is_file() and (kind.is_own is None or kind.is_own(out / m)) for m in kind.markers)
    if own and not foreign:
        return True
    what = folder_kind(out)
    shown = ", ".join(foreign[:3] or [p.name for p in entries[:3]]) + (", ..." if len(foreign) > 3 else "")
    held = f"{what} ({shown})" if what and not own else f"files that are not {kind.what}'s ({shown})"
    raise OutputError(f"--out {out} holds {held}; nothing is replaced: choose a new or empty folder")


@contextmanager
def interrupt_deferred() -> Iterator[None]:
    """Within the block a Ctrl-C (SIGINT) is held back and raised as KeyboardInterrupt when it ends, so the
    few steps that publish an output are done whole. Outside the main thread, a plain block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def current_umask() -> int:
    """The process umask (reading it means setting it: it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give `path`, and everything below it when it is a folder, the mode the umask gives a new file (0666 minus
    the umask) or folder (0777 minus the umask). Symbolic links are left alone. (A folder from
    `tempfile.mkdtemp` is private, 0700, as are files some writers create through private temporary files.)"""
    path = Path(path)
    mask = current_umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


@contextmanager
def folder_swapped_in(out: Path, kind: OutputKind, sources: Iterable[Path] = ()) -> Iterator[Path]:
    """Yields a new temporary folder next to `out` to write the output into; when the block ends it gets the
    umask's permissions and replaces `out` (checked again with `check_out` first: only an earlier output of
    `kind` is replaced). On any error or Ctrl-C the temporary folder is removed and `out` is left as it was; an
    error of the file system (read-only, full, ...) becomes an OutputError naming `out`."""
    out = Path(out)
    sources = list(sources)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"--out {out} could not be written: {one_line(e)}") from None
    try:
        yield tmp
        apply_umask(tmp)
        with interrupt_deferred():
            if check_out(out, kind, sources):  # the earlier output is moved aside, removed once replaced
                old = out.rename(out.with_name(f"{tmp.name}.old"))
                try:
                    os.replace(tmp, out)
                except BaseException:
                    old.rename(out)
                    raise
                shutil.rmtree(old)
            else:
                os.replace(tmp, out)  # onto nothing or an empty folder
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise OutputError(f"--out {out} could not be written: {one_line(e)}") from None
        raise
