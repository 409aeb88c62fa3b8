"""python -m launch.study: arguments, the GPU queue, the evaluations a run gets, Ctrl-C, and one whole study of the
`mini` family at the CPU size (slow)."""
import importlib.util
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_python, terminal_sigint, train_env


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


study = _module("logo_study", "launch/study.py")
study_eval = _module("logo_study_eval", "launch/study_eval.py")


@pytest.mark.parametrize("argv, message", [
    (["nofamily"], "no experiment family 'nofamily'"),
    (["mini/logo"], "'mini/logo' is one preset; a study runs a family"),
    (["tiny"], "preset tiny/logo_ctx starts from another run"),
    (["mini", "--size", "huge"], "--size 'huge': choose one of mini, tiny"),
    (["mini", "--seeds", "0,x"], "--seeds '0,x': give comma-separated integers"),
    (["mini", "--seeds", "1,1"], "--seeds '1,1': a seed is repeated"),
    (["mini", "--gpus", "-1"], "--gpus -1: must be >= 0"),
    (["mini", "--gpus", "x"], "--gpus: invalid int value: 'x'"),
    (["mini", "--runs-per-gpu", "0"], "--runs-per-gpu 0: must be >= 1"),
    (["mini", "--bogus"], "unrecognized arguments: --bogus"),
    (["mini", "--", "run.dir=/x"], "override 'run.dir=/x' would give several runs one directory"),
    (["mini", "--", "data.seed=4"], "override 'data.seed=4' conflicts with --seeds"),
    (["mini", "--", "model.dim=-3"], "preset mini/inter_layer: invalid config model.dim=-3"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys, tmp_path):
    rc = study.main([*argv[:1], "--log-dir", str(tmp_path / "logs"), *argv[1:]])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "logs").exists()


def test_more_gpus_than_visible_is_refused():
    import torch
    n = torch.cuda.device_count()
    with pytest.raises(study.StudyError, match=f"--gpus {n + 1}: only {n} GPU"):
        study.gpu_slots(n + 1)
    assert study.gpu_slots(0) == [""]  # the CPU: one slot, no GPU visible to the steps


def _probe(tmp_path, name: str, seconds: float, code: int = 0) -> "study.Step":
    """A step that prints the GPU it was given, sleeps, and exits with `code`."""
    cmd = [sys.executable, "-c", f"import os, time; print(os.environ['CUDA_VISIBLE_DEVICES']); "
                                 f"time.sleep({seconds}); raise SystemExit({code})"]
    return study.Step("train", cmd, tmp_path / f"{name}.log")


def test_the_queue_gives_each_job_one_free_gpu_and_runs_its_steps_there(tmp_path):
    jobs = [study.Job(f"j{i}", [_probe(tmp_path, f"j{i}a", 0.3), _probe(tmp_path, f"j{i}b", 0.1)])
            for i in range(5)]
    jobs[1].steps[0] = _probe(tmp_path, "j1a", 0.1, code=3)  # fails: its second step never runs
    events = []
    study.run_queue(jobs, ["2", "5"], study.launcher(),
                    lambda what, job, step, slot, code: events.append((what, job.name, step.log.stem, slot, code)),
                    poll_s=0.02)
    starts = [e for e in events if e[0] == "start"]
    assert starts[:2] == [("start", "j0", "j0a", "2", None), ("start", "j1", "j1a", "5", None)]  # queue order
    assert [s[2] for s in starts if s[1] == "j1"] == ["j1a"]
    assert ("end", "j1", "j1a", "5", 3) in events
    assert jobs[1].failed is jobs[1].steps[0] and jobs[1].code == 3
    assert all(j.failed is None and j.code == 0 for j in jobs if j.name != "j1")
    running: dict = {}
    for what, job, step, slot, _ in events:  # a GPU runs one step at a time, a job stays on its GPU
        if what == "start":
            assert slot not in running, events
            running[slot] = job
            assert (tmp_path / f"{step}.log").exists()
        else:
            assert running.pop(slot) == job
    for _, _, step, slot, _ in starts:  # the step saw only its own GPU
        header, seen = (tmp_path / f"{step}.log").read_text().splitlines()
        assert header.startswith("== ") and "time.sleep" in header  # the command, then its output
        assert seen == slot
    assert len(starts) == 9 and not running


def test_an_interrupted_queue_stops_its_running_steps(tmp_path):
    procs = []

    def start(step, slot):
        procs.append(study.launcher()(step, slot))
        return procs[-1]

    def event(what, job, step, slot, code):
        if job.name == "late" and what == "start":
            raise KeyboardInterrupt
    jobs = [study.Job("long", [_probe(tmp_path, "long", 60)]), study.Job("short", [_probe(tmp_path, "short", 0)]),
            study.Job("late", [_probe(tmp_path, "late", 0)])]
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        study.run_queue(jobs, ["0", "1"], start, event, poll_s=0.02)
    assert time.monotonic() - t0 < 30
    assert len(procs) == 2 and procs[0].returncode == -signal.SIGTERM


def test_a_run_is_evaluated_on_its_corpus_its_synthetic_sources_and_ruler_at_its_context():
    from hydra import compose, initialize_config_dir
    from logo.run.config import register_configs, to_dataclass
    assert set(study.SIZES) == set(study_eval.EVALS)
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = to_dataclass(compose("config", overrides=["experiment=mini/logo"]))
        tiny = to_dataclass(compose("config", overrides=["experiment=mini/logo", *study.SIZES["tiny"]]))
    cmds = study_eval.eval_commands("R", cfg, "mini")
    assert [c[0] for c in cmds] == ["perplexity", *["synthetic"] * 5, "ruler"]
    assert [c[c.index("--source") + 1] for c in cmds[1:6]] == ["copy_near", "recall_near", "recall", "needles",
                                                                "copy"]
    assert cmds[-1][cmds[-1].index("--lengths") + 1] == "1024,2048"
    assert all(c[1] == "R" and "--no-progress" in c for c in cmds)
    assert study_eval.eval_commands("R", tiny, "tiny")[-1][3] == "256"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_the_study_and_its_training_run(tmp_path, sig):
    p = subprocess.Popen([sys.executable, "-m", "launch.study", "mini", "--size", "tiny", "--seeds", "0",
                          "--runs-dir", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs"),
                          "--out", str(tmp_path / "report")], cwd=ROOT, env=train_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=terminal_sigint)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "start train" in line:
            break
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (lines, out, err)
    assert err.count("\n") == 1 and err.startswith("interrupted: the running steps were stopped"), err
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "runs") not in ps  # the training run it started is gone


