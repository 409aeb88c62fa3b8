"""SLURM launchers: the sweep submits every preset of a family and chains context-extension stages.

`sbatch` is not installed here: a stand-in on PATH records each call and answers job ids as `sbatch --parsable`
does ("<id>;<cluster>"), which is all launch/sweep.sh reads from it.
"""
import os
import subprocess

from conftest import ROOT

FAKE_SBATCH = """#!/usr/bin/env bash
n=$(( $(cat "$STATE/n" 2>/dev/null || echo 100) + 1 )); echo $n > "$STATE/n"; echo "$*" >> "$STATE/calls"
echo "$n;cluster"
"""


def run_sweep(tmp_path, *args):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(tmp_path)}
    return subprocess.run(["bash", str(ROOT / "launch" / "sweep.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_sweep_chains_context_extension_stages(tmp_path):
    p = run_sweep(tmp_path, "controlled_1.5b", "--", "data=shards", "data.path=/data/c")
    assert p.returncode == 0, p.stderr
    jobs = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        jobs[parts[1]] = (parts[0], parts[3] if len(parts) == 4 else None)
    presets = sorted(f"controlled_1.5b/{f.stem}" for f in (ROOT / "conf/experiment/controlled_1.5b").glob("*.yaml"))
    assert sorted(jobs) == presets
    for base in ("transformer", "inter_layer", "intra_layer", "logo"):
        j8, dep8 = jobs[f"controlled_1.5b/{base}"]
        j32, dep32 = jobs[f"controlled_1.5b/{base}_ctx32k"]
        j128, dep128 = jobs[f"controlled_1.5b/{base}_ctx128k"]
        assert (dep8, dep32, dep128) == (None, j8, j32)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == len(presets)
    logo32 = next(c for c in calls if "experiment=controlled_1.5b/logo_ctx32k" in c)
    assert f"--dependency=afterok:{jobs['controlled_1.5b/logo'][0]}" in logo32
    assert logo32.endswith("launch/slurm_train.sbatch experiment=controlled_1.5b/logo_ctx32k data=shards "
                           "data.path=/data/c")


def test_sweep_rejects_an_unknown_family(tmp_path):
    p = run_sweep(tmp_path, "no_such_family")
    assert p.returncode == 2 and "no experiment family 'no_such_family'" in p.stderr
    assert not (tmp_path / "calls").exists()


def test_slurm_script_parses():
    p = subprocess.run(["bash", "-n", str(ROOT / "launch" / "slurm_train.sbatch")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
