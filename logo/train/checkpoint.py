"""Distributed checkpoints (torch.distributed.checkpoint) that become visible only once complete.

<run_dir>/checkpoints/step_00000100/      model + optimizer shards (DCP), train_state.pt (rank 0: step,
                                          LR scheduler, data-loader state, RNG states, W&B run id),
                                          MILESTONE (only in checkpoints kept out of the pruning),
                                          digests.json (size and sha256 of every other file)
A checkpoint is written to `step_N.tmp/`; once every rank's write has finished (DCP's future) rank 0 adds
train_state.pt and digests.json, fsyncs the files and the folder, renames it to `step_N/` and fsyncs
`checkpoints/`; `latest()` only ever returns renamed directories. The last `keep` (plus the milestones) are kept.
Before anything is loaded the files are checked against digests.json (`verify`): `latest_verified()` and
`resolve_checkpoint` pass over a damaged checkpoint to the newest one that verifies, saying so, and a
checkpoint named explicitly must verify.

`async_mode` (docs/training.md, "Checkpoints"):
  none          dcp.save: the loop waits for the whole write.
  async         dcp.async_save: the state is copied to fresh host memory (the loop waits for the copy), then
                written by a background thread while training goes on.
  async_pinned  the same with one reused (pinned on CUDA) host buffer, filled by DCP's DefaultStager on a side
                stream while the next step's forward and backward run; the loop waits for the copy only before
                that step's optimizer update (`wait_staging`). `prestage` allocates that buffer after the first
                optimizer step of the process, so no save pays for allocating and pinning it.
Rank 0 publishes a finished write (train_state.pt, fsyncs, rename, pruning) on a side thread.
At most one save is in flight: a new save, `wait()` and `close()` first finish the previous one.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from data.format import file_sha256

log = logging.getLogger("logo")
STEP_DIR = re.compile(r"^step_(\d{8})$")
TRAIN_STATE = "train_state.pt"
MILESTONE = "MILESTONE"
DIGESTS = "digests.json"
ASYNC_MODES = ("none", "async", "async_pinned")


class CheckpointError(RuntimeError):
    """A checkpoint path is missing, incomplete or unreadable, or a save failed; the message names it."""


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier():
    if _is_dist():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / TRAIN_STATE).exists() and (path / ".metadata").exists()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


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
    tmp = Path(folder) / (DIGESTS + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": "sha256", "files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(folder) / DIGESTS)


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
    result, error = None, ""
    if _rank() == 0:
        try:
            result = fn()
        except CheckpointError as e:
            error = str(e)
    if _is_dist():
        box = [result, error]
        dist.broadcast_object_list(box, src=0)
        result, error = box
    if error:
        raise CheckpointError(error)
    return result


@dataclass
class SaveStats:
    step: int
    stall_s: float  # the training loop was blocked (waiting for the previous save, planning, staging the copy)
    write_s: float  # from the start of the save until its files were on disk and renamed
    gib: float  # size of the checkpoint folder

    def metrics(self) -> dict:
        return {"checkpoint/step": self.step, "checkpoint/stall_s": self.stall_s, "checkpoint/write_s": self.write_s,
                "checkpoint/gib": self.gib}


@dataclass
class _InFlight:
    step: int
    tmp: Path
    final: Path
    upload: Future  # DCP's write of every rank's shards and .metadata
    staging: Optional[Future]  # async_pinned: the copy to host memory (before it, no optimizer update)
    train_state: bytes  # rank 0: torch.save of the train state, taken when the save started
    milestone: bool
    started: float
    stall_s: float


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int, async_mode: str = "none", writer_threads: int = 1,
                 process_group=None):
        """`process_group`: a gloo group for the background writes' collectives (DCP needs a CPU backend);
        None with one process."""
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.async_mode = async_mode
        self.writer_threads = writer_threads
        self.pg = process_group
        self._inflight: Optional[_InFlight] = None
        _quiet_writer_threads()
        self._stager = None  # async_pinned: one DefaultStager whose host buffers are reused between saves
        self._publisher: Optional[ThreadPoolExecutor] = None  # rank 0: fsyncs, rename and pruning after a write
        self._prestaged = False  # async_pinned: host buffers allocated by `prestage`
        self._memory_checked = async_mode == "none"
        self._prev_bytes: Optional[int] = None  # size of the last checkpoint (free-space check)
        self.finished: list[SaveStats] = []  # saves completed since the trainer last took them (take_stats)

    def complete(self) -> list[Path]:
        """The complete (renamed) checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and is_complete(p))

    def latest(self) -> Optional[Path]:
        done = self.complete()
        return done[-1] if done else None

    def latest_verified(self) -> Optional[Path]:
        """The newest complete checkpoint whose files match their digests (None when there is no checkpoint);
        each damaged one passed over is logged in one line. CheckpointError when none verifies. Rank 0 reads
        the files; every rank gets its answer."""
        return agreed(lambda: newest_verified(self.complete(), self.dir))

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def save(self, step: int, model, optimizer, train_state: dict, milestone: bool = False,
             wait: bool = False) -> float:
        """Start a checkpoint of this step (every rank); returns the seconds the caller was blocked. Finishes
        the previous save first. Synchronous mode, or `wait`: returns once the checkpoint is latest."""
        t_call = time.perf_counter()
        self.wait()  # its blocked time counts as the previous save's stall
        t0 = time.perf_counter()
        final = self.dir / f"step_{step:08d}"
        tmp = self.dir / f"step_{step:08d}.tmp"
        if _rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self._check_free_space(step)  # also the barrier before writing
        if not self._memory_checked:
            self._check_host_memory(model, optimizer)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        writer = FileSystemWriter(str(tmp), thread_count=self.writer_threads)
        blob = b""
        if _rank() == 0:
            buf = io.BytesIO()
            torch.save(train_state, buf)  # a snapshot: the loop goes on changing the live objects
            blob = buf.getvalue()
        staging = None
        try:
            with _quiet_dcp():
                if self.async_mode == "none":
                    dcp.save(state, storage_writer=writer)
                    upload = _done_future()
                elif self.async_mode == "async":
                    upload = dcp.async_save(state, storage_writer=writer, process_group=self.pg)
                else:
                    resp = dcp.async_save(state, storage_writer=writer, process_group=self.pg,
                                          async_stager=self._pinned_stager())
                    upload, staging = resp.upload_completion, resp.staging_completion
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
            self._discard(tmp)
            raise CheckpointError(self._failed(step, e)) from None
        self._inflight = _InFlight(step, tmp, final, upload, staging, blob, milestone, t0, 0.0)
        if _rank() == 0:
            # publishing (fsyncs, rename, pruning: deleting an 18 GiB checkpoint took ~7 s on the H100 VM) runs
            # after the write on a side thread, not in the training loop; `upload` then covers both
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-publish")
            self._inflight.upload = self._publisher.submit(self._upload_then_publish, self._inflight, upload)
        self._inflight.stall_s = time.perf_counter() - t0
        if wait or self.async_mode == "none":
            self.wait()
            if self.async_mode == "none":
                _barrier()  # every rank returns once the checkpoint is latest
        return time.perf_counter() - t_call

    def prestage(self, model, optimizer) -> float:
        """async_pinned: allocate (and on CUDA pin) the reused host buffers now, by staging the state once.
        Pinning 18.4 GiB took ~10 s on the H100 VM and held up the training thread's CUDA calls; done inside the
        first save it made the step after that save 10.8 s long. The trainer calls this after the first
        optimizer step of the process (AdamW's moments exist from then on). Returns the seconds it took."""
        if self.async_mode != "async_pinned" or self._prestaged:
            return 0.0
        self._prestaged = True
        t0 = time.perf_counter()
        if not self._memory_checked:
            self._check_host_memory(model, optimizer)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        staged = self._pinned_stager().stage({"model": model_sd, "optim": optim_sd})
        if isinstance(staged, Future):
            staged.result()
        return time.perf_counter() - t0

    def _check_host_memory(self, model, optimizer) -> None:
        """Before the first asynchronous save: does the node have memory for every local rank's host copy?
        Agreed over ranks, so that all of them fail together."""
        try:
            host_memory_check(local_state_bytes(model, optimizer), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                              available_host_memory(), self.async_mode)
            msg = ""
        except CheckpointError as e:
            msg = str(e)
        if self.pg is not None:
            msgs = [None] * dist.get_world_size(self.pg)
            dist.all_gather_object(msgs, msg, group=self.pg)
            msg = next((m for m in msgs if m), "")
        if msg:
            raise CheckpointError(msg)
        self._memory_checked = True

    def _pinned_stager(self):
        if self._stager is None:
            self._stager = ReusedStager(torch.cuda.is_available())
        return self._stager

    def wait_staging(self) -> float:
        """async_pinned: block until the in-flight save's host copy is complete (call before the optimizer
        updates the parameters); returns the seconds waited, which count as the save's stall."""
        p = self._inflight
        if p is None or p.staging is None:
            return 0.0
        t0 = time.perf_counter()
        self._result(p, p.staging)
        p.staging = None
        waited = time.perf_counter() - t0
        p.stall_s += waited
        return waited

    def _result(self, p: _InFlight, fut: Future) -> None:
        try:
            fut.result()
        except BaseException as e:  # noqa: BLE001 - a failed write: never latest, its .tmp removed
            if isinstance(e, KeyboardInterrupt):
                raise
            self._inflight = None
            self._discard(p.tmp)
            raise CheckpointError(self._failed(p.step, e)) from None

    def poll(self) -> None:
        """Finish the in-flight save if its write is done (no waiting for it)."""
        p = self._inflight
        if p is not None and p.upload.done() and (p.staging is None or p.staging.done()):
            self.wait()

    def wait(self) -> Optional[SaveStats]:
        """Block until the in-flight save (if any) is written, then make it latest (rank 0). The time blocked
        here counts as the save's stall."""
        p = self._inflight
        if p is None:
            return None
        t0 = time.perf_counter()
        if p.staging is not None:
            self._result(p, p.staging)
        self._result(p, p.upload)
        self._inflight = None
        gib = 0.0
        if _rank() == 0:
            self._prev_bytes = dir_bytes(p.final)
            gib = self._prev_bytes / 2**30
        now = time.perf_counter()
        stats = SaveStats(p.step, p.stall_s + now - t0, now - p.started, gib)
        self.finished.append(stats)
        if _rank() == 0:
            log.info("checkpoint %s: stall %.2f s, write %.2f s, %.2f GiB", p.final, stats.stall_s, stats.write_s,
                     stats.gib)
        return stats

    def _upload_then_publish(self, p: _InFlight, upload: Future) -> None:
        upload.result()
        self._publish(p)

    def _publish(self, p: _InFlight) -> None:
        """train_state.pt, digests.json, fsync of every file and the folder, rename to step_N, fsync of
        checkpoints/, prune."""
        with open(p.tmp / TRAIN_STATE, "wb") as f:
            f.write(p.train_state)
            f.flush()
            os.fsync(f.fileno())
        if p.milestone:
            (p.tmp / MILESTONE).write_text(f"{p.step}\n")
        write_digests(p.tmp)
        for f in p.tmp.iterdir():  # DCP fsyncs its own files; this also covers ours and any writer's
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(p.tmp)
        if p.final.exists():
            shutil.rmtree(p.final)
        os.replace(p.tmp, p.final)
        fsync_dir(self.dir)
        self._prune()

    def take_stats(self) -> list[SaveStats]:
        out, self.finished = self.finished, []
        return out

    def close(self) -> None:
        """Finish the in-flight save and release the staging buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.release()
                self._stager = None
            if self._publisher is not None:
                self._publisher.shutdown(wait=True)
                self._publisher = None

    def _discard(self, tmp: Path) -> None:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _failed(self, step: int, e: BaseException) -> str:
        e = _root_cause(e)
        return (f"checkpoint save of step {step} to {self.dir / f'step_{step:08d}'} failed "
                f"({type(e).__name__}: {_first_line(e)}); {_free(self.dir)} free; the partial checkpoint was "
                f"removed; last complete checkpoint: {self.latest() or 'none'}")

    def _check_free_space(self, step: int) -> None:
        """Rank 0, before writing: the free space against the size of the latest checkpoint (the new one will
        be about as large): fail before writing when it cannot fit, warn when a second one would not."""
        msg = ""
        if _rank() == 0:
            latest = self.latest()
            if latest is not None and self._prev_bytes is None:
                self._prev_bytes = dir_bytes(latest)
            need, free = self._prev_bytes or 0, shutil.disk_usage(self.dir).free
            if need and free < need:
                msg = (f"not enough disk space for the checkpoint of step {step} in {self.dir}: {_free(self.dir)} "
                       f"free, the previous checkpoint takes {need / 2**30:.2f} GiB; nothing was written; last "
                       f"complete checkpoint: {latest}; free space (or lower checkpoint.keep) and re-run")
            elif need and free < 2 * need:
                log.warning("disk space is low for checkpoints in %s: %s free, a checkpoint takes %.2f GiB",
                            self.dir, _free(self.dir), need / 2**30)
        if _is_dist():
            box = [msg]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
        if msg:
            raise CheckpointError(msg)

    def _prune(self):
        done = sorted(p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and not (p / MILESTONE).exists())
        for old in done[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model, optimizer) -> dict:
        """Restore model, optimizer and return the train state of a complete checkpoint that verified
        (`latest_verified`); CheckpointError when a loaded weight is not finite."""
        path = resolve_checkpoint(path, verify_files=False)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        check_finite(model, path)
        return read_train_state(path)


def read_train_state(path: Path) -> dict:
    """train_state.pt of a complete checkpoint (step, data position, config, ...), without loading the model."""
    try:
        return torch.load(Path(path) / TRAIN_STATE, weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or overwritten file raises anything
        raise CheckpointError(f"checkpoint {path} is corrupted: its {TRAIN_STATE} cannot be read "
                              f"({type(e).__name__}: {_first_line(e)})") from None


def load_model_only(path: Path, model) -> None:
    """Model weights and buffers (LoGo thresholds included) of a checkpoint that verified (`resolve_checkpoint`);
    for context-extension stages."""
    path = resolve_checkpoint(path, verify_files=False)
    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    check_finite(model, path)


def check_finite(model, path: Path) -> None:
    """CheckpointError (on every rank) when a loaded floating-point weight or buffer is not finite."""
    bad = [name for name, t in model.state_dict().items()
           if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(_local(t)).all())]
    flag = torch.tensor([1.0 if bad else 0.0], device=_device_of(model))
    if _is_dist():
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


def newest_verified(candidates: list[Path], where) -> Path:
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
        run = Checkpointer(path, 1)
        done = run.complete()
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


class _KeptStateDictStager(StateDictStager):
    """DCP's tensor-copying stager with a `close` that keeps its host buffers and copy table; `release` frees."""

    def close(self) -> None:
        pass

    def release(self) -> None:
        super().close()


