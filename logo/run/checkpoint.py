"""Checkpoint folders as training leaves them, read by training (resume, init_from), evaluation and export.

<run_dir>/checkpoints/step_00000100/      model + optimizer shards (DCP, `.metadata`), train_state.pt (the
                                          train state: step, LR scheduler, data-loader state, RNG states,
                                          budget controller, W&B run id, plan, config),
                                          MILESTONE (only in checkpoints kept out of the pruning),
                                          digests.json (size and sha256 of every other file)
Only complete folders (renamed from `step_N.tmp/` once written, see logo/train/checkpoint.py) are read. Before
anything is loaded the files are checked against digests.json (`verify`): `resolve_checkpoint` and
`newest_verified` pass over a damaged checkpoint to the newest one that verifies, saying so, and a checkpoint
named explicitly must verify.
"""
from __future__ import annotations

import json
import logging
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from data.format import atomic_write_json, file_sha256
from logo.run.ranks import is_dist, rank0_decides

log = logging.getLogger("logo")
STEP_DIR = re.compile(r"^step_(\d{8})$")
TRAIN_STATE = "train_state.pt"
MILESTONE = "MILESTONE"
DIGESTS = "digests.json"


class CheckpointError(RuntimeError):
    """A checkpoint path is missing, incomplete or unreadable, or a save failed; the message names it."""


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / TRAIN_STATE).exists() and (path / ".metadata").exists()


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """The complete (renamed) checkpoints of a run's checkpoints/ folder, oldest first."""
    d = Path(checkpoints_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if STEP_DIR.match(p.name) and is_complete(p))


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory a checkpoint folder belongs to (its parent for a folder outside a run's checkpoints/)."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def _hash_files(files: list[Path]) -> dict:
    """name -> sha256 of each file, several at once (hashlib releases the GIL on large reads)."""
    if not files:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(files)), thread_name_prefix="ckpt-digest") as pool:
        return dict(zip((f.name for f in files), pool.map(file_sha256, files)))


def write_digests(folder: Path) -> None:
    """digests.json: the size and sha256 of every other file of a checkpoint folder, written (and fsynced) last."""
    files = sorted(f for f in Path(folder).iterdir() if f.is_file() and f.name != DIGESTS)
    sha = _hash_files(files)
    entries = {f.name: {"bytes": f.stat().st_size, "sha256": sha[f.name]} for f in files}
    atomic_write_json(Path(folder) / DIGESTS, {"algorithm": "sha256", "files": entries})


_verified: dict = {}  # (folder, digests.json's mtime_ns) -> the verdict of `verify`


def verify(folder: Path) -> str:
    """'' when every file listed in the folder's digests.json is there with its size and sha256 (a checkpoint
    without digests.json, written by an older version, passes with a warning), else one line saying what does
    not match. Remembered per folder and digests file, so a checkpoint is hashed once per process."""
    folder = Path(folder)
    digests = folder / DIGESTS
    if not digests.exists():
        log.warning("checkpoint %s has no %s (written by an older version): its files are not verified", folder,
                    DIGESTS)
        return ""
    key = (str(folder.resolve()), digests.stat().st_mtime_ns)
    if key not in _verified:
        _verified[key] = _check_digests(folder, digests)
    return _verified[key]


