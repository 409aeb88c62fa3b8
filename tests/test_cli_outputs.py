"""The commands that write (export, eval, report, prepare, sweep) on outputs they must not touch, on file systems
they cannot write, on records they cannot read, and on Ctrl-C: one line on stderr, exit code 2 (130 for Ctrl-C,
0 where the command succeeds), and every file they must not change byte-identical afterwards."""
import hashlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, scratch_dir, terminal_sigint
from data.prepare import main as prepare_main
from logo.eval.__main__ import main as eval_main
from logo.export.__main__ import main as export_main
from logo.report.__main__ import main as report_main
from report_fixtures import make_run as make_report_run
from test_data_fixtures import corpus_texts, write_jsonl
from test_export import make_run
import zygote

BIG_VOCAB = ("model.vocab_size=100277", "stage.seq_len=128")  # real tokens (the default corpus, RULER prompts)


def tree(root: Path) -> dict:
    """Every path under `root` (hidden ones too): the sha256 of a file's bytes, 'dir' for a folder."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*"))}


def without_info(err: str) -> str:
    """stderr less the INFO record of the tokenizer used (a machine without tiktoken's cache logs its fallback)."""
    return "".join(ln for ln in err.splitlines(keepends=True)
                   if not re.match(r"(\d\d:\d\d:\d\d INFO )?tokenizer: ", ln))


def one_error_line(code: int, err: str, want: int = 2) -> str:
    """The single line of stderr of a failed command with exit code `want`; fails otherwise."""
    assert code == want and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err.strip()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs/a: a LoGo run of the full vocabulary (evaluated on real text); runs/b: a small one; hf: an export
    of runs/b."""
    with scratch_dir(tmp_path_factory, "cli_outputs") as d:
        make_run(d / "runs" / "a", "logo", extra=BIG_VOCAB)
        make_run(d / "runs" / "b", "logo", seed=1)
        assert export_main([str(d / "runs" / "b"), "--out", str(d / "hf"), "--dtype", "fp32"]) == 0
        yield d


def export(argv, capsys) -> tuple[int, str]:
    code = export_main([str(a) for a in argv])
    return code, capsys.readouterr().err


# --- export: --force replaces only an earlier export -------------------------------------------------------------

def test_export_into_its_own_run_or_a_folder_of_runs_is_refused(runs, capsys):
    before = tree(runs)
    run = runs / "runs" / "a"
    for out, why in ((run, f"holds the source {run / 'checkpoints'}"), (runs / "runs", "holds the source"),
                     (run / "checkpoints" / "hf", "is inside the source"), (runs / "hf", "is the source")):
        src = runs / "hf" if out == runs / "hf" else run
        line = one_error_line(*export([src, "--out", out, "--force"], capsys))
        assert line.startswith(f"error: --out {out} ") and why in line, line
    (runs / "siblings").mkdir()  # a folder of runs that are not the source: none is deleted
    shutil.copytree(runs / "runs" / "b", runs / "siblings" / "b")
    line = one_error_line(*export([run, "--out", runs / "siblings", "--force"], capsys))
    assert "holds files that are not an export's (b/)" in line, line
    shutil.rmtree(runs / "siblings")
    assert tree(runs) == before


def test_export_never_replaces_a_file_or_a_folder_of_other_files(runs, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    llama = tmp_path / "llama"  # a model folder that is not an export of this project
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    mixed = tmp_path / "mixed"  # an earlier export the user added a file to
    shutil.copytree(runs / "hf", mixed)
    (mixed / "README.md").write_text("my notes")
    before = tree(tmp_path)
    for out, why in ((notes, "is a file, not a folder"), (notes / "hf", f"{notes} is a file, not a folder"),
                     (llama, "holds a model folder (config.json)"), (mixed, "not an export's (README.md)")):
        line = one_error_line(*export([runs / "runs" / "b", "--out", out, "--force"], capsys))
        assert why in line and "Traceback" not in line, line
    assert tree(tmp_path) == before


def test_export_force_replaces_an_earlier_export_and_nothing_beside_it(runs, tmp_path, capsys):
    out = tmp_path / "hf"
    shutil.copytree(runs / "hf", out)
    (tmp_path / "beside.txt").write_text("keep me")
    line = one_error_line(*export([runs / "runs" / "b", "--out", out], capsys))
    assert "holds an earlier export; pass --force to replace it" in line
    assert export_main([str(runs / "runs" / "b"), "--out", str(out), "--dtype", "bf16", "--force"]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith(f"exported {runs / 'runs' / 'b'} -> {out}: ") and stdout.count("\n") == 1, stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beside.txt", "hf"]  # no temporary folder left
    assert (tmp_path / "beside.txt").read_text() == "keep me"


def test_export_where_nothing_can_be_written(runs, capsys):
    before = tree(runs)
    line = one_error_line(*export([runs / "runs" / "b", "--out", "/proc/logo-export"], capsys))
    assert line.startswith("error: --out /proc/logo-export could not be written: ") and "Errno" in line, line
    assert tree(runs) == before


# --- read-only file systems --------------------------------------------------------------------------------------

def read_only(path: Path, cmd: list) -> list:
    """`cmd` run where `path` is a read-only bind mount of itself, in a private mount namespace."""
    script = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh", str(path), *map(str, cmd)]


@pytest.fixture
def ro_dir(tmp_path):
    """An empty folder, and whether it can be made read-only here (root with `unshare`)."""
    d = tmp_path / "ro"
    d.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a read-only mount")
    probe = subprocess.run(read_only(d, ["sh", "-c", f"! touch {d}/probe 2>/dev/null"]), capture_output=True)
    if probe.returncode != 0 or (d / "probe").exists():
        pytest.skip(f"cannot make a read-only mount here: {probe.stderr.decode().strip()}")
    return d


def cli(module: str, *args) -> list:
    return [sys.executable, "-m", module, *map(str, args)]


def run_cli(cmd) -> subprocess.CompletedProcess:
    """`cmd` run to its end; stderr less the INFO records."""
    p = zygote.run(cmd, env={**os.environ, "WANDB_MODE": "offline"}, cwd=ROOT, timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout, without_info(p.stderr))


def test_writers_on_a_read_only_file_system(runs, ro_dir):
    """export, report and prepare into a read-only folder, eval of a run on a read-only mount: one line each."""
    reports = ro_dir.parent / "report_runs"
    make_report_run(reports, "r", losses=[3.0, 2.5])
    (ro_dir.parent / "a.jsonl").write_text(json.dumps({"text": "some text"}) + "\n")
    before = tree(runs)
    for cmd, why in ((cli("logo.export", runs / "runs" / "b", "--out", ro_dir / "hf"), "is not writable"),
                     (cli("logo.report", reports, "--out", ro_dir / "rep"), "is not writable"),
                     (cli("data.prepare", ro_dir.parent / "a.jsonl", "--out", ro_dir / "c"), "is not writable")):
        p = run_cli(read_only(ro_dir, cmd))
        assert why in one_error_line(p.returncode, p.stderr), p.stderr
    run = runs / "runs" / "a"
    p = run_cli(read_only(run, cli("logo.eval", "ruler", run, "--lengths", "100", "--tasks", "s_niah_1",
                                   "--samples", "1", "--max-new-tokens", "1", "--device", "cpu")))
    assert "Read-only file system" in one_error_line(p.returncode, p.stderr), p.stderr
    assert not list(ro_dir.iterdir()) and tree(runs) == before


# --- eval: span --out, unreadable corpora --------------------------------------------------------------------------

def test_span_out_replaces_only_an_earlier_span_folder(runs, tmp_path, capsys):
    run = runs / "runs" / "a"
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "thesis.tex").write_text("keep me")
    before, run_before = tree(tmp_path), tree(run)
    for out, why in ((run, "holds the source"), (run / "checkpoints" / "step_00000007" / "span", "is inside the source"),
                     (busy, "not a span analysis's (thesis.tex)"),
                     (text, "is the source"), (busy / "thesis.tex", "is a file"), (tmp_path, "holds the source")):
        code = eval_main(["span", str(run), "--text", str(text), "--out", str(out), "--device", "cpu"])
        assert why in one_error_line(code, capsys.readouterr().err)
    assert tree(tmp_path) == before and tree(run) == run_before
    for _ in range(2):  # new, then its own earlier output: replaced
        assert eval_main(["span", str(run), "--text", str(text), "--out", str(tmp_path / "span"), "--device",
                          "cpu"]) == 0
    assert sorted(p.name for p in (tmp_path / "span").iterdir()) == ["span_allocation.json", "span_allocation.png",
                                                                      "t_words.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "span", "t.txt"]


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"[1, 2]"])
def test_perplexity_on_an_unreadable_manifest_is_one_line(runs, tmp_path, capsys, content):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_bytes(content)
    before = tree(runs)
    code = eval_main(["perplexity", str(runs / "runs" / "a"), "--data", str(corpus), "--device", "cpu"])
    line = one_error_line(code, capsys.readouterr().err)
    assert f"{corpus / 'manifest.json'}" in line and ("cannot be read" in line or "not a JSON object" in line)
    assert tree(runs) == before


# --- Ctrl-C -----------------------------------------------------------------------------------------------------

def interrupted(cmd, ready, timeout: float = 240, env=None) -> tuple[int, str, str]:
    """Start `cmd` in its own process group, wait until ready(stdout so far, stderr so far) holds, press Ctrl-C
    (SIGINT to the group, as a terminal does); returns (exit code, stdout, stderr)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "TQDM_MININTERVAL": "0", **(env or {})}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True, preexec_fn=terminal_sigint)
    got, deadline = {p.stdout: b"", p.stderr: b""}, time.time() + timeout
    try:
        while not ready(got[p.stdout].decode(errors="replace"), got[p.stderr].decode(errors="replace")):
            assert p.poll() is None, f"exited {p.returncode} before it could be interrupted: {got[p.stderr][-2000:]}"
            assert time.time() < deadline, "timed out"
            for f in select.select([p.stdout, p.stderr], [], [], 0.02)[0]:
                got[f] += os.read(f.fileno(), 1 << 16)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, (got[p.stdout] + out).decode(), without_info((got[p.stderr] + err).decode(errors="replace"))