class ReusedStager(DefaultStager):
    """async_pinned: one stager for the whole run, so that its pinned host buffers are reused between saves.

    torch 2.11's `DefaultStager._stage` closes its inner StateDictStager after every staging (read from 2.11's
    staging.py on the H100): that empties the host-buffer cache and the copy dispatch table, so a reused stager
    failed its second save with "KeyError: <class 'type'>" and would never have reused a buffer. Here the inner
    stager's close is a no-op and so is DCP's close of this one (DCP may close stagers it is given); the
    Checkpointer calls `release` at the end of the run."""

    def __init__(self, cuda: bool):
        # pinned memory, async staging thread, non-blocking copies on a side stream (CUDA only); no shared
        # memory (the writer is a thread of this process)
        super().__init__(StagingOptions(cuda, False, True, cuda))
        self._state_dict_stager = _KeptStateDictStager(pin_memory=cuda, share_memory=False)

    def close(self) -> None:
        pass

    def release(self) -> None:
        super().close()
        self._state_dict_stager.release()


def host_memory_check(state_bytes: int, ranks_per_node: int, available: int, mode: str) -> None:
    """An asynchronous save holds a host copy of every local rank's state: fail before staging when the node
    does not have that much memory available (a swapping or OOM-killed node loses the run)."""
    need = state_bytes * ranks_per_node
    if need > 0.9 * available:
        raise CheckpointError(
            f"checkpoint.async_mode={mode} needs {need / 2**30:.1f} GiB of host memory on this node "
            f"({ranks_per_node} ranks x {state_bytes / 2**30:.1f} GiB) but {available / 2**30:.1f} GiB is available; "
            f"use checkpoint.async_mode=none or fewer ranks per node")