def _check_digests(folder: Path, digests: Path) -> str:
    try:
        entries = json.loads(digests.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {DIGESTS} cannot be read ({type(e).__name__})"
    present = []
    for name, want in sorted(entries.items()):
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, {want['bytes']} were written"
        present.append(f)
    sha = _hash_files(present)
    bad = next((name for name in sorted(sha) if sha[name] != entries[name]["sha256"]), None)
    return f"{bad} does not match its sha256 (damaged after it was written)" if bad else ""


def agreed(fn):
    """fn() on rank 0, its result (or its CheckpointError) on every rank: one rank reads the files, all decide
    alike."""
    return rank0_decides(fn, (CheckpointError,))


def read_train_state(path: Path, map_location=None) -> dict:
    """train_state.pt of a complete checkpoint (step, data position, config, ...), without loading the model."""
    try:
        return torch.load(Path(path) / TRAIN_STATE, weights_only=False, map_location=map_location)
    except Exception as e:  # noqa: BLE001 - a truncated or overwritten file raises anything
        raise CheckpointError(f"checkpoint {path} is corrupted: its {TRAIN_STATE} cannot be read "
                              f"({type(e).__name__}: {first_line(e)})") from None


def load_model_only(path: Path, model) -> None:
    """Model weights and buffers (LoGo thresholds included) of a checkpoint that verified (`resolve_checkpoint`);
    for context-extension stages."""
    path = resolve_checkpoint(path, verify_files=False)
    state = {"model": get_model_state_dict(model)}
    dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    check_finite(model, path)


def check_finite(model, path: Path) -> None:
    """CheckpointError (on every rank) when a loaded floating-point weight or buffer is not finite."""
    bad = [name for name, t in model.state_dict().items()
           if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(_local(t)).all())]
    flag = torch.tensor([1.0 if bad else 0.0], device=_device_of(model))
    if is_dist():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if bad or float(flag.max()):
        names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") if bad else \
            "on another rank"
        raise CheckpointError(f"checkpoint {path} holds non-finite weights ({names}): it was saved from a diverged "
                              f"run; move it out of {path.parent} to resume from the checkpoint before it")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _device_of(model) -> torch.device:
    return next((_local(p).device for p in model.parameters()), torch.device("cpu"))


def newest_verified(candidates: list[Path], where) -> Optional[Path]:
    """The newest of `candidates` (oldest first) that verifies, each one passed over logged in one line;
    None without candidates; CheckpointError when none verifies."""
    failures = []
    for path in reversed(candidates):
        why = verify(path)
        if not why:
            if failures:
                log.warning("resuming from %s, the newest checkpoint that verifies", path)
            return path
        failures.append(f"{path.name}: {why}")
        log.warning("checkpoint %s is damaged: %s; trying the one before it", path, why)
    if failures:
        raise CheckpointError(f"no checkpoint of {where} verifies ({'; '.join(failures)}): restore its files, or "
                              f"start a new run with run.dir=NEW_DIR")
    return None


def resolve_checkpoint(path, verify_files: bool = True) -> Path:
    """A complete checkpoint folder from a checkpoint path or a run directory (its newest checkpoint that
    verifies); CheckpointError else. A checkpoint folder named explicitly must verify."""
    path = Path(path)
    if path.is_dir() and (path / "checkpoints").is_dir():  # a run directory: take its newest good checkpoint
        done = complete_checkpoints(path / "checkpoints")
        if not done:
            raise CheckpointError(f"run directory {path} has no complete checkpoint")
        return newest_verified(done, path) if verify_files else done[-1]
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is not a complete checkpoint (it lacks {TRAIN_STATE} or "
                              f".metadata); pass a run directory or one of its checkpoints/step_* folders")
    why = verify(path) if verify_files else ""
    if why:
        raise CheckpointError(f"checkpoint {path} is damaged: {why}; pass its run directory to take the newest "
                              f"checkpoint that verifies")
    return path


@contextmanager
def quiet_dcp():
    """DCP logs full tracebacks (as warnings) before it raises; the CheckpointError we raise says it in one line.
    It also warns on every save and load without a process group that it assumes one process: that is intended
    here (training on one process, evaluation, export), so that warning is dropped too."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.CRITICAL + 1)  # DCP's loaders log through the root logger
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized",
                                    category=UserWarning)
            yield
    finally:
        root.setLevel(level)


def dcp_load(state: dict, path: Path) -> None:
    try:
        FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything
        raise CheckpointError(f"checkpoint {path} is corrupted: its .metadata cannot be read "
                              f"({type(e).__name__}: {first_line(e)})") from None
    try:
        with quiet_dcp():
            dcp.load(state, checkpoint_id=str(path))
    except BaseException as e:  # noqa: BLE001 - DCP raises many types (CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        e = root_cause(e)
        raise CheckpointError(f"could not load checkpoint {path}: {type(e).__name__}: {first_line(e)} "
                              f"(was it written by a different model config?)") from None


def root_cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (whose text is a traceback per rank), and
    in its chain the operating system's error if there is one (a full disk surfaces as a zip-writer error whose
    context is the ENOSPC)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return root_cause(inner)
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError) and cur.errno:
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return e


def first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""
