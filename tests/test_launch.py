"""SLURM launchers without a scheduler: what launch/sweep.sh submits and what launch/slurm_train.sbatch runs.

Stand-ins on PATH take the place of `sbatch` (records its arguments, answers job ids as `sbatch --parsable` does),
`srun` and `scontrol` (record their arguments); the tests against a running SLURM are in test_slurm_cluster.py.
"""
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

FAKE_SBATCH = """#!/usr/bin/env bash
n=$(( $(cat "$STATE/n" 2>/dev/null || echo 100) + 1 )); echo $n > "$STATE/n"; echo "$*" >> "$STATE/calls"
echo "$n;cluster"
"""
# srun: one argument a line into $STATE/srun, exits $SRUN_RC; with SRUN_WAIT it waits for SIGUSR1 (then ends its
# sleep, which holds the batch script's output open, and exits 0)
FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$STATE/srun"
if [ -n "${SRUN_WAIT:-}" ]; then
    trap 'echo USR1 >> "$STATE/srun_signals"; kill $!; exit 0' USR1
    touch "$STATE/srun_started"; sleep 30 & wait; exit 9
fi
exit "${SRUN_RC:-0}"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "$*" >> "$STATE/scontrol"
case "$1 $2" in
    "show hostnames") echo n7; echo n8 ;;
    "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=48"; echo "   NodeAddr=10.1.2.3 NodeHostName=$3" ;;