def after_bar(err: str) -> str:
    """stderr less the progress bar's frames (tqdm redraws with carriage returns, no newline)."""
    return err.rsplit("\r", 1)[-1]


@pytest.mark.parametrize("what", ["perplexity", "ruler"])
def test_ctrl_c_during_an_evaluation(runs, default_corpus, what):
    run = runs / "runs" / "a"
    before = tree(run)
    args = (["--tokens", "0"] if what == "perplexity" else
            ["--lengths", "100,128", "--tasks", "s_niah_1,s_niah_2", "--samples", "500"])
    code, out, err = interrupted(cli("logo.eval", what, run, *args, "--device", "cpu", "--progress"),
                                 lambda o, e: e.count("/s]") >= 2)  # the loop has drawn its bar twice
    assert code == 130 and out == "" and "Traceback" not in err and err.count("\n") == 1, err
    assert after_bar(err) == "interrupted: nothing was written\n", err
    assert tree(run) == before


def test_ctrl_c_during_an_export_leaves_the_earlier_one(runs, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(runs / "hf", out)
    before = tree(tmp_path)
    code, stdout, err = interrupted(cli("logo.export", runs / "runs" / "a", "--out", out, "--force"),
                                    lambda o, e: any(tmp_path.glob(".hf.tmp-*")))
    assert one_error_line(code, err, 130) == f"interrupted: nothing was exported ({out} is as it was)"
    assert stdout == "" and tree(tmp_path) == before


def test_ctrl_c_during_a_report(tmp_path):
    for i, size in enumerate(("200m", "470m", "900m")):
        for seed in range(2):
            make_report_run(tmp_path / "runs", f"s{i}-{seed}", losses=[3.0 - 0.1 * i + 0.01 * seed], size=size,
                            experiment=f"scaling/{size}_full", seed=seed, params=10 ** (8 + i))
    before = tree(tmp_path)
    code, out, err = interrupted(cli("logo.report", tmp_path / "runs", "--out", tmp_path / "rep", "--bootstrap",
                                     "10000000"), lambda o, e: o.count("used ") == 6)  # the runs are read: fits
    assert one_error_line(code, err, 130) == "interrupted: no report was written"
    assert tree(tmp_path) == before


def test_ctrl_c_during_prepare(tmp_path):
    src = write_jsonl(tmp_path / "big.jsonl", corpus_texts(n=200_000, seed=1))
    out = tmp_path / "corpus"
    code, _, err = interrupted(cli("data.prepare", src, "--out", out, "--workers", "2", "--shard-tokens", "300",
                                   "--val-fraction", "0.1"),
                               lambda o, e: (out / "train_00001.bin").exists())
    err = "\n".join(ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and "doc/s" not in ln
                    and "tokenizing" not in ln) + "\n"
    assert one_error_line(code, err, 130).startswith(f"interrupted: {out} holds no prepared corpus yet"), err
    assert not list(out.glob("*.tmp")) and not (out / "manifest.json").exists()
    assert (out / "progress.json").exists()  # the finished shards: the same command continues after them


# --- prepare: --out and unreadable records ------------------------------------------------------------------------

def test_prepare_writes_only_into_a_new_empty_or_own_folder(runs, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    src = write_jsonl(tmp_path / "in" / "a.jsonl", corpus_texts(n=20))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "train_00000.bin").write_bytes(b"someone else's")  # named like a shard, but no corpus of ours
    (busy / "notes.txt").write_text("keep me")
    before, run_before = tree(tmp_path), tree(runs)
    for out, why in ((busy, "not a prepared corpus's (notes.txt)"), (runs / "runs" / "b", "a run directory"),
                     (tmp_path / "in", "holds the source"), (src, "is the source"),
                     (busy / "notes.txt" / "c", "is a file, not a folder")):
        code = prepare_main([str(src), "--out", str(out), "--overwrite", "--workers", "1"])
        assert why in one_error_line(code, capsys.readouterr().err)
    assert tree(tmp_path) == before and tree(runs) == run_before


@pytest.mark.parametrize("record", ["manifest.json", "progress.json"])
@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"{torn", b"[]"])
def test_prepare_over_an_unreadable_record_is_one_line(tmp_path, capsys, record, content):
    src = write_jsonl(tmp_path / "a.jsonl", corpus_texts(n=20))
    out = tmp_path / "corpus"
    out.mkdir()
    (out / record).write_bytes(content)
    before = tree(tmp_path)
    code = prepare_main([str(src), "--out", str(out), "--workers", "1"])
    assert str(out / record) in one_error_line(code, capsys.readouterr().err)
    assert tree(tmp_path) == before


