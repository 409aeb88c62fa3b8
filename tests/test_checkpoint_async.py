"""Asynchronous checkpoints (checkpoint.async_mode): the same run, checkpoints and resume as synchronous saves;
a kill or SIGTERM while a background write is in flight; time-based saves agreed across ranks; milestones."""
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import (CKPT_ARGS, CKPT_STEPS, SLOW_BOX_TIMEOUT, TINY_RUN, logged, read_metrics, run_train,
                      same_rows, start_fault_train, wait_for_train)

N, ARGS, T = CKPT_STEPS, CKPT_ARGS, SLOW_BOX_TIMEOUT


def ckpt_names(d) -> list:
    return sorted(p.name for p in (Path(d) / "checkpoints").iterdir())


def final_model(d, tmp_path, name) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(Path(d) / "checkpoints" / f"step_{N:08d}"), str(out))
    return torch.load(out, weights_only=False)


def test_sync_run_logs_checkpoint_cost(sync_reference):
    rows = {r["step"]: r for r in read_metrics(sync_reference)}
    for s in (2, 4, 5):  # synchronous: each save's figures are in its own step's record
        r = rows[s]
        assert r["checkpoint/step"] == s and r["checkpoint/gib"] > 0
        assert r["checkpoint/write_s"] >= r["checkpoint/stall_s"] * 0.99 > 0
    assert "checkpoint/step" not in rows[1]


def test_async_run_and_resume_equal_sync(sync_reference, tmp_path):
    """The default async_pinned mode end to end (`test_checkpoint_holds_the_state_of_its_step` checks every mode's
    saved state bitwise)."""
    mode = "async_pinned"
    d = tmp_path / "run"
    run_train(*ARGS, f"checkpoint.async_mode={mode}", f"run.dir={d}", timeout=T)
    assert ckpt_names(d) == ckpt_names(sync_reference) == [f"step_{s:08d}" for s in (2, 4, 5)]
    same_rows(read_metrics(sync_reference), read_metrics(d), range(1, N + 1))
    a, b = final_model(sync_reference, tmp_path, "a"), final_model(d, tmp_path, "b")
    for part in ("model", "optim"):
        ta, tb = torch.utils._pytree.tree_leaves(a[part]), torch.utils._pytree.tree_leaves(b[part])
        assert len(ta) == len(tb) > 0
        for x, y in zip(ta, tb):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    saves = [r for r in read_metrics(d) if "checkpoint/step" in r]
    assert saves[-1]["checkpoint/step"] == N and all(r["checkpoint/gib"] > 0 for r in saves)
    # resume from the async checkpoint of step 2: steps 3-5 bitwise equal to the uninterrupted run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(d / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    run_train(*ARGS, f"checkpoint.async_mode={mode}", f"run.dir={resumed}", timeout=T)
    same_rows(read_metrics(sync_reference), read_metrics(resumed), range(3, N + 1))


def _start(run_dir, fault: str, *extra, release=None):
    return start_fault_train(*ARGS, *extra, f"run.dir={run_dir}", fault=fault, release=release)


def test_sigkill_during_background_write_keeps_previous_latest(sync_reference, tmp_path):
    """The write of step 4 is slow; training goes on (step 4 is logged after its save started, the loop reaches
    the final step's save, which waits for it), then SIGKILL: step 2 stays latest, step 4 never becomes visible,
    and the same command resumes from step 2 and continues bitwise equal."""
    d = tmp_path / "run"
    proc = _start(d, "slow_write:4:120", "checkpoint.async_mode=async")
    wait_for_train(lambda: logged(d, 4), proc)
    time.sleep(1)
    assert (d / "checkpoints" / "step_00000004.tmp").exists() and not (d / "checkpoints" / "step_00000004").exists()
    proc.kill()
    proc.communicate(timeout=60)
    from logo.train.checkpoint import Checkpointer
    assert Checkpointer(d, 10).latest().name == "step_00000002"
    p = run_train(*ARGS, "checkpoint.async_mode=async", f"run.dir={d}", timeout=T)
    assert "resumed from" in p.stderr + p.stdout and "step_00000002" in p.stderr + p.stdout
    same_rows(read_metrics(sync_reference), read_metrics(d), range(1, N + 1))
    assert ckpt_names(d) == [f"step_{s:08d}" for s in (2, 4, 5)]  # the stale step_4.tmp replaced


