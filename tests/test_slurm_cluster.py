"""The launchers against a real single-node SLURM (launch/local_slurm.sh: munged, slurmctld and slurmd started in a
temp dir): an array sweep of tiny CPU presets with a chained stage, preemption (SIGUSR1 before the time limit,
`scontrol requeue`) with requeue and exact resume, and a failing parent that never starts its chained stage.

Opt-in (LOGO_TEST_SLURM=1) and skipped where `sbatch` is not installed; test_launch.py covers the same scripts with stand-ins.
"""
import subprocess

import pytest

from slurm_cluster import (assert_same_training, cluster, job, log_of, sh, skip_without_slurm, steps_logged, sweep,
                           wait_done, wait_for)

pytestmark = [pytest.mark.slow, skip_without_slurm]
STEPS = 6
RUN = [f"train.steps={STEPS}", "checkpoint.interval=3"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from cluster(tmp_path_factory, port=17817)


@pytest.fixture(scope="module")
def tiny_sweep(env, tmp_path_factory):
    """launch/sweep.sh tiny: one array {tiny/full, tiny/logo}, then tiny/logo_ctx after tiny/logo (aftercorr)."""
    tmp = tmp_path_factory.mktemp("sweep")
    tasks = sweep(env, tmp, "tiny", "--throttle", "2", "--", *RUN)
    states = wait_done(env, [t for t, _, _ in tasks.values()])
    return tmp, tasks, states


def test_array_of_two_presets_runs_each_in_its_own_run_directory(env, tiny_sweep):
    tmp, tasks, states = tiny_sweep
    (full, full_dir, _), (logo, logo_dir, _) = tasks["tiny/full"], tasks["tiny/logo"]
    assert full.split("_")[0] == logo.split("_")[0] and full != logo  # two tasks of one array job
    assert job(env, full)["ArrayTaskThrottle"] == "2"
    for task_id, run_dir in ((full, full_dir), (logo, logo_dir)):
        assert states[task_id] == "COMPLETED"
        assert steps_logged(run_dir) == STEPS and (run_dir / "checkpoints" / f"step_{STEPS:08d}").is_dir()
        assert "training finished" in log_of(tmp, task_id)
    assert (full_dir.name, logo_dir.name) == ("tiny-full-smoke", "tiny-logo-smoke")


def test_chained_stage_starts_after_its_parent_task_succeeded(env, tiny_sweep):
    tmp, tasks, states = tiny_sweep
    logo, logo_dir, _ = tasks["tiny/logo"]
    ctx, ctx_dir, parent = tasks["tiny/logo_ctx"]
    assert parent == logo and ctx.split("_")[1] == logo.split("_")[1]  # same task id, aftercorr on the array
    assert job(env, ctx)["Dependency"] == "(null)" and states[ctx] == "COMPLETED"
    assert job(env, ctx)["StartTime"] >= job(env, logo)["EndTime"]
    assert f"initialized model and thresholds from {logo_dir}" in log_of(tmp, ctx)
    assert steps_logged(ctx_dir) == STEPS


@pytest.fixture(scope="module")
def preempted(env, tmp_path_factory):
    """tiny/logo twice: one sent SIGUSR1 through the batch shell (what --signal=B:USR1@N does), one requeued
    with `scontrol requeue` (SIGTERM to every process), both once they have logged a step."""
    runs = {}
    for how in ("usr1", "requeue"):
        tmp = tmp_path_factory.mktemp(how)
        (task, run_dir, _), = sweep(env, tmp, "tiny/logo", "--", *RUN).values()
        runs[how] = (tmp, task, run_dir)
    signalled = set()

    def signal_running():
        for how, (_, task, run_dir) in runs.items():
            if how not in signalled and 1 <= steps_logged(run_dir) < STEPS - 1:
                cmd = (["scancel", "--signal=USR1", "--batch", task] if how == "usr1" else
                       ["scontrol", "requeue", task])
                sh(env, *cmd)
                signalled.add(how)
        return len(signalled) == 2
    wait_for(signal_running, 1200, "both jobs to log a first step", every=0.5)
    states = wait_done(env, [task for _, task, _ in runs.values()])
    return runs, states


@pytest.mark.parametrize("how, markers", [
    ("usr1", ["SIGUSR1: asking every rank", "received SIGUSR1", "every rank saved and stopped after SIGUSR1",
              "requeueing job"]),
    ("requeue", ["SIGTERM (preemption, scancel or requeue)", "received SIGTERM", "DUE TO JOB REQUEUE"]),
])
def test_preempted_job_requeues_and_resumes_exactly(env, tiny_sweep, preempted, how, markers):
    runs, states = preempted
    tmp, task, run_dir = runs[how]
    log = log_of(tmp, task)
    assert states[task] == "COMPLETED" and job(env, task)["Restarts"] == "1", log[-3000:]
    for marker in markers:
        assert marker in log, (marker, log[-3000:])
    assert "start 1 on" in log and "resumed from" in log and "training finished" in log
    # the same per-step losses, learning rates and thresholds as the uninterrupted tiny/logo run of the sweep
    assert_same_training(tiny_sweep[1]["tiny/logo"][1], run_dir, STEPS)


def test_failing_parent_never_starts_its_chained_stage_and_retries_are_bounded(env, tmp_path):
    """Both pretraining tasks fail (their corpus does not exist): each is requeued once
    (LOGO_MAX_FAILED_RESTARTS=1), then left FAILED, and the chained stage never starts."""
    e = {**env, "LOGO_MAX_FAILED_RESTARTS": "1"}
    tasks = sweep(e, tmp_path, "tiny", "--", *RUN, "data=shards", f"data.path={tmp_path}/no_corpus")
    parents = [tasks["tiny/full"][0], tasks["tiny/logo"][0]]
    states = wait_done(env, parents)
    ctx, ctx_dir, _ = tasks["tiny/logo_ctx"]
    try:
        # slurmctld re-evaluates a pending job's reason on its next scheduling pass ("Dependency" until then).
        info = wait_for(lambda: (lambda i: i if i["Reason"] == "DependencyNeverSatisfied" else None)(job(env, ctx)),
                        120, f"{ctx} to be marked DependencyNeverSatisfied")
        for p in parents:
            log = log_of(tmp_path, p)
            assert states[p] == "FAILED" and job(env, p)["Restarts"] == "1", log[-3000:]
            assert "no_corpus" in log and "failed restart 1 of at most 1" in log
            assert "2 times in a row: not requeueing" in log
        assert info["JobState"] == "PENDING", info
        assert not ctx_dir.exists() and not list((tmp_path / "logs").glob(f"*-{ctx}.out"))
    finally:
        subprocess.run(["scancel", ctx.split("_")[0]], env=env)