# --- report: --out ----------------------------------------------------------------------------------------------

def test_report_out_replaces_only_an_earlier_report(tmp_path, capsys):
    runs = tmp_path / "runs"
    run = make_report_run(runs, "r", losses=[3.0, 2.5])
    assert report_main([str(runs), "--out", str(tmp_path / "rep")]) == 0
    (tmp_path / "mixed").mkdir()
    shutil.copytree(tmp_path / "rep", tmp_path / "mixed", dirs_exist_ok=True)
    (tmp_path / "mixed" / "thesis.tex").write_text("keep me")
    capsys.readouterr()
    before = tree(tmp_path)
    for out, why in ((run, "holds a run directory"), (runs, "not a report's (r/)"), (tmp_path / "mixed",
                     "not a report's (thesis.tex)"), (run / "config.yaml", "is a file")):
        code = report_main([str(runs), "--out", str(out)])
        assert why in one_error_line(code, capsys.readouterr().err)
    assert tree(tmp_path) == before
    (run / "metrics.jsonl").write_bytes(b"\xff\xfe")  # not UTF-8: the run is skipped with its reason
    code = report_main([str(runs), str(make_report_run(runs, "q", losses=[3.0])), "--out", str(tmp_path / "rep")])
    out = capsys.readouterr().out
    assert code == 0 and f"skipped {run}: metrics.jsonl cannot be read ('utf-8' codec can't decode" in out, out