def test_sigterm_during_background_write_finishes_it_then_saves(tmp_path, default_corpus):
    """The write of step 2 is slow; SIGTERM arrives while it is in flight. The process waits for it (still alive
    and the write unfinished seconds later), and once the write goes on it completes it and saves again."""
    d = tmp_path / "run"
    release = tmp_path / "release"
    proc = _start(d, "slow_write:2:300", "checkpoint.async_mode=async_pinned", "checkpoint.interval=2",
                  release=release)
    try:
        tmp = d / "checkpoints" / "step_00000002.tmp"
        wait_for_train(lambda: logged(d, 2) and tmp.exists(), proc)  # the write of step 2 is in flight
        proc.send_signal(signal.SIGTERM)
        time.sleep(3)  # several steps' time: the signal is seen at the next step boundary
        assert proc.poll() is None and tmp.exists()  # waiting for the write
    finally:
        release.touch()
    out, err = proc.communicate(timeout=T)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM" in err + out and "Traceback" not in err
    names = ckpt_names(d)
    assert not any(n.endswith(".tmp") for n in names)
    steps = [int(n.split("_")[1]) for n in names]
    stopped = read_metrics(d)[-1]["step"]
    # step 2's write completed, then the emergency checkpoint at the step the signal was seen
    assert steps == [2, stopped] and 3 <= stopped < N


@pytest.mark.slow
def test_time_interval_same_step_on_every_rank_and_milestones_survive(tmp_path, default_corpus):
    """interval_minutes (rank 0's clock, agreed over ranks one step later: the flags' all-reduce started at a step is
    read at the next) saves at every step from the second on here; with keep=1 only the last and the token
    milestones (every 512 tokens = every 2 steps) remain. A disagreement would hang DCP."""
    d = tmp_path / "run"
    p = run_train(*TINY_RUN, "train.steps=5", "eval.interval=0", "checkpoint.interval=1000", "checkpoint.interval_minutes=0.00001",
              "checkpoint.keep=1", "checkpoint.keep_every_tokens=512", f"run.dir={d}", nproc=2, timeout=T)
    assert ckpt_names(d) == [f"step_{s:08d}" for s in (2, 4, 5)]
    for s in range(1, 6):  # one save per step from step 2 on, each finished once
        assert (p.stderr + p.stdout).count(f"checkpoint {d / 'checkpoints' / f'step_{s:08d}'}:") == (s > 1)
    for s in (2, 4):
        assert (d / "checkpoints" / f"step_{s:08d}" / "MILESTONE").exists()


