"""Fault injection: train.py as a subprocess killed at several points, launched twice, out of disk space, resumed
from a corrupt checkpoint or with a changed config. Each fault ends in one line or a clean exit, never a
traceback, with the last complete checkpoint intact; a restart continues bitwise equal to the uninterrupted run
(`sync_reference`, conftest.py). Faults in the writer come from tests/fault_entry.py (LOGO_FAULT)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (CKPT_ARGS, CKPT_STEPS, SLOW_BOX_TIMEOUT, TINY_RUN, logged, read_metrics, run_python,
                      run_train, same_rows, start_fault_train, wait_for_train)

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
    run_train(*ARGS, "train.steps=6", "run.extend=true", f"run.dir={d}", timeout=T)  # the next launch takes it


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
    from logo.run.checkpoint import CheckpointError
    from logo.train.checkpoint import Checkpointer
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


def link_run(src: Path, dst: Path, steps=None) -> Path:
    """A copy of the run directory `src` with only the checkpoints of `steps` (all when None): the checkpoint shards
    hard-linked (a run only reads them; a test that damages one breaks its link first), every other file copied (a
    resumed run rewrites metrics.jsonl in place, which through a link would change `src`, a session fixture)."""
    def keep(d, names):
        if Path(d).name == "checkpoints" and steps is not None:
            return [n for n in names if n not in {f"step_{s:08d}" for s in steps}]
        return []

    def copy(s, d):
        return os.link(s, d) if s.endswith(".distcp") else shutil.copy2(s, d)
    shutil.copytree(src, dst, copy_function=copy, ignore=keep)
    return dst


def damage(f: Path, how: str) -> None:
    """Damage a file without touching the original it may be linked to: 'overwrite' 1 MiB in place (size kept),
    'truncate' to half, 'garbage' (a few bytes), 'remove'."""
    data = f.read_bytes()
    f.unlink()
    if how == "overwrite":
        mid = len(data) // 2
        data = data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + (1 << 20)]) + data[mid + (1 << 20):]
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "garbage":
        data = b"garbage"
    if how != "remove":
        f.write_bytes(data)


def snapshot(d: Path) -> dict:
    """Every file of a directory tree and its bytes' sha256: what a refused launch must leave as it was."""
    import hashlib
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))
            if f.is_file()}


def test_checkpoints_carry_digests_of_every_file(sync_reference):
    import json
    from logo.run.checkpoint import verify
    for ck in sorted((sync_reference / "checkpoints").iterdir()):
        files = json.loads((ck / "digests.json").read_text())["files"]
        assert set(files) == {f.name for f in ck.iterdir() if f.name != "digests.json"} and "train_state.pt" in files
        assert verify(ck) == ""


@pytest.mark.parametrize("how", ["overwrite", "truncate", "remove"])
def test_damaged_latest_checkpoint_resumes_from_the_one_before(sync_reference, tmp_path, how):
    """The run stopped after step 4; its step-4 checkpoint is damaged afterwards (1 MiB overwritten in place,
    truncated, a shard gone): the same command names the damaged file, resumes from step 2 and reproduces the
    uninterrupted run's records bit for bit."""
    d = link_run(sync_reference, tmp_path / "run", steps=(2, 4))
    (d / "final_metrics.json").unlink()
    ck = d / "checkpoints" / "step_00000004"
    shard = max(ck.glob("*.distcp"), key=lambda f: f.stat().st_size)
    damage(shard, how)
    p = run_train(*ARGS, f"run.dir={d}", timeout=T)
    said = {"overwrite": "does not match its sha256", "truncate": "bytes, ", "remove": "is missing"}[how]
    assert f"checkpoint {ck} is damaged: {shard.name}" in p.stderr and said in p.stderr, p.stderr[-3000:]
    assert "resuming from" in p.stderr and "step_00000002" in p.stderr
    same_rows(read_metrics(sync_reference), read_metrics(d), range(1, N + 1))


def test_no_checkpoint_that_verifies_stops_in_one_line(sync_reference, tmp_path):
    d = link_run(sync_reference, tmp_path / "run", steps=(2,))
    (d / "final_metrics.json").unlink()
    ck = d / "checkpoints" / "step_00000002"
    damage(ck / "train_state.pt", "garbage")
    before = snapshot(d)
    line = one_line_error(run_train(*ARGS, f"run.dir={d}", check=False, timeout=T))
    assert f"no checkpoint of {d / 'checkpoints'} verifies (step_00000002: train_state.pt has 7 bytes" in line
    assert snapshot(d) == before


def test_non_finite_weights_stop_the_resume(tmp_path):
    """A checkpoint that verifies but holds NaN weights (saved from a diverged model) stops the load in one line."""
    import torch
    from logo.run.checkpoint import CheckpointError
    from logo.train.checkpoint import Checkpointer
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(3, model, opt, {"step": 3})
    ckpt.close()
    fresh = torch.nn.Linear(4, 4)
    with pytest.raises(CheckpointError, match=r"holds non-finite weights \(weight\): it was saved from a diverged run"):
        Checkpointer(tmp_path, keep=2).load(ckpt.latest_verified(), fresh, torch.optim.AdamW(fresh.parameters()))


