"""Many nodes, simulated on one host: two slurmd started as nodes n1 and n2 of a local SLURM
(`launch/local_slurm.sh up --nodes 2`). srun starts one torchrun per "node", they meet at the c10d rendezvous on
the first node, and the batch shell's SIGUSR1 reaches every rank on both nodes.

Skipped where `sbatch` is not installed (CI); test_launch.py checks the same command lines with stand-ins.
"""
import pytest

from slurm_cluster import cluster, job, log_of, metrics, sh, skip_without_slurm, steps_logged, sweep, wait_done, wait_for

pytestmark = [pytest.mark.slow, skip_without_slurm]
STEPS = 6


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from cluster(tmp_path_factory, port=17917, nodes=2)


def test_usr1_reaches_every_rank_on_every_node(env, tmp_path):
    """Two nodes x two ranks run tests/slurm_signal_probe.py under the batch script; `scancel --signal=USR1
    --batch` (what --signal=B:USR1@N sends) reaches all four Python processes, torchrun survives it, the job is
    requeued and its second start completes."""
    probe, logs = tmp_path / "probe", tmp_path / "logs"
    probe.mkdir(), logs.mkdir()
    out = sh({**env, "PROBE_DIR": str(probe)}, "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0",
             "--cpus-per-task=1", "--time=15", f"--output={logs}/probe-%j.out", "launch/slurm_train.sbatch",
             "--nproc-per-node", "2", "--script", "tests/slurm_signal_probe.py")
    job_id = out.strip().split(";")[0]
    wait_for(lambda: len(list(probe.glob("ready.*"))) == 4, 900, "four ranks to install their handlers")
    sh(env, "scancel", "--signal=USR1", "--batch", job_id)
    states = wait_done(env, [job_id], timeout=900)
    log = (logs / f"probe-{job_id}.out").read_text()
    assert states[job_id] == "COMPLETED" and job(env, job_id)["Restarts"] == "1", log
    got = {f.name: f.read_text().split() for f in probe.glob("rank*.0")}
    assert sorted(got) == [f"rank{r}.0" for r in range(4)], log
    assert all(sig == "SIGUSR1" for sig, _ in got.values()), got
    assert sorted(node for _, node in got.values()) == ["n1", "n1", "n2", "n2"]
    assert len(list(probe.glob("rank*.1"))) == 4  # the requeued job ran again on both nodes
    assert "--nnodes=2 --rdzv_backend=c10d" in log and "every rank saved and stopped after SIGUSR1" in log


def test_training_on_two_nodes_saves_on_usr1_and_resumes(env, tmp_path):
    (task, run_dir, _), = sweep(env, tmp_path, "tiny/logo", "--", f"train.steps={STEPS}", "checkpoint.interval=3",
                                "launch.nodes=2").values()
    wait_for(lambda: 1 <= steps_logged(run_dir) < STEPS - 1, 1200, "a first step", every=0.5)
    sh(env, "scancel", "--signal=USR1", "--batch", task)
    states = wait_done(env, [task])
    log = log_of(tmp_path, task)
    assert states[task] == "COMPLETED" and job(env, task)["Restarts"] == "1", log[-3000:]
    assert job(env, task)["NodeList"] == "n[1-2]"
    assert "--nnodes=2 --rdzv_backend=c10d" in log and "received SIGUSR1" in log and "resumed from" in log
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["logo/threshold_spread"] == 0.0 for r in rows)  # logged only with several ranks
    assert '"world_size": 2' in (run_dir / "plan.json").read_text()