def test_host_memory_check_names_the_mode():
    from logo.run.checkpoint import CheckpointError
    from logo.train.checkpoint import host_memory_check
    host_memory_check(2**30, 4, 8 * 2**30, "async_pinned")  # 4 GiB of 8: fine
    with pytest.raises(CheckpointError,
                       match=r"checkpoint.async_mode=async_pinned needs 8.0 GiB .*\(4 ranks x 2.0 GiB\)"):
        host_memory_check(2**31, 4, 8 * 2**30, "async_pinned")


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["none", "async", "async_pinned"])
def test_checkpoint_holds_the_state_of_its_step(tmp_path, device, mode):
    """The loop goes on (the next forward, backward and update) while a save is in flight; what is written is
    still, bitwise, the model and optimizer state of the saved step (async_pinned on CUDA: copied on a side
    stream during the next step's forward/backward, waited for before its update)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from logo.train.checkpoint import Checkpointer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        model(torch.randn(32, 64, device=device)).square().mean().backward()
        ckpt.wait_staging()  # as the trainer does before every update
        opt.step()
        opt.zero_grad()

    ckpt = Checkpointer(tmp_path, keep=2, async_mode=mode, writer_threads=2)
    step()
    expected = torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                                            get_state_dict(model, opt))
    ckpt.save(1, model, opt, {"step": 1})
    for _ in range(3):
        step()
    ckpt.close()
    assert ckpt.latest().name == "step_00000001" and ckpt.take_stats()[0].gib > 0
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh(torch.randn(2, 64, device=device)).sum().backward()
    fresh_opt.step()  # optimizer state to load into
    assert Checkpointer(tmp_path, keep=2).load(ckpt.latest(), fresh, fresh_opt)["step"] == 1
    got = get_state_dict(fresh, fresh_opt)
    la, lb = torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)
    assert len(la) == len(lb) > 4
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def step_and_save(ckpt, model, opt, step: int) -> None:
    """One training step of a toy model as the trainer orders it, then a save of that step."""
    model(torch.randn(4, 8)).sum().backward()
    ckpt.wait_staging()
    opt.step()
    opt.zero_grad()
    ckpt.save(step, model, opt, {"step": step})


def test_pinned_stager_survives_dcp_closing_it(tmp_path):
    """torch 2.11's DefaultStager closes its inner StateDictStager after every staging (and DCP may close a
    stager it is given): on the H100 the second async_pinned save failed with KeyError: <class 'type'>. The
    run's stager must still stage the next save, into the same host buffers."""
    from logo.train.checkpoint import Checkpointer
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(tmp_path, keep=3, async_mode="async_pinned")
    buffers = []
    for step in (1, 2, 3):
        step_and_save(ckpt, model, opt, step)
        ckpt.wait()
        stager = ckpt._pinned_stager()
        cache = stager._state_dict_stager._cached_storage_mapping
        buffers.append(cache[model.weight.untyped_storage()].data_ptr())
        stager._state_dict_stager.close()  # what torch 2.11's DefaultStager._stage does after each staging
        stager.close()  # what a DCP that closes the stagers it is given would do
    assert buffers[0] == buffers[1] == buffers[2]  # the host copy is reused, not reallocated
    ckpt.close()
    assert [s.step for s in ckpt.take_stats()] == [1, 2, 3]
    fresh = torch.nn.Linear(8, 8)
    Checkpointer(tmp_path, keep=3).load(ckpt.latest(), fresh, torch.optim.AdamW(fresh.parameters()))
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize("mode", ["async", "async_pinned"])
def test_publish_and_prune_run_off_the_training_loop(tmp_path, monkeypatch, mode):
    """Making a checkpoint latest (fsyncs, rename) and pruning old ones (deleting an 18 GiB checkpoint took ~7 s
    on the H100 VM) run on a side thread: the loop's stall does not include them."""
    import threading
    import time as time_

    from logo.train.checkpoint import Checkpointer
    threads = []
    real_prune = Checkpointer._prune

    def slow_prune(self):
        threads.append(threading.current_thread().name)
        time_.sleep(1.0)
        real_prune(self)

    monkeypatch.setattr(Checkpointer, "_prune", slow_prune)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(tmp_path, keep=1, async_mode=mode)
    for step in (1, 2, 3):
        step_and_save(ckpt, model, opt, step)
        deadline = time_.monotonic() + 60
        while ckpt.in_flight and time_.monotonic() < deadline:
            time_.sleep(0.05)
            ckpt.poll()
    ckpt.close()
    stats = ckpt.take_stats()
    assert [s.step for s in stats] == [1, 2, 3]
    assert all(s.stall_s < 0.5 for s in stats), [s.stall_s for s in stats]
    assert all(s.write_s >= 1.0 for s in stats)  # the publish is part of the write
    assert threads and all(t.startswith("ckpt-publish") for t in threads)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000003"]


def test_prestage_allocates_the_buffers_the_first_save_reuses(tmp_path):
    """async_pinned: `prestage` (after the first optimizer step) allocates the host copy, so the first save only
    copies into it; the other modes have nothing to allocate ahead."""
    from logo.train.checkpoint import Checkpointer
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert Checkpointer(tmp_path / "a", keep=1, async_mode="async").prestage(model, opt) == 0.0
    ckpt = Checkpointer(tmp_path / "p", keep=1, async_mode="async_pinned")
    assert ckpt.prestage(model, opt) > 0.0
    assert ckpt.prestage(model, opt) == 0.0  # once per process
    cache = ckpt._pinned_stager()._state_dict_stager._cached_storage_mapping
    before = cache[opt.state[model.weight]["exp_avg"].untyped_storage()].data_ptr()
    ckpt.save(1, model, opt, {"step": 1})
    ckpt.wait()
    assert cache[opt.state[model.weight]["exp_avg"].untyped_storage()].data_ptr() == before  # reused
    ckpt.close()
    fresh = torch.nn.Linear(8, 8)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    Checkpointer(tmp_path / "p", keep=1).load(ckpt.latest(), fresh, fresh_opt)
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state[fresh.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