def available_host_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (Linux); the physical memory elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_state_bytes(model, optimizer) -> int:
    """Bytes of this rank's shards of the parameters, buffers and optimizer state."""
    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    total = sum(nbytes(t) for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    for st in optimizer.state.values():
        total += sum(nbytes(v) for v in st.values() if isinstance(v, torch.Tensor))
    return total


@contextmanager
def _quiet_dcp():
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


def _dcp_load(state: dict, path: Path) -> None:
    try:
        FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything
        raise CheckpointError(f"checkpoint {path} is corrupted: its .metadata cannot be read "
                              f"({type(e).__name__}: {_first_line(e)})") from None
    try:
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=str(path))
    except BaseException as e:  # noqa: BLE001 - DCP raises many types (CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        e = _root_cause(e)
        raise CheckpointError(f"could not load checkpoint {path}: {type(e).__name__}: {_first_line(e)} "
                              f"(was it written by a different model config?)") from None


def _root_cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (whose text is a traceback per rank), and
    in its chain the operating system's error if there is one (a full disk surfaces as a zip-writer error whose
    context is the ENOSPC)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return _root_cause(inner)
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError) and cur.errno:
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return e


def _quiet_writer_threads() -> None:
    """DCP's extra writer threads (checkpoint.writer_threads > 1) let a write error escape to
    threading.excepthook, which prints a traceback per thread; the save itself fails too and is reported in one
    line (CheckpointError), so those threads' tracebacks are logged at debug level only. Other threads keep the
    previous hook."""
    import threading
    previous = threading.excepthook
    if getattr(previous, "_logo_dcp_quiet", False):
        return

    def hook(args):
        if args.thread is not None and "_write_files_from_queue" in args.thread.name:
            log.debug("checkpoint writer thread %s: %s: %s", args.thread.name, args.exc_type.__name__, args.exc_value)
            return
        previous(args)
    hook._logo_dcp_quiet = True
    threading.excepthook = hook


def _free(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.2f} GiB"
    except OSError:
        return "unknown space"


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""
