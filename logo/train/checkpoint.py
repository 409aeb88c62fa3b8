"""Distributed checkpoints (torch.distributed.checkpoint) that become visible only once complete.

Writing side; the folder layout and everything that reads it (resolve, verify, load, train state) is
`logo.run.checkpoint`.
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
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from logo.run.checkpoint import (MILESTONE, STEP_DIR, TRAIN_STATE, CheckpointError, agreed, check_finite,
                                 complete_checkpoints, dcp_load, first_line, newest_verified, quiet_dcp,
                                 read_train_state, resolve_checkpoint, root_cause, write_digests)
from logo.run.files import dir_bytes, fsync_dir, fsync_file, write_durably
from logo.run.ranks import barrier, rank, rank0_decides

log = logging.getLogger("logo")
ASYNC_MODES = ("none", "async", "async_pinned")
# An asynchronous save runs DCP's save on a background thread, outside `quiet_dcp`: its warning that it assumes one
# process (intended: a one-process run) is dropped where DCP raises it, for every save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning, module=r"torch\.distributed\.checkpoint")


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
        return complete_checkpoints(self.dir)

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
        if rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self._check_free_space(step)  # also the barrier before writing
        if not self._memory_checked:
            self._check_host_memory(model, optimizer)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        writer = FileSystemWriter(str(tmp), thread_count=self.writer_threads)
        blob = b""
        if rank() == 0:
            buf = io.BytesIO()
            torch.save(train_state, buf)  # a snapshot: the loop goes on changing the live objects
            blob = buf.getvalue()
        staging = None
        try:
            with quiet_dcp():
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
        if rank() == 0:
            # publishing (fsyncs, rename, pruning: deleting a large checkpoint takes seconds) runs after the
            # write on a side thread, not in the training loop; `upload` then covers both
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-publish")
            self._inflight.upload = self._publisher.submit(self._upload_then_publish, self._inflight, upload)
        self._inflight.stall_s = time.perf_counter() - t0
        if wait or self.async_mode == "none":
            self.wait()
            if self.async_mode == "none":
                barrier()  # every rank returns once the checkpoint is latest
        return time.perf_counter() - t_call

    def prestage(self, model, optimizer) -> float:
        """async_pinned: allocate (and on CUDA pin) the reused host buffers now, by staging the state once.
        Pinning gigabytes of host memory takes seconds and holds up the training thread's CUDA calls; done inside
        the first save it would lengthen the step after that save. The trainer calls this after the first
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
        if rank() == 0:
            self._prev_bytes = dir_bytes(p.final)
            gib = self._prev_bytes / 2**30
        now = time.perf_counter()
        stats = SaveStats(p.step, p.stall_s + now - t0, now - p.started, gib)
        self.finished.append(stats)
        if rank() == 0:
            log.info("checkpoint %s: stall %.2f s, write %.2f s, %.2f GiB", p.final, stats.stall_s, stats.write_s,
                     stats.gib)
        return stats

    def _upload_then_publish(self, p: _InFlight, upload: Future) -> None:
        upload.result()
        self._publish(p)

    def _publish(self, p: _InFlight) -> None:
        """train_state.pt, digests.json, fsync of every file and the folder, rename to step_N, fsync of
        checkpoints/, prune."""
        write_durably(p.tmp / TRAIN_STATE, p.train_state)
        if p.milestone:
            (p.tmp / MILESTONE).write_text(f"{p.step}\n")
        write_digests(p.tmp)
        for f in p.tmp.iterdir():  # DCP fsyncs its own files; this also covers ours and any writer's
            if f.is_file():
                fsync_file(f)
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
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _failed(self, step: int, e: BaseException) -> str:
        e = root_cause(e)
        return (f"checkpoint save of step {step} to {self.dir / f'step_{step:08d}'} failed "
                f"({type(e).__name__}: {first_line(e)}); {_free(self.dir)} free; the partial checkpoint was "
                f"removed; last complete checkpoint: {self.latest() or 'none'}")

    def _check_free_space(self, step: int) -> None:
        """Rank 0, before writing: the free space against the size of the latest checkpoint (the new one will
        be about as large): fail before writing when it cannot fit, warn when a second one would not."""
        def check():
            latest = self.latest()
            if latest is not None and self._prev_bytes is None:
                self._prev_bytes = dir_bytes(latest)
            need, free = self._prev_bytes or 0, shutil.disk_usage(self.dir).free
            if need and free < need:
                raise CheckpointError(
                    f"not enough disk space for the checkpoint of step {step} in {self.dir}: {_free(self.dir)} "
                    f"free, the previous checkpoint takes {need / 2**30:.2f} GiB; nothing was written; last "
                    f"complete checkpoint: {latest}; free space (or lower checkpoint.keep) and re-run")
            if need and free < 2 * need:
                log.warning("disk space is low for checkpoints in %s: %s free, a checkpoint takes %.2f GiB",
                            self.dir, _free(self.dir), need / 2**30)
        rank0_decides(check, (CheckpointError,), share_result=False)

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
        dcp_load(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        check_finite(model, path)
        return read_train_state(path)


class _KeptStateDictStager(StateDictStager):
    """DCP's tensor-copying stager with a `close` that keeps its host buffers and copy table; `release` frees."""

    def close(self) -> None:
        pass

    def release(self) -> None:
        super().close()


class ReusedStager(DefaultStager):
    """async_pinned: one stager for the whole run, so that its pinned host buffers are reused between saves.

    torch's `DefaultStager._stage` (2.11) closes its inner StateDictStager after every staging: that empties the
    host-buffer cache and the copy dispatch table, so a reused stager
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
