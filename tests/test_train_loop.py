"""End-to-end training runs on CPU (tiny model, embedded corpus, a few steps): metrics, checkpoints, resume,
NaN stop, SIGTERM, context-extension init, plots."""
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_RUN, read_metrics, run_python, run_train, scratch_dir, train_cmd

N = 8  # steps of the straight run; the resumed run restarts from step N/2
LAYERS = 4  # model=tiny


@pytest.fixture(scope="module")
def straight(tmp_path_factory, default_corpus):
    """N steps in one go, checkpoints every N/2 (kept), metrics every step."""
    with scratch_dir(tmp_path_factory, "straight") as d:
        p = run_train(*TINY_RUN, f"train.steps={N}", f"checkpoint.interval={N // 2}", "checkpoint.keep=10",
                      f"run.dir={d}")
        yield d, p


def test_run_writes_metrics_plan_config_and_checkpoints(straight):
    d, p = straight
    rows = read_metrics(d)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    for r in rows:
        for i in range(LAYERS):
            for k in ("ratio", "threshold", "gate_mean", "gate_std"):
                assert f"logo/{k}/layer_{i}" in r
        assert all(r[k] == r[k] for k in r)  # no NaN
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["lr"] == pytest.approx(plan_lr_min(d))  # cosine reaches the stage floor at the last step
    plan = json.loads((d / "plan.json").read_text())
    from logo.train.plan import Plan
    from logo.train.trainer import lr_factor
    # each record is its own step's, though the loop reads a logging step's figures one step later
    assert [r["lr"] for r in rows] == pytest.approx([plan["lr"] * lr_factor(s - 1, Plan(**plan)) for s in range(1, N + 1)])
    assert rows[-1]["tokens"] == N * plan["global_batch_tokens"]
    assert (plan["steps"], plan["micro_batch"], plan["grad_accum"], plan["global_batch_tokens"]) == (N, 2, 2, 256)
    assert (d / "config.yaml").exists() and (d / "ratio_heatmap.png").exists()
    ckpts = sorted(x.name for x in (d / "checkpoints").iterdir())
    assert ckpts == [f"step_{N // 2:08d}", f"step_{N:08d}"]
    # the console line carries the documented fields
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"step {N:>6}") or f"step {N:>6}/" in ln)
    for field in ("loss", "lr", "gnorm", "tok/s", "mem", "ratio"):
        assert field in line


def plan_lr_min(d):
    return json.loads((Path(d) / "plan.json").read_text())["lr_min"]


