"""The sweep report on a real tiny sweep trained here: two sizes x two attention kinds x two seeds, three steps
each on CPU (one Hydra multirun, once per module). The table has one row per size and kind with mean, std and n
equal to the runs' own metrics, and the plots are PNGs."""
import json
import statistics

import pandas as pd
import pytest

from conftest import run_train, scratch_dir
from logo.report.__main__ import main

STEPS = 3
BATCH = 128  # tokens per step: one sequence of 128
SWEEP = ["-m", "model=tiny,small", "attention=full,logo", "train.seed=0,1", "data.seed=${train.seed}",
         "stage.seq_len=128", f"stage.global_batch_tokens={BATCH}", "train.micro_batch=1", f"train.steps={STEPS}",
         "logging.interval=1", "logging.ratio_window=1", "logging.progress_bar=false", "logging.heatmap_interval=1000",
         "attention.window=16", "attention.gamma=0.01", "eval.tokens=256"]
PNG = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.slow  # eight short training runs


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, default_corpus):
    with scratch_dir(tmp_path_factory, "sweep") as root:
        run_train(*SWEEP, f"run.dir={root}/runs/${{model.name}}-${{attention.kind}}-seed${{train.seed}}",
                  f"hydra.sweep.dir={root}/hydra", timeout=1200)
        runs = sorted((root / "runs").iterdir())
        assert [r.name for r in runs] == [f"{m}-{a}-seed{s}" for m in ("small", "tiny") for a in ("full", "logo")
                                          for s in (0, 1)]
        yield root, runs


def _metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _by_cell(runs):
    cells = {}
    for r in runs:
        size, kind, _ = r.name.split("-")
        cells.setdefault((size, {"full": "Transformer", "logo": "LoGo"}[kind]), []).append(r)
    return cells


def test_table_rows_equal_the_runs_metrics(sweep, tmp_path, capsys):
    root, runs = sweep
    out = tmp_path / "report"
    assert main([str(root / "runs"), "--out", str(out), "--last-steps", "1"]) == 0
    printed = capsys.readouterr().out
    assert sum(ln.startswith("used    ") for ln in printed.splitlines()) == 8
    assert "fit     smoke Transformer train_loss vs train_flops: skipped, needs points at >= 3 distinct x (has 2)" \
        in printed
    t = pd.read_csv(out / "table_smoke.csv")
    assert list(zip(t["Params"], t["Model"])) == [("tiny", "Transformer"), ("tiny", "LoGo"), ("small", "Transformer"),
                                                  ("small", "LoGo")]
    for (size, model), members in _by_cell(runs).items():
        row = t[(t["Params"] == size) & (t["Model"] == model)].iloc[0]
        finals = [json.loads((r / "final_metrics.json").read_text()) for r in members]
        plans = [json.loads((r / "plan.json").read_text()) for r in members]
        losses = [f["loss"] for f in finals]
        assert row["runs"] == 2 and row["train_loss_n"] == 2
        assert row["train_loss_mean"] == pytest.approx(statistics.fmean(losses), rel=1e-12)
        assert row["train_loss_std"] == pytest.approx(statistics.stdev(losses), rel=1e-9)
        assert row["tokens_mean"] == finals[0]["tokens"] == STEPS * BATCH
        assert row["params_total_mean"] == plans[0]["params_total"]
        assert row["train_flops_mean"] == pytest.approx(plans[0]["train_flops_per_token"] * STEPS * BATCH)
        hours = [sum(BATCH / m["tokens_per_s"] for m in _metrics(r)) / 3600 for r in members]
        assert row["cpu_hours_mean"] == pytest.approx(statistics.fmean(hours), rel=1e-9)  # trained on the CPU
        assert "gpu_hours_mean" not in t.columns
        if model == "LoGo":
            for i in range(4 if size == "tiny" else 6):
                want = statistics.fmean(f[f"logo/ratio/layer_{i}"] for f in finals)
                assert row[f"ratio/{i}_mean"] == pytest.approx(want, rel=1e-12)
        else:
            assert "ratio/0_mean" not in t.columns or pd.isna(row["ratio/0_mean"])
    md = (out / "table_smoke.md").read_text()
    rows = md.splitlines()[2:]
    assert len(rows) == 4 and all(" ± " in r and r.replace(" ", "").endswith("|2|") for r in rows)  # mean ± std, n=2
    for png in ("loss_vs_compute.png", "loss_vs_params.png", "ratio_per_layer.png", "loss_curves.png"):
        assert (out / png).read_bytes()[:8] == PNG, png
    report_md = (out / "report.md").read_text()
    assert report_md.startswith("# Sweep report: Runs without a paper experiment preset (2 model sizes)\n")
    assert "family: none (no run has a paper experiment preset; 2 model sizes: rows by size and model)" in report_md
    assert "CPU process-hours" in md.splitlines()[0] and "GPU-hours" not in md
    assert "![ratio_per_layer](ratio_per_layer.png)" in report_md


def test_default_window_and_wandb_offline(sweep, tmp_path, capsys, monkeypatch):
    """--last-steps 100 (default) averages every logged step of these 3-step runs; --wandb logs the tables and plots
    to an offline W&B run in the report folder."""
    root, runs = sweep
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "report"
    assert main([str(root / "runs" / "tiny-*"), "--out", str(out), "--wandb"]) == 0
    assert "to W&B (offline)" in capsys.readouterr().out
    t = pd.read_csv(out / "table_smoke.csv")
    assert list(t["Model"]) == ["Transformer", "LoGo"] and list(t["runs"]) == [2, 2]
    for (size, model), members in _by_cell(runs).items():
        if size != "tiny":
            continue
        per_run = [statistics.fmean(m["loss"] for m in _metrics(r)) for r in members]
        assert t[t["Model"] == model]["train_loss_mean"].iloc[0] == pytest.approx(statistics.fmean(per_run))
    logged = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logged) == 1 and b"report/table_smoke" in logged[0].read_bytes()
