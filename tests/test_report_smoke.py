"""The report of a smoke run made as the README makes one (`python train.py`, then `python -m logo.eval
perplexity`): a CPU run without an experiment preset is reported as what it is, never as a paper family; its
table names no column twice; its compute time is in CPU process-hours."""
import csv
import json
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_RUN, run_python, run_train, scratch_dir, train_env
from logo.report.__main__ import main

pytestmark = pytest.mark.slow  # one short training run and a perplexity evaluation


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, default_corpus):
    """runs/tiny-logo-smoke: 2 steps with the held-out evaluation at the last, then a perplexity evaluation."""
    with scratch_dir(tmp_path_factory, "smoke") as root:
        run = root / "runs" / "tiny-logo-smoke"
        run_train(*TINY_RUN, "attention=logo", "train.steps=2", f"run.dir={run}")
        p = run_python([sys.executable, "-m", "logo.eval", "perplexity", str(run), "--tokens", "256"], env=train_env(),
                       timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        yield run


def _md_headers(path) -> list[str]:
    return [h.strip() for h in path.read_text().splitlines()[0].strip("|").split("|")]


def test_smoke_run_report(smoke_run, tmp_path, capsys):
    out = tmp_path / "report"
    assert main([str(smoke_run.parent), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert md.startswith("# Sweep report: Runs without a paper experiment preset (one model size)\n")
    assert "controlled_1.5b" not in md and "paper Table" not in md

    headers = _md_headers(out / "table_smoke.md")
    assert len(headers) == len(set(headers)), headers
    with open(out / "table_smoke.csv", newline="") as f:
        csv_headers = next(csv.reader(f))
    assert len(csv_headers) == len(set(csv_headers))
    assert "Held-out ppl" in headers and "default_corpus ppl" in headers

    assert "CPU process-hours" in headers and "GPU-hours" not in md
    train = [json.loads(ln) for ln in (smoke_run / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    hours = sum(256 / r["tokens_per_s"] for r in train) / 3600  # TINY_RUN: 256 tokens per step, one process
    with open(out / "table_smoke.csv", newline="") as f:
        row = next(csv.DictReader(f))
    assert float(row["cpu_hours_mean"]) == pytest.approx(hours, rel=1e-9)
    assert float(row["eval_ppl_mean"]) == pytest.approx(train[-1]["eval/ppl"], rel=1e-12)  # the training loop's


def test_smoke_run_is_not_of_a_paper_family(smoke_run, tmp_path):
    """Asking for a paper family the run is not part of: one error line, exit code 2, no report."""
    cmd = [sys.executable, "-m", "logo.report", str(smoke_run.parent), "--family", "controlled_1.5b",
           "--out", str(tmp_path / "report")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr
    assert p.stdout == ""
    assert p.stderr == ("error: --family controlled_1.5b: no run is of that family (no preset: 1 run); leave out "
                        "--family to report the runs as they are\n")
    assert not (tmp_path / "report").exists()