def test_a_finished_run_stays_finished(sync_reference, tmp_path):
    """Launched again as it was, a finished run says so and changes nothing; other steps, init_from, resume=false,
    a missing data path are refused in one line naming the field, every file byte-identical; run.extend=true
    trains it further."""
    d = link_run(sync_reference, tmp_path / "run")
    before = snapshot(d)
    p = run_train(*ARGS, f"run.dir={d}", timeout=T)
    assert f"run {d} is already complete (step {N} of {N}); nothing was changed" in p.stderr, p.stderr[-2000:]
    assert snapshot(d) == before
    for extra, needle in ((["train.steps=7"], "invalid config train.steps / stage.tokens: they plan 7 steps"),
                          (["checkpoint.init_from=/tmp/nothing-here"], "invalid config checkpoint.init_from="),
                          (["checkpoint.resume=false"], "invalid config checkpoint.resume=false"),
                          (["data=shards", "data.path=/missing"], "invalid config data.path='/missing'")):
        line = one_line_error(run_train(*ARGS, *extra, f"run.dir={d}", check=False, timeout=T))
        assert needle in line, line
        assert snapshot(d) == before, extra
    p = run_train(*ARGS, "dry_run=true", f"run.dir={d}", timeout=T)
    assert "plan.json not written" in p.stdout and snapshot(d) == before
    run_train(*ARGS, f"train.steps={N + 1}", "run.extend=true", f"run.dir={d}", timeout=T)
    assert [r["step"] for r in read_metrics(d) if "loss" in r][-1] == N + 1
    assert json.loads((d / "final_metrics.json").read_text())["step"] == N + 1


def test_empty_validation_split_warns_then_stops_the_run(tmp_path, default_corpus):
    """A corpus prepared without a validation split warns at preparation; training with eval on it stops in one
    line naming eval.interval (no `eval 0.0000 (ppl 1.00)`)."""
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(f"document {i}: " + "some words " * 50 for i in range(20)))
    prep = run_python([sys.executable, "-m", "data.prepare", str(src), "--out", str(tmp_path / "corpus"),
                       "--val-fraction", "0"], timeout=T)
    assert prep.returncode == 0, prep.stderr[-2000:]
    assert "the validation split is empty" in prep.stderr
    line = one_line_error(run_train(*TINY_RUN, "train.steps=2", "eval.interval=1", "data=shards",
                                    f"data.path={tmp_path / 'corpus'}", f"run.dir={tmp_path / 'run'}", check=False,
                                    timeout=T))
    assert "invalid config eval.interval=1: the 'val' split of" in line and "has 0 tokens" in line


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


def only_line(p, code: int = 2) -> str:
    """A refused launch's whole output is one line, with exit code `code`; returns it."""
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode == code and len(lines) == 1, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return lines[0]


def prepared_corpus(tmp_path: Path) -> Path:
    """A small corpus prepared with python -m data.prepare (train and validation splits, checksummed shards)."""
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(f"document {i}: " + "some words and numbers " * (20 + i) for i in range(60)))
    out = tmp_path / "corpus"
    prep = run_python([sys.executable, "-m", "data.prepare", str(src), "--out", str(out)], timeout=T)
    assert prep.returncode == 0, prep.stderr[-2000:]
    return out


def test_a_refused_launch_writes_nothing_even_when_its_data_fails_last(tmp_path):
    """A finished run whose corpus has a shard damaged afterwards: `run.extend=true train.steps=3` stops in one
    line naming the shard with every file of the run byte-identical (config.yaml and plan.json still plan the
    finished run, which stays finished); the same corpus into a new run.dir does not create it."""
    corpus = prepared_corpus(tmp_path)
    d, data = tmp_path / "run", ["data=shards", f"data.path={corpus}", "eval.interval=0"]
    run_train(*TINY_RUN, "train.steps=2", *data, f"run.dir={d}", timeout=T)
    shard = corpus / "train_00000.bin"
    damage(shard, "overwrite")
    before = snapshot(d)
    line = only_line(run_train(*TINY_RUN, "train.steps=3", "run.extend=true", *data, f"run.dir={d}", check=False,
                               timeout=T))
    assert line == f"error: shard {shard} is corrupted: its sha256 does not match the manifest", line
    assert snapshot(d) == before
    assert json.loads((d / "plan.json").read_text())["steps"] == 2
    fresh = tmp_path / "fresh"
    assert only_line(run_train(*TINY_RUN, "train.steps=3", *data, f"run.dir={fresh}", check=False,
                               timeout=T)) == line
    assert not fresh.exists()


def test_second_ctrl_c_aborts_at_once(sync_reference, tmp_path):
    """Ctrl-C while the checkpoint of step 4 is being written asks for a checkpoint after it; a second Ctrl-C
    stops at once (exit 130, one line): the half-written step 4 is not latest, step 2 is."""
    import signal
    import time
    from logo.train.checkpoint import Checkpointer
    d = tmp_path / "run"
    proc = start(d, "slow_write:4:300")
    wait_for_train(lambda: (d / "checkpoints" / "step_00000004.tmp").is_dir(), proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(1)
    assert proc.poll() is None  # the first Ctrl-C waits for the step's checkpoint
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == ("second interrupt: stopped at once, without a checkpoint; re-run the same "
                                    "command to resume from the last complete checkpoint")
    assert Checkpointer(d, 10).latest().name == "step_00000002"