@pytest.mark.slow
def test_the_tiny_study_trains_evaluates_and_reports_every_arm(tmp_path, capsys):
    """One seed of the four arms at the CPU size, their evaluations, then the family's report."""
    runs, logs, out = tmp_path / "runs", tmp_path / "logs", tmp_path / "report"
    p = run_python([sys.executable, "-m", "launch.study", "mini", "--size", "tiny", "--seeds", "0",
                    "--runs-dir", str(runs), "--log-dir", str(logs), "--out", str(out)], env=train_env(), timeout=900)
    lines = p.stdout.splitlines()
    assert lines[0].endswith(f"mini (tiny): 4 runs on the CPU; logs in {logs}")
    for arm in ("transformer", "inter_layer", "intra_layer", "logo"):
        run = runs / f"mini-{arm}-mini_tiny-seed0"
        assert any(f"done  train  mini/{arm} seed 0" in ln for ln in lines), p.stdout
        assert any(f"done  eval   mini/{arm} seed 0" in ln for ln in lines), p.stdout
        cfg = json.loads((run / "plan.json").read_text())
        assert cfg["steps"] == 2
        evals = sorted(f.name for f in (run / "eval").glob("*.json"))
        assert evals == ["perplexity.json", "ruler.json", "synthetic_copy.json", "synthetic_copy_near.json",
                         "synthetic_needle_retrieval.json", "synthetic_recall.json",
                         "synthetic_recall_near.json"], evals
        assert (run / "study_eval_tiny.json").is_file()
        ruler = json.loads((run / "eval" / "ruler.json").read_text())["results"]
        assert list(ruler["average"]) == ["256"] and sorted(ruler["scores"]) == ["mk_niah_1", "s_niah_1"]
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert (out / "report.md").is_file() and lines[-1].endswith(f"report: {out}/report.md")
    report = (out / "report.md").read_text()
    rows = [ln for ln in report.splitlines() if ln.startswith("| ")]
    for arm in ("Transformer", "inter-layer-H", "intra-layer-H", "LoGo"):
        assert any(ln.startswith(f"| {arm} ") for ln in rows), report
    assert (out / "ratio_check.csv").is_file() and (out / "span_allocation.csv").is_file()
    # evaluated again: nothing to do (the record names this checkpoint and these commands)
    run = runs / "mini-logo-mini_tiny-seed0"
    before = (run / "metrics.jsonl").read_text()
    assert study_eval.main([str(run), "--size", "tiny"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("nothing to do")
    assert (run / "metrics.jsonl").read_text() == before


def test_a_run_train_py_found_complete_is_reported_as_not_retrained(tmp_path, capsys):
    log = tmp_path / "r.train.log"
    log.write_text("== 2026-01-01 00:00:00 python train.py ...\nrun runs/r is already complete (step 2 of 2); "
                   "nothing was changed\n")
    fresh = tmp_path / "f.train.log"
    fresh.write_text("done: step 2 of 2\n")
    progress, job = study.Progress(), study.Job("mini/logo seed 0", [])
    progress("end", job, study.Step("train", [], log), "0", 0)
    progress("end", job, study.Step("train", [], fresh), "0", 0)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("done  train  mini/logo seed 0 (already complete: not retrained)")
    assert out[1].endswith("done  train  mini/logo seed 0")


def test_a_gpu_listed_twice_runs_two_jobs_at_once(tmp_path):
    """--runs-per-gpu 2 lists each GPU twice: two jobs share it, never three."""
    jobs = [study.Job(f"j{i}", [_probe(tmp_path, f"j{i}", 0.3)]) for i in range(5)]
    events = []
    study.run_queue(jobs, ["0", "1", "0", "1"], study.launcher(),
                    lambda what, job, step, slot, code: events.append((what, job.name, slot)), poll_s=0.02)
    starts = [e for e in events if e[0] == "start"]
    assert [s[2] for s in starts[:4]] == ["0", "1", "0", "1"]  # every GPU's first run, then the second ones
    busy: dict = {"0": 0, "1": 0}
    for what, _, slot in events:
        busy[slot] += 1 if what == "start" else -1
        assert 0 <= busy[slot] <= 2, events
    assert all(j.failed is None and j.code == 0 for j in jobs) and len(starts) == 5
