"""Helpers for the tests against a throw-away SLURM brought up by launch/local_slurm.sh (not a test module)."""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT

LOCAL_SLURM = ROOT / "launch" / "local_slurm.sh"


def skip_reason():
    if os.environ.get("LOGO_TEST_SLURM") != "1":
        return ("real-SLURM tests are opt-in (they bring up slurmctld/slurmd and take minutes): "
                "set LOGO_TEST_SLURM=1; test_launch.py covers the launchers with stand-ins")
    if shutil.which("sbatch") is None:
        return "sbatch not installed (the stand-in tests in test_launch.py cover the launchers)"
    missing = [x for x in ("slurmctld", "slurmd", "munged") if shutil.which(x) is None]
    if missing or os.geteuid() != 0:
        return f"needs root and slurmctld, slurmd, munge to bring up a local SLURM (missing: {missing or 'root'})"
    return None


def cluster(tmp_path_factory, port: int, nodes: int = 1):
    """Bring up a cluster with its state in a temp dir; yields the environment for sbatch/squeue/scontrol."""
    d = tmp_path_factory.mktemp(f"slurm{nodes}")
    env = {**os.environ, "LOGO_SLURM_DIR": str(d), "LOGO_SLURM_PORT": str(port), "WANDB_MODE": "offline"}
    up = subprocess.run(["bash", str(LOCAL_SLURM), "up", "--nodes", str(nodes)], env=env, capture_output=True,
                        text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    env["SLURM_CONF"] = str(d / "slurm.conf")
    try:
        yield env
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "down"], env=env, capture_output=True, timeout=180)


def sh(env, *cmd, check=True) -> str:
    p = subprocess.run(list(cmd), env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)}: {p.stdout}{p.stderr}"
    return p.stdout


def sweep(env, tmp, *args) -> dict:
    """launch/sweep.sh with runs and logs under tmp; returns {preset: (task id, run dir, parent task id)}."""
    out = sh(env, "bash", str(ROOT / "launch/sweep.sh"), *args[:1], "--runs-dir", str(tmp / "runs"),
             "--log-dir", str(tmp / "logs"), *args[1:])
    rows = [ln.split() for ln in out.splitlines()]
    return {r[1]: (r[0], Path(r[2]), r[4] if len(r) > 4 else None) for r in rows}


def job(env, job_id: str) -> dict:
    """`scontrol show job` of one job (or array task `A_T`) as a dict of its Key=Value fields."""
    out = sh(env, "scontrol", "show", "job", "-o", job_id)
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_for(cond, timeout: float, what: str, every: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_done(env, job_ids, timeout=1500.0):
    """Wait until none of the jobs is pending, running or completing; returns their states."""
    states = lambda: {j: job(env, j)["JobState"] for j in job_ids}  # noqa: E731
    wait_for(lambda: all(s not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED") for s in states().values()),
             timeout, f"jobs {job_ids} to end (now {states()})", every=5)
    return states()


def log_of(tmp, task_id: str) -> str:
    (f,) = (tmp / "logs").glob(f"*-{task_id}.out")
    text = f.read_text()
    assert "error: scontrol requeue" not in text, text[-3000:]
    return text


def metrics(run_dir) -> list:
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def steps_logged(run_dir) -> int:
    try:
        return max((r["step"] for r in metrics(run_dir)), default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def assert_same_training(a_dir, b_dir, steps: int):
    """Per-step losses, learning rates, gradient norms, thresholds and ratios are identical (bitwise on CPU)."""
    a, b = metrics(a_dir), metrics(b_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    keys = [k for k in a[0] if k in ("loss", "lr", "grad_norm") or k.startswith(("logo/threshold", "logo/ratio"))]
    assert any(k.startswith("logo/threshold/") for k in keys)
    for ra, rb in zip(a, b):
        for k in keys:
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])


skip_without_slurm = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