esac
"""


def _stand_ins(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(tmp_path)}


@pytest.fixture
def sweep(tmp_path, monkeypatch, capsys):
    """Run launch/sweep.py in this process against the stand-in sbatch; returns (exit code, task lines, calls)."""
    spec = importlib.util.spec_from_file_location("logo_sweep", ROOT / "launch" / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    for k, v in _stand_ins(tmp_path).items():
        monkeypatch.setenv(k, v)

    def run(*argv):
        rc = mod.main(["--log-dir", str(tmp_path / "logs"), *argv])
        out, err = capsys.readouterr()
        calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
        return rc, [ln.split() for ln in out.splitlines()], calls, err
    return run


def task_list(call: str) -> dict:
    """{task id: train.py arguments} of the task list an sbatch call names."""
    path = call.split("--tasks ")[1].split()[0]
    rows = [ln.split("\t") for ln in open(path).read().splitlines()]
    return {int(r[0]): r[1:] for r in rows}


def test_family_stages_are_arrays_chained_task_by_task(sweep):
    rc, lines, calls, err = sweep("controlled_1.5b", "--throttle", "3", "--", "data=shards", "data.path=/data/c")
    assert rc == 0, err
    assert len(calls) == 3  # 8k, 32k, 128k: one array each (all presets of a stage share their resources)
    assert [c.split()[1] for c in calls] == ["--array=0,1,2,3%3"] * 3
    for call in calls:
        for opt in ("--nodes=8", "--gpus-per-node=8", "--cpus-per-task=32", "--time=24:00:00"):
            assert opt in call.split()
        assert call.endswith("--nproc-per-node 8")
    assert "--dependency" not in calls[0]
    assert "--dependency=aftercorr:101" in calls[1] and "--dependency=aftercorr:102" in calls[2]
    jobs = {ln[1]: ln for ln in lines}
    for base in ("transformer", "inter_layer", "intra_layer", "logo"):
        t8, t32, t128 = (jobs[f"controlled_1.5b/{base}{s}"] for s in ("", "_ctx32k", "_ctx128k"))
        assert t8[0].startswith("101_") and len(t8) == 3
        # the chained stage has its parent's task id, in the next array, and says so
        assert t32[0] == "102_" + t8[0][4:] and t32[3:] == ["after", t8[0]]
        assert t128[0] == "103_" + t8[0][4:] and t128[3:] == ["after", t32[0]]
    lists = [task_list(c) for c in calls]
    i = int(jobs["controlled_1.5b/logo"][0].split("_")[1])
    assert lists[0][i] == ["experiment=controlled_1.5b/logo", "data=shards", "data.path=/data/c"]
    assert lists[1][i][:3] == ["experiment=controlled_1.5b/logo_ctx32k", "data=shards", "data.path=/data/c"]
    assert lists[1][i][3] == f"checkpoint.init_from={ROOT}/runs/controlled_1.5b-logo-pretrain_8k"


def test_resources_come_from_each_preset(sweep):
    rc, lines, calls, err = sweep("scaling")
    assert rc == 0, err
    by_nodes = {c.split("--nodes=")[1].split()[0]: task_list(c) for c in calls}
    presets = lambda n: sorted(args[0].split("=")[1] for args in by_nodes[n].values())  # noqa: E731
    assert sorted(by_nodes) == ["1", "2", "4"]
    assert presets("1") == [f"scaling/{s}_{a}" for s in ("200m", "470m") for a in ("full", "logo")]
    assert presets("2") == [f"scaling/{s}_{a}" for s in ("1.5b", "900m") for a in ("full", "logo")]
    assert presets("4") == ["scaling/3.3b_full", "scaling/3.3b_logo"]
    assert all("--dependency" not in c for c in calls) and len(lines) == 10


def test_the_mini_family_is_one_array_of_single_gpu_runs_per_seed(sweep, tmp_path):
    rc, lines, calls, err = sweep("mini", "--seeds", "0,1", "--runs-dir", str(tmp_path / "runs"))
    assert rc == 0, err
    assert len(calls) == 1 and calls[0].split()[1] == "--array=0,1,2,3,4,5,6,7"
    for opt in ("--nodes=1", "--gpus-per-node=1", "--cpus-per-task=8", "--time=01:00:00"):
        assert opt in calls[0].split()
    assert calls[0].endswith("--nproc-per-node 1")
    arms = ("inter_layer", "intra_layer", "logo", "transformer")
    assert sorted(ln[3] for ln in lines) == [f"{tmp_path}/runs/mini-{a}-mini_2k-seed{s}" for a in arms for s in (0, 1)]
    assert sorted(args[0] for args in task_list(calls[0]).values()) == sorted(f"experiment=mini/{a}" for a in arms
                                                                               for _ in (0, 1))


def test_one_preset_with_overridden_resources(sweep):
    rc, lines, calls, err = sweep("tiny/logo", "--", "launch.nodes=2", "launch.procs_per_node=3")
    assert rc == 0, err
    (call,) = calls
    assert "--array=0 " in call and "--nodes=2" in call and "--gpus-per-node=0" in call
    assert call.endswith("--nproc-per-node 3") and "--cpus-per-task=1" in call and "--time=00:20:00" in call
    assert lines == [["101_0", "tiny/logo", f"{ROOT}/runs/tiny-logo-smoke"]]


def test_seeds_get_their_own_run_directories_and_parents(sweep, tmp_path):
    runs = tmp_path / "runs"
    rc, lines, calls, err = sweep("tiny", "--seeds", "0,2", "--runs-dir", str(runs), "--", "train.steps=3")
    assert rc == 0, err
    first, ctx = (task_list(c) for c in calls)
    assert len(first) == 4 and len(ctx) == 2  # {full, logo} x {0, 2}, then logo_ctx x {0, 2}
    for args in first.values():
        preset, seed = args[0].split("/")[1], args[3].split("=")[1]
        name = f"tiny-{preset}-smoke-seed{seed}"
        assert args == [f"experiment=tiny/{preset}", "train.steps=3", f"train.seed={seed}", f"data.seed={seed}",
                        f"run.name={name}", f"run.dir={runs / name}"]
    for i, args in ctx.items():
        seed = args[2].split("=")[1]
        assert first[i][2] == f"train.seed={seed}" and first[i][0] == "experiment=tiny/logo"  # same id: the parent
        assert args[-1] == f"checkpoint.init_from={runs}/tiny-logo-smoke-seed{seed}"
        assert args[-2] == f"run.dir={runs}/tiny-logo_ctx-smoke_ctx-seed{seed}"
    assert sorted(ln[3] for ln in lines) == [f"{runs}/tiny-{p}-seed{s}" for p in
                                             ("full-smoke", "logo-smoke", "logo_ctx-smoke_ctx") for s in (0, 2)]


@pytest.mark.parametrize("argv, message", [
    (["no_such_family"], "no experiment family 'no_such_family'"),
    (["tiny", "--", "run.dir=/x"], "would give several runs one directory"),
    (["tiny", "--seeds", "1", "--", "train.seed=3"], "conflicts with --seeds"),
    (["tiny", "--", "launch.time=soon"], "preset tiny/full: invalid config launch.time='soon'"),
    (["tiny", "--", "launch.nodes=0"], "invalid config launch.nodes=0"),
])
def test_bad_input_is_one_line_and_submits_nothing(sweep, argv, message):
    rc, lines, calls, err = sweep(*argv)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not calls and not lines


def test_sweep_sh_runs_the_sweep_and_rejects_bad_seeds(tmp_path):
    env = {**os.environ, **_stand_ins(tmp_path)}
    p = subprocess.run(["bash", str(ROOT / "launch/sweep.sh"), "tiny", "--seeds", "a,b"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--seeds 'a,b'" in p.stderr and not (tmp_path / "calls").exists()


def test_every_paper_preset_splits_its_batch_over_its_gpus():
    """The `launch:` block of every preset gives a world size that divides its global batch."""
    from hydra import compose, initialize_config_dir
    from logo.run.config import register_configs, to_dataclass
    from logo.train.plan import make_plan
    register_configs()
    presets = sorted((ROOT / "conf/experiment").rglob("*.yaml"))
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        for f in presets:
            c = to_dataclass(compose("config", overrides=[f"experiment={f.parent.name}/{f.stem}"]))
            world = c.launch.nodes * (c.launch.procs_per_node or c.launch.gpus_per_node or 1)
            assert make_plan(c, world).steps > 0
            assert (c.launch.gpus_per_node == 0) == (f.parent.name == "tiny"), f


# --- launch/slurm_train.sbatch with stand-in srun/scontrol ---

def run_batch(tmp_path, *args, nodes=1, job=4242, env=None, background=False):
    e = {**os.environ, **_stand_ins(tmp_path), "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": str(job),
         "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": "n[7-8]" if nodes > 1 else "n7",
         "SLURM_CPUS_PER_TASK": "16", "SLURM_GPUS_ON_NODE": "8", "LOGO_RESTART_DIR": str(tmp_path / "restarts"),
         **(env or {})}
    cmd = ["bash", str(ROOT / "launch/slurm_train.sbatch"), *args]
    if background:
        return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=60)


def srun_args(tmp_path):
    return (tmp_path / "srun").read_text().splitlines()


def test_one_node_is_one_standalone_torchrun(tmp_path):
    p = run_batch(tmp_path, "experiment=tiny/logo", "train.steps=2")
    assert p.returncode == 0 and "training finished" in p.stdout, p.stdout + p.stderr
    a = srun_args(tmp_path)
    assert a[:4] == ["--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1"]
    assert a[7:] == ["torchrun", "torchrun", "--nproc_per_node=8", "--max_restarts=0", "--standalone",
                                          "train.py", "experiment=tiny/logo", "train.steps=2"]
    assert not (tmp_path / "scontrol").exists()  # no requeue after a finished run


def test_two_nodes_rendezvous_on_the_first_with_a_port_from_the_job_id(tmp_path):
    p = run_batch(tmp_path, "--nproc-per-node", "4", "experiment=x", nodes=2, job=123456)
    assert p.returncode == 0, p.stdout + p.stderr
    a = srun_args(tmp_path)
    assert a[0] == "--ntasks=2"
    assert a[7:] == [
        "torchrun", "torchrun", "--nproc_per_node=4", "--max_restarts=0", "--nnodes=2", "--rdzv_backend=c10d",
        f"--rdzv_endpoint=10.1.2.3:{10000 + 123456 % 20000}", "--rdzv_id=123456", "train.py", "experiment=x"]
    # torchrun is exec'd with SIGUSR1 ignored, so that the signal reaches its workers without killing it
    assert a[4:7] == ["bash", "-c", 'trap "" USR1; exec "$@"']
    assert "show node n7" in (tmp_path / "scontrol").read_text()


def test_array_task_takes_its_arguments_from_the_task_list(tmp_path):
    tasks = tmp_path / "a.tasks"
    tasks.write_text("0\texperiment=tiny/full\n3\texperiment=tiny/logo\tdata.path=/my dir\n")
    p = run_batch(tmp_path, "--tasks", str(tasks), "--nproc-per-node", "1", "train.steps=2",
                  env={"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_JOB_ID": "77"})
    assert p.returncode == 0, p.stdout
    assert srun_args(tmp_path)[-4:] == ["train.py", "experiment=tiny/logo", "data.path=/my dir", "train.steps=2"]
    p = run_batch(tmp_path, "--tasks", str(tasks), env={"SLURM_ARRAY_TASK_ID": "5"})
    assert p.returncode == 2 and f"task 5 is not in {tasks}" in p.stdout
    # a failed array task requeues itself as <array job>_<task>: its job id may be the array's, and
    # `scontrol requeue <array job id>` would requeue every task of the array
    p = run_batch(tmp_path, "--tasks", str(tasks), job=77,
                  env={"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_JOB_ID": "77", "SRUN_RC": "1"})
    assert p.returncode == 1 and (tmp_path / "scontrol").read_text() == "requeue 77_3\n", p.stdout


def test_failures_requeue_a_bounded_number_of_times(tmp_path):
    env = {"SRUN_RC": "1", "LOGO_MAX_FAILED_RESTARTS": "2", "SLURM_RESTART_COUNT": "0"}
    for attempt in (1, 2):
        p = run_batch(tmp_path, "experiment=x", env=env)
        assert p.returncode == 1 and f"failed restart {attempt} of at most 2" in p.stdout, p.stdout
        assert (tmp_path / "scontrol").read_text().splitlines()[-1] == "requeue 4242"
        assert (tmp_path / "restarts" / "4242").read_text().strip() == str(attempt)
    p = run_batch(tmp_path, "experiment=x", env=env)
    assert p.returncode == 1 and "3 times in a row: not requeueing" in p.stdout
    assert (tmp_path / "scontrol").read_text().count("requeue") == 2
    assert not (tmp_path / "restarts" / "4242").exists()


def test_usr1_is_forwarded_to_srun_then_the_job_requeues(tmp_path):
    proc = run_batch(tmp_path, "experiment=x", env={"SRUN_WAIT": "1"}, background=True)
    for _ in range(100):
        if (tmp_path / "srun_started").exists():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert (tmp_path / "srun_signals").read_text() == "USR1\n"
    assert "SIGUSR1: asking every rank" in out and "requeueing job 4242" in out
    assert (tmp_path / "scontrol").read_text().splitlines() == ["requeue 4242"]


def test_slurm_scripts_parse():
    for script in ("slurm_train.sbatch", "sweep.sh", "local_slurm.sh"):
        p = subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], capture_output=True, text=True)
        assert p.returncode == 0, (script, p.stderr)
