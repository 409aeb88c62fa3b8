"""One writer per run directory, and the config a resumed run must keep.

`RunLock`: rank 0 holds `<run_dir>/.lock` for the whole run, before anything is written there. The file
records the holder (host, pid, SLURM job id, start time, heartbeat). Where the filesystem supports `fcntl`
locks the kernel lock decides (a dead holder's lock is gone with it); otherwise the file's heartbeat, refreshed
by a background thread, does: a lock whose holder pid is gone on this host, whose holder is an earlier run of
this same SLURM job (a requeue), or whose heartbeat is older than `stale_after_s`, is taken over with a
warning. A live holder makes a second launch fail at once with one line naming it.

`config_drift`: the fields of the resolved config that change the model or the data order, compared with the
checkpoint's own copy before anything is loaded. `check_prior_run`: what a launch into a directory that already
holds a run may do (resume an unfinished run; a finished one stays finished unless it is extended).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from logo.config import ConfigError

log = logging.getLogger("logo")
LOCK_FILE = ".lock"
# Config keys (dotted prefixes) a resumed run may change: the budget and length of the run, how it is split,
# compiled, logged, checkpointed, evaluated and launched. Everything else must equal the checkpoint's config.
# The model.attention.* keys after train.activation_checkpointing are settings that older runs' config.yaml files
# still hold: resuming such a run is not drift.
RESUME_MAY_CHANGE = ("train.steps", "train.micro_batch", "train.compile", "train.activation_checkpointing",
                     "model.attention.recompute_branch_inputs", "model.attention.compile_glue",
                     "model.attention.fuse_rope", "model.attention.fuse_branches", "model.attention.fuse_context_norm",
                     "train.gc_interval", "train.loss", "model.attention.backend", "stage.tokens",
                     "stage.tokens_per_param", "data.prefetch", "logging.", "checkpoint.", "parallel.", "eval.",
                     "launch.", "run.", "dry_run", "experiment")


class RunDirLocked(RuntimeError):
    """Another live process writes to this run directory."""


class RunComplete(Exception):
    """The run directory holds a finished run and nothing asks to train it further: not an error, nothing to do."""


def check_prior_run(state: dict, latest: Path, init_from: str, extend: bool, plan_steps: int, run_dir: Path) -> None:
    """Before anything is written: the run's latest checkpoint's train state against this launch. init_from
    starts a new run, so it must be the run's own; a finished run (its step reached its own planned steps) raises
    RunComplete when launched again as it was, and refuses other planned steps unless `extend` (run.extend)."""
    saved = state.get("config") or {}
    own_init = (saved.get("checkpoint") or {}).get("init_from", "")
    if init_from != own_init:
        began = f"started from {own_init}" if own_init else "started from scratch"
        raise ConfigError(f"invalid config checkpoint.init_from={init_from!r}: {run_dir} already holds a run ({began}, "
                          f"latest checkpoint {latest.name}) and init_from only starts a new one: choose a new run.dir "
                          f"(or run.name), or set checkpoint.init_from={own_init!r} to resume it")
    step, own_steps = int(state["step"]), (state.get("plan") or {}).get("steps")
    if own_steps is None or step < own_steps:
        return  # unfinished: resume
    where = f"results in {run_dir} (final_metrics.json, metrics.jsonl, checkpoints/{latest.name})"
    if not extend:
        if plan_steps == own_steps:
            raise RunComplete(f"run {run_dir} is already complete (step {step} of {own_steps}); nothing was changed; "
                              f"{where}. To train it further: train.steps=N run.extend=true; to start over: "
                              f"run.dir=NEW_DIR")
        raise ConfigError(f"invalid config train.steps / stage.tokens: they plan {plan_steps} steps, but the finished "
                          f"run in {run_dir} planned {own_steps} and completed them; to train it further set "
                          f"run.extend=true (the learning-rate schedule is stretched to the new length), to start over "
                          f"choose a new run.dir; {where}")
    if plan_steps <= step:
        raise ConfigError(f"invalid config run.extend=true: the run in {run_dir} has already trained {step} steps and "
                          f"this launch plans {plan_steps}; set train.steps above {step}")


def _holder_info() -> dict:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": _slurm_job(),
            "started": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"), "heartbeat": now}


def _slurm_job() -> Optional[str]:
    job = os.environ.get("SLURM_JOB_ID")
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array else job


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(h: dict) -> str:
    job = f", SLURM job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
    return f"pid {h.get('pid')} on host {h.get('host')}{job}, started {h.get('started')}"


class RunLock:
    def __init__(self, run_dir: Path, stale_after_s: float = 600.0):
        self.path = Path(run_dir) / LOCK_FILE
        self.stale_after_s = stale_after_s
        self._fd: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.info = _holder_info()

    def acquire(self) -> RunLock:
        """Take the lock or raise RunDirLocked naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            kernel_lock, previous = self._claim(fd)
        except RunDirLocked:
            os.close(fd)
            raise
        if previous and previous.get("pid") != self.info["pid"]:
            log.warning("run directory %s: taking over the lock of %s, which is no longer running", self.path.parent,
                        describe(previous))
        self._fd = fd
        self._write()
        if not kernel_lock:
            self._thread = threading.Thread(target=self._heartbeat, name="logo-run-lock", daemon=True)
            self._thread.start()
        return self

    def check_free(self) -> None:
        """RunDirLocked naming the holder while a live process holds the lock; creates and changes nothing (a
        launch checks this before its other checks, and takes the lock only once they all pass)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            self._claim(fd)
        finally:
            os.close(fd)  # closing drops the kernel lock the check may have taken

    def _claim(self, fd: int) -> tuple[bool, Optional[dict]]:
        """(whether the kernel lock was taken, the previous holder's record) for the open lock file `fd`;
        RunDirLocked while a live process holds it."""
        previous = self._read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            kernel_lock = True
        except OSError as e:
            busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            if busy and not (previous and self._same_job(previous)):
                raise RunDirLocked(self._busy(previous)) from None
            # ENOLCK / EOPNOTSUPP: the filesystem has no locks; or a network filesystem still holds the lock of
            # this job's previous run (a crashed node, SLURM requeue): decide by the file and its heartbeat
            kernel_lock = False
        previous = self._read(fd)  # as of now that we hold it (the holder may have just released it)
        if not kernel_lock and previous and not self._stale(previous):
            raise RunDirLocked(self._busy(previous))
        return kernel_lock, previous

    def _busy(self, h: Optional[dict]) -> str:
        who = describe(h) if h else "another process"
        return (f"run directory {self.path.parent} is in use by {who} (lock {self.path}); wait for it to finish, "
                f"stop it, or choose another run.dir / run.name")

    def _stale(self, h: dict) -> bool:
        if h.get("host") == self.info["host"] and not _pid_alive(int(h.get("pid", 0))):
            return True
        if self._same_job(h):
            return True  # an earlier run of this job (requeued): it has ended
        return time.time() - float(h.get("heartbeat", 0)) > self.stale_after_s

    def _same_job(self, h: dict) -> bool:
        """The holder is an earlier run of this SLURM job (SLURM ends a job before it requeues it)."""
        return bool(h.get("slurm_job_id")) and h.get("slurm_job_id") == self.info["slurm_job_id"] and \
            (h.get("host"), h.get("pid")) != (self.info["host"], self.info["pid"])

    @staticmethod
    def _read(fd: int) -> Optional[dict]:
        try:
            raw = os.pread(fd, 1 << 16, 0).decode()
            return json.loads(raw) if raw.strip() else None
        except (OSError, ValueError):
            return None

    def _write(self) -> None:
        self.info["heartbeat"] = time.time()
        data = json.dumps(self.info).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _heartbeat(self) -> None:
        period = max(1.0, min(60.0, self.stale_after_s / 4))
        while not self._stop.wait(period):
            try:
                self._write()
            except OSError as e:
                log.warning("run lock heartbeat failed: %s", e)

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            os.ftruncate(self._fd, 0)  # emptied, not removed: a waiting opener keeps the same file (inode)
        except OSError:
            pass
        os.close(self._fd)  # closing drops the kernel lock
        self._fd = None


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_drift(saved: dict, now: dict) -> list[str]:
    """`key old -> new` for every key outside RESUME_MAY_CHANGE whose value differs (or is new / gone)."""
    a, b = flatten(saved), flatten(now)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if any(key == p or (p.endswith(".") and key.startswith(p)) for p in RESUME_MAY_CHANGE):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            diffs.append(f"{key} {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
    return diffs