def test_resume_is_exact(straight, tmp_path):
    """N/2 steps then a restart of the same command == N steps straight (bitwise on CPU)."""
    d, _ = straight
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(d / "checkpoints" / f"step_{N // 2:08d}", resumed / "checkpoints" / f"step_{N // 2:08d}")
    p = run_train(*TINY_RUN, f"train.steps={N}", f"checkpoint.interval={N // 2}", "checkpoint.keep=10",
                  f"run.dir={resumed}")
    assert "resumed from" in p.stderr + p.stdout
    a = {r["step"]: r for r in read_metrics(d)}
    b = {r["step"]: r for r in read_metrics(resumed)}
    assert sorted(b) == list(range(N // 2 + 1, N + 1))
    for s in b:
        for k in a[s]:
            if k not in ("tokens_per_s", "memory_gib") and not k.startswith(("step_time", "checkpoint/")):  # timings
                assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])  # losses, lr, grad norm, thresholds, ratios
    # the final weights and thresholds are identical too
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    for name, src in (("a", d), ("b", resumed)):
        dcp_to_torch_save(str(src / "checkpoints" / f"step_{N:08d}"), str(tmp_path / f"{name}.pt"))
    sa = torch.load(tmp_path / "a.pt", weights_only=False)["model"]
    sb = torch.load(tmp_path / "b.pt", weights_only=False)["model"]
    assert sa.keys() == sb.keys() and any(k.endswith("threshold") for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_a_stop_signal_saves_and_the_same_command_resumes(straight, tmp_path):
    """Ctrl-C (SIGINT) as SIGTERM: the step ends, a checkpoint is saved, one line says so, exit 0, with no library
    warning and no progress bar in the (non-terminal) output; the same command resumes. (SIGTERM takes the same
    handler; test_checkpoint_async.py sends it during a background write.)"""
    sig = signal.SIGINT
    d, _ = straight
    run_dir = tmp_path / "sig"
    args = [*TINY_RUN, f"train.steps={N}", "checkpoint.interval=1000", "logging.progress_bar=true",
            f"run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.Popen(train_cmd(*args), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    said = [ln for ln in err.splitlines() if f"received {sig.name}" in ln]
    assert len(said) == 1 and "checkpoint saved at step" in said[0], err[-3000:]
    assert "Traceback" not in err and "UserWarning" not in err, err[-3000:]  # DCP's one-process note dropped
    assert "train:" not in err and "\r" not in err  # no progress bar outside a terminal
    saved = sorted((run_dir / "checkpoints").iterdir())
    assert len(saved) == 1 and not saved[0].name.endswith(".tmp")
    k = int(saved[0].name.split("_")[1])
    assert 2 <= k < N  # stopped early, at a step boundary
    run_train(*args)  # the same command again: resumes and finishes
    a = {r["step"]: r["loss"] for r in read_metrics(d)}
    b = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    assert b == a  # steps 1..k from the first process, k+1..N after the restart; equal to the straight run


def test_checkpoints_off_saves_nothing_and_says_so(tmp_path, default_corpus):
    """checkpoint.enable=false (benchmarks): the run trains and logs, writes no checkpoint, not even at its end,
    and says so once at the start."""
    run_dir = tmp_path / "nock"
    p = run_train(*TINY_RUN, "train.steps=2", "checkpoint.interval=1", "checkpoint.enable=false", f"run.dir={run_dir}")
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    assert (p.stdout + p.stderr).count("checkpoint.enable=false: this run saves no checkpoint") == 1


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, default_corpus):
    # An absurd learning rate blows the weights up after the first step; step 2's loss is not finite.
    p = run_train(*TINY_RUN, "train.steps=5", "checkpoint.interval=1", "stage.lr=1e30", "stage.lr_min=1e29",
                  f"run.dir={tmp_path}", check=False)
    assert p.returncode != 0
    # the step-2 loss is still finite here, but its gradient is not: either stops the run
    assert "training diverged at step 2" in p.stderr and "(not finite)" in p.stderr
    assert "nan" in p.stderr.lower() or "inf" in p.stderr.lower()
    assert "Traceback" not in p.stderr
    ckpts = sorted(x.name for x in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step_00000001"]
    assert str(tmp_path / "checkpoints" / "step_00000001") in p.stderr
    from logo.run.checkpoint import is_complete
    assert is_complete(tmp_path / "checkpoints" / "step_00000001")


def test_init_from_loads_model_and_thresholds_only(straight, tmp_path):
    """A context-extension stage: weights + thresholds from the previous run, fresh optimizer/schedule/data."""
    d, _ = straight
    prev = read_metrics(d)
    p = run_train(*TINY_RUN, "stage.seq_len=128", "stage.global_batch_tokens=512", "stage.rope_theta=100000",
                  "train.steps=2", f"checkpoint.init_from={d}", f"run.dir={tmp_path}")
    assert "initialized model and thresholds from" in p.stderr + p.stdout
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]  # fresh step count and schedule
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["pmask_steps"] == 0
    gamma = 0.01  # TINY_RUN's attention.gamma
    for i in range(LAYERS):  # the thresholds continue from the previous stage (one controller step later)
        assert abs(rows[0][f"logo/threshold/layer_{i}"] - prev[-1][f"logo/threshold/layer_{i}"]) <= gamma + 1e-6
    assert rows[0]["loss"] < prev[0]["loss"] - 0.5  # trained weights, not a fresh init
    from logo.train.plan import Plan
    from logo.train.trainer import lr_factor
    assert rows[0]["lr"] == pytest.approx(plan["lr"] * lr_factor(0, Plan(**plan)))  # a fresh schedule


def test_plot_metrics_script(straight, tmp_path):
    d, _ = straight
    p = run_python([os.sys.executable, "-m", "logo.analysis.plot_metrics", str(d), "--out", str(tmp_path)],
                   timeout=120)
    assert p.returncode == 0, p.stderr
    for name in ("loss.png", "ratio.png", "threshold.png", "gate.png", "ratio_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 1000
    bad = run_python([os.sys.executable, "-m", "logo.analysis.plot_metrics", str(tmp_path / "nope")], timeout=60)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
