"""Fault injection: train.py as a subprocess killed at several points, launched twice, out of disk space, resumed
from a corrupt checkpoint or with a changed config. Each fault ends in one line or a clean exit, never a
traceback, with the last complete checkpoint intact; a restart continues bitwise equal to the uninterrupted run
(`sync_reference`, conftest.py). Faults in the writer come from tests/fault_entry.py (LOGO_FAULT)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import (CKPT_ARGS, CKPT_STEPS, SLOW_BOX_TIMEOUT, logged, read_metrics, run_train, same_rows,
                      start_fault_train, wait_for_train)

N, ARGS, T = CKPT_STEPS, CKPT_ARGS, SLOW_BOX_TIMEOUT


def names(d) -> list:
    return sorted(p.name for p in (Path(d) / "checkpoints").iterdir())


def start(run_dir, fault: str = "", *extra, release=None):
    return start_fault_train(*ARGS, *extra, f"run.dir={run_dir}", fault=fault, release=release)


def one_line_error(p) -> str:
    """The process failed with exit 2 and exactly one `error:` line, no traceback; returns that line."""
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr[-3000:]
    return lines[0]


def restart_continues_exactly(sync_reference, d, latest: str):
    from logo.train.checkpoint import Checkpointer
    assert Checkpointer(d, 10).latest().name == latest  # what the interrupted run left
    run_train(*ARGS, f"run.dir={d}", timeout=T)
    same_rows(read_metrics(sync_reference), read_metrics(d), range(1, N + 1))
    assert names(d) == [f"step_{s:08d}" for s in (2, 4, N)]  # no .tmp left


KILL_POINTS = {  # name: (fault, async mode, the condition to SIGKILL at)
    "mid_step": ("", "none", lambda d: logged(d, 3)),
    "during_dcp_write": ("slow_write:4:300", "none", lambda d: (d / "checkpoints" / "step_00000004.tmp").is_dir()),
    "between_write_and_rename": ("slow_rename:4:300", "async",
                                 lambda d: (d / "checkpoints" / "step_00000004.tmp" / "train_state.pt").exists()),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill(sync_reference, tmp_path, point):
    fault, mode, cond = KILL_POINTS[point]
    d = tmp_path / "run"
    proc = start(d, fault, f"checkpoint.async_mode={mode}")
    wait_for_train(lambda: cond(d), proc)
    proc.kill()
    proc.communicate(timeout=60)
    from logo.train.checkpoint import Checkpointer
    latest = Checkpointer(d, 10).latest()
    if point != "mid_step":
        assert latest.name == "step_00000002"
    restart_continues_exactly(sync_reference, d, latest.name)


def test_second_launch_into_the_same_run_dir_fails_naming_the_holder(sync_reference, tmp_path):
    d = tmp_path / "run"
    release = tmp_path / "release"
    first = start(d, "slow_write:2:300", release=release)  # stays alive until released
    try:
        wait_for_train(lambda: (d / ".lock").exists() and (d / ".lock").read_text().strip(), first)
        second = run_train(*ARGS, f"run.dir={d}", check=False, timeout=T)
        line = one_line_error(second)
        assert f"pid {first.pid} on host" in line and str(d) in line
        assert first.poll() is None  # the second launch ended while the first still held the directory
    finally:
        release.touch()
    out, err = first.communicate(timeout=T)
    assert first.returncode == 0, err[-3000:]
    rows = read_metrics(d)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, N + 1))  # one writer: no interleaved lines
    same_rows(read_metrics(sync_reference), rows, range(1, N + 1))
    assert not (d / ".lock").read_text().strip()  # released on exit
    run_train(*ARGS, "train.steps=6", f"run.dir={d}", timeout=T)  # the next launch takes it without a word


@pytest.mark.parametrize("mode", ["none", "async_pinned"])
def test_disk_full_during_save(sync_reference, tmp_path, mode):
    d = tmp_path / "run"
    p = run_train(*ARGS, f"checkpoint.async_mode={mode}", f"run.dir={d}", check=False, fault=True,
                  env={"LOGO_FAULT": "enospc:4"}, timeout=T)
    line = one_line_error(p)
    assert "step_00000004" in line and "No space left on device" in line and "GiB free" in line
    assert f"last complete checkpoint: {d / 'checkpoints' / 'step_00000002'}" in line
    assert names(d) == ["step_00000002"]  # the partial step_4.tmp removed
    if mode == "async_pinned":
        restart_continues_exactly(sync_reference, d, "step_00000002")


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_disk_full_on_a_real_small_filesystem(tmp_path, default_corpus):
    """A 64 MiB tmpfs cannot hold one checkpoint of the tiny model (~0.3 GiB): the OS's own ENOSPC."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "64m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    try:
        p = run_train(*ARGS, f"run.dir={mnt / 'run'}", check=False, timeout=T)
        line = one_line_error(p)
        assert "step_00000002" in line and "No space left on device" in line and "last complete checkpoint: none" in line
        assert names(mnt / "run") == []  # nothing left behind: the disk is not kept full
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_free_space_check_fails_before_writing(tmp_path):
    """The previous checkpoint is larger than the free space: the save fails before writing anything."""
    from logo.train.checkpoint import CheckpointError, Checkpointer
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "8m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    try:
        prev = mnt / "run" / "checkpoints" / "step_00000002"
        prev.mkdir(parents=True)
        (prev / ".metadata").write_bytes(b"\0")
        (prev / "train_state.pt").write_bytes(b"\0")
        (prev / "__0_0.distcp").write_bytes(b"\0" * (5 << 20))  # 5 MiB of 8: 3 MiB free
        with pytest.raises(CheckpointError, match=r"not enough disk space for the checkpoint of step 4 .* nothing "
                                                  r"was written; last complete checkpoint: .*step_00000002"):
            Checkpointer(mnt / "run", 3)._check_free_space(4)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_corrupt_latest_checkpoint_is_named(sync_reference, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(sync_reference / "checkpoints" / "step_00000002", d / "checkpoints" / "step_00000002")
    ck = d / "checkpoints" / "step_00000002"
    shard = next(ck.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated: a torn copy
    line = one_line_error(run_train(*ARGS, f"run.dir={d}", check=False, timeout=T))
    assert f"could not load checkpoint {ck}" in line
    (ck / "train_state.pt").write_bytes(b"garbage")
    line = one_line_error(run_train(*ARGS, f"run.dir={d}", check=False, timeout=T))
    assert f"checkpoint {ck} is corrupted: its train_state.pt cannot be read" in line


def test_config_drift_on_resume_names_the_fields(sync_reference, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(sync_reference / "checkpoints" / "step_00000002", d / "checkpoints" / "step_00000002")
    p = run_train(*ARGS, "attention.rho=0.25", "model.n_layers=2", "train.steps=7", "logging.interval=2",
                  f"run.dir={d}", check=False, timeout=T)
    line = one_line_error(p)
    assert "config drift on resume" in line and "attention.rho 0.5 -> 0.25" in line and "model.n_layers 4 -> 2" in line
    assert "train.steps" not in line and "logging" not in line and "run.dir=NEW_DIR" in line
    # model=small (the case): DCP's CheckpointException never gets through either
    line = one_line_error(run_train(*ARGS, "model=small", f"run.dir={d}", check=False, timeout=T))
    assert "config drift on resume" in line and "model." in line
    # allowed changes resume: more steps, another logging interval
    run_train(*ARGS, "train.steps=6", "logging.interval=2", f"run.dir={d}", timeout=T)
    assert names(d)[-1] == "step_00000006"