# --- sweep: Ctrl-C between two submissions -----------------------------------------------------------------------

SLOW_SBATCH = """#!/usr/bin/env bash
n=$(( $(cat "$STATE/n" 2>/dev/null || echo 100) + 1 )); echo $n > "$STATE/n"
if [ $n -gt 101 ]; then touch "$STATE/waiting"; sleep 60; fi
echo "$n;cluster"
"""


def test_sweep_ctrl_c_and_write_errors_name_what_was_submitted(tmp_path):
    """Ctrl-C while the second array is submitted: one line naming the first; a --log-dir that cannot be
    written: one line, nothing submitted."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text(SLOW_SBATCH)
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "STATE": str(tmp_path)}
    cmd = [sys.executable, str(ROOT / "launch" / "sweep.py"), "controlled_1.5b", "--log-dir"]
    code, out, err = interrupted([*cmd, str(tmp_path / "logs"), "--", "data=shards", "data.path=/data/c"],
                                 lambda o, e: (tmp_path / "waiting").exists(), env=env)
    assert one_error_line(code, err, 130) == "interrupted; already submitted: 101 (scancel them or resubmit)"
    assert out == ""
    (tmp_path / "n").unlink()
    (tmp_path / "file").write_text("")
    p = subprocess.run([*cmd, str(tmp_path / "file" / "logs"), "--", "data=shards", "data.path=/data/c"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert "Not a directory" in one_error_line(p.returncode, p.stderr) and not (tmp_path / "n").exists()
