"""The run-directory lock (fcntl, and the heartbeat fallback for filesystems without locks) and config drift."""
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from logo.train.rundir import RunDirLocked, RunLock, config_drift


def test_one_holder_then_the_next(tmp_path):
    a = RunLock(tmp_path).acquire()
    with pytest.raises(RunDirLocked, match=rf"run directory {tmp_path} is in use by pid {os.getpid()} on host "
                                           rf"{socket.gethostname()}"):
        RunLock(tmp_path).acquire()  # flock: a second open file description of the same file conflicts
    a.release()
    RunLock(tmp_path).acquire().release()


def test_check_free_names_a_live_holder_and_changes_nothing(tmp_path):
    """The check a launch makes before reading a run directory: it creates no directory or lock file, names a
    live holder, and leaves a released lock file's bytes as they were."""
    RunLock(tmp_path / "new").check_free()
    assert not (tmp_path / "new").exists()
    a = RunLock(tmp_path).acquire()
    with pytest.raises(RunDirLocked, match=f"in use by pid {os.getpid()}"):
        RunLock(tmp_path).check_free()
    a.release()
    (tmp_path / ".lock").write_text('{"pid": 1, "host": "gone"}')  # a dead holder's record
    RunLock(tmp_path).check_free()
    assert (tmp_path / ".lock").read_text() == '{"pid": 1, "host": "gone"}'
    RunLock(tmp_path).acquire().release()  # the check held nothing


def test_a_killed_holder_is_taken_over_with_a_warning(tmp_path, caplog):
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from logo.train.rundir import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), root], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(RunDirLocked, match=f"pid {p.pid}"):
        RunLock(tmp_path).acquire()
    p.kill()
    p.wait()
    lock = RunLock(tmp_path).acquire()  # the kernel dropped the dead holder's lock
    assert f"taking over the lock of pid {p.pid}" in caplog.text
    lock.release()


@pytest.fixture
def no_fcntl_locks(monkeypatch):
    """A filesystem without lock support (some NFS and FUSE mounts): flock fails with ENOLCK."""
    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", flock)


def _write_holder(tmp_path, **kw):
    h = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": None, "started": "t0",
         "heartbeat": time.time(), **kw}
    (tmp_path / ".lock").write_text(json.dumps(h))


def test_without_fcntl_a_live_holder_blocks(tmp_path, no_fcntl_locks):
    _write_holder(tmp_path, pid=os.getppid())  # alive, fresh heartbeat
    with pytest.raises(RunDirLocked, match=f"pid {os.getppid()}"):
        RunLock(tmp_path).acquire()


def test_without_fcntl_stale_holders_are_taken_over(tmp_path, no_fcntl_locks, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_holder(tmp_path, pid=dead.pid)  # same host, pid gone
    RunLock(tmp_path).acquire().release()
    _write_holder(tmp_path, host="other-node", pid=1, heartbeat=time.time() - 3600)  # heartbeat too old
    RunLock(tmp_path, stale_after_s=600).acquire().release()
    _write_holder(tmp_path, host="other-node", pid=1)
    with pytest.raises(RunDirLocked, match="other-node"):
        RunLock(tmp_path, stale_after_s=600).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a requeued job: its earlier run on another node has ended
    _write_holder(tmp_path, host="other-node", pid=1, slurm_job_id="4242")
    lock = RunLock(tmp_path, stale_after_s=600).acquire()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_heartbeat_is_refreshed_without_fcntl(tmp_path, no_fcntl_locks):
    lock = RunLock(tmp_path, stale_after_s=4).acquire()  # refreshed every second
    first = json.loads((tmp_path / ".lock").read_text())["heartbeat"]
    time.sleep(2.5)
    assert json.loads((tmp_path / ".lock").read_text())["heartbeat"] > first
    lock.release()


def test_config_drift_ignores_allowed_fields():
    saved = {"model": {"dim": 64, "n_layers": 4}, "attention": {"rho": 0.5}, "train": {"steps": 5, "lr": 1},
             "logging": {"interval": 1}, "checkpoint": {"interval": 2}, "data": {"path": "a", "prefetch": True}}
    now = {"model": {"dim": 64, "n_layers": 2}, "attention": {"rho": 0.5, "new": 1}, "train": {"steps": 9, "lr": 1},
           "logging": {"interval": 10}, "checkpoint": {"interval": 5}, "data": {"path": "b", "prefetch": False}}
    assert config_drift(saved, now) == ["attention.new '<unset>' -> 1", "data.path 'a' -> 'b'",
                                        "model.n_layers 4 -> 2"]
    assert config_drift(saved, saved) == []
