"""benchmarks/model_step.py on CPU (tiny shape, 2 steps), and the one MFU formula it shares with the trainer."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, run_python
from logo.config import AttentionConfig, model_config
from logo.model.flops import attention_flops_per_token, mfu, realized_ratios, train_flops_per_token


def _model_step_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import model_step
    finally:
        sys.path.pop(0)
    return model_step


def test_model_step_cpu_smoke(tmp_path):
    out = tmp_path / "r.json"
    p = run_python([sys.executable, "benchmarks/model_step.py", "--shapes", "tiny", "--kinds", "full,logo",
                    "--steps", "2", "--warmup", "0", "--host-timing", "--out", str(out)], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["results"]
    assert [(r["shape"], r["kind"], r["status"]) for r in rows] == [("tiny", "full", "ok"), ("tiny", "logo", "ok")]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] == pytest.approx(2 * 64 / (r["ms_per_step"] / 1e3))
        assert r["loss_impl"] == "chunked" and r["compile"] == "off" and r["ac"] == "off"
        ht = r["host_timing"]  # CPU: host times only; the forward is issued before the step is
        assert set(ht) == {"host_fwd_ms", "host_step_ms"} and 0 < ht["host_fwd_ms"] < ht["host_step_ms"]
        assert ht["host_step_ms"] <= r["ms_max"] + 1e-3
    # lr 0 and quantile thresholds: the second step routes rho = 0.5 of the 128 rows, up to ties in the gates
    assert abs(rows[1]["realized_ratio"] - 0.5) <= 0.05, rows[1]["realized_ratio"]
    assert "| kind | compile | backend | ms/step |" in p.stdout and "| logo | off | auto |" in p.stdout
    assert all(r["backend"] == "auto" for r in rows)
    assert "ms from the step's start: host fwd" in p.stdout


def test_model_step_rejects_unknown_filters():
    p = subprocess.run([sys.executable, "benchmarks/model_step.py", "--kinds", "full,dense"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--kinds: unknown ['dense']" in p.stderr


def test_mfu_uses_realized_logo_ratios():
    """LoGo attention FLOPs follow the realized global ratio per layer; the target rho when none is given."""
    T = 8192
    logo = model_config("1.5b", attention=AttentionConfig(kind="logo", rho=0.5))
    local = model_config("1.5b", attention=AttentionConfig(kind="local"))
    full = model_config("1.5b", attention=AttentionConfig(kind="full"))
    n = logo.n_layers
    none_global = {i: 0.0 for i in range(n)}
    all_global = {i: 1.0 for i in range(n)}
    assert attention_flops_per_token(logo, T, none_global) == pytest.approx(attention_flops_per_token(local, T))
    assert attention_flops_per_token(logo, T, all_global) == pytest.approx(
        attention_flops_per_token(local, T) + attention_flops_per_token(full, T))
    half = {i: 0.5 for i in range(n)}
    assert attention_flops_per_token(logo, T, half) == pytest.approx(attention_flops_per_token(logo, T))
    assert attention_flops_per_token(logo, T, {0: 1.0}) > attention_flops_per_token(logo, T)
    metrics = {f"logo/ratio/layer_{i}": 0.25 for i in range(n)} | {"logo/ratio_mean": 0.25, "logo/threshold/layer_0": 1}
    assert realized_ratios(metrics) == {i: 0.25 for i in range(n)}
    fpt = train_flops_per_token(logo, T, 10**9, realized_ratios(metrics))
    assert mfu(logo, T, 10**9, 1000.0, 1e15, realized_ratios(metrics)) == pytest.approx(fpt * 1000.0 / 1e15)


def test_attention_flops_count_only_within_documents():
    """Packed documents: each token attends within its own document, so the FLOPs follow the documents' lengths
    (brute force over positions), and one document of the whole length gives the nominal figure."""
    T, w = 4096, 128
    full = model_config("1.5b", attention=AttentionConfig(kind="full"))
    local = model_config("1.5b", attention=AttentionConfig(kind="local", window=w))
    logo = model_config("1.5b", attention=AttentionConfig(kind="logo", rho=0.5, window=w))
    for cfg in (full, local, logo):
        assert attention_flops_per_token(cfg, T, doc_lengths=[T]) == pytest.approx(attention_flops_per_token(cfg, T))
    docs = [3000, 1000, 90, 6, 0]  # an empty document (padded offsets) counts nothing
    per_pair = 4 * full.n_heads * full.head_dim * full.n_layers
    keys = sum(t for n in docs for t in range(1, n + 1)) / sum(docs)
    assert attention_flops_per_token(full, T, doc_lengths=docs) == pytest.approx(per_pair * keys)
    keys_local = sum(min(t, w) for n in docs for t in range(1, n + 1)) / sum(docs)
    assert attention_flops_per_token(local, T, doc_lengths=docs) == pytest.approx(per_pair * keys_local)
    assert attention_flops_per_token(logo, T, doc_lengths=docs) == pytest.approx(per_pair * (keys_local + keys / 2))
    short = [512] * (131072 // 512)  # 128k of short documents: a small fraction of one 128k document's work
    assert attention_flops_per_token(full, 131072, doc_lengths=short) < attention_flops_per_token(full, 131072) / 200
    assert train_flops_per_token(full, T, 10**9, doc_lengths=docs) < train_flops_per_token(full, T, 10**9)
    assert mfu(full, T, 10**9, 1000.0, 1e15, doc_lengths=docs) == pytest.approx(
        train_flops_per_token(full, T, 10**9, doc_lengths=docs) * 1000.0 / 1e15)


def test_set_overrides_reach_every_run_config():
    """--set KEY=VALUE is appended to each run's train.py overrides (after the kind's own)."""
    from logo.run.config import compose
    ms = _model_step_module()
    args = ms.parse_args(["--kinds", "logo", "--set", "attention.window=64"])
    ov = ms.overrides("tiny", "logo", False, False, "auto", args.set)
    assert ov[-1] == "attention.window=64"
    cfg, _, _ = compose(ov)
    assert cfg.model.attention.window == 64 and cfg.model.attention.budget_control == "quantile"


def _run(kind, repeat, ms, status="ok"):
    base = {"shape": "small", "kind": kind, "compile": "on", "ac": "off", "repeat": repeat, "status": status}
    if status != "ok":
        return {**base, "error": "no result after 900 s"}
    return {**base, "ms_per_step": ms, "tokens_per_s": 1e3 / ms, "mfu": 0.1, "peak_memory_gib": 2.0,
            "realized_ratio": 0.5 if kind == "logo" else None}


def test_repeats_report_medians_and_paired_ratios():
    """--repeats: ms/step is the median over the rounds, "vs full" the median of each round's own ratio (a slow
    round slows both kinds and cancels), failed runs are counted but not averaged."""
    ms = _model_step_module()
    rows = [_run("full", 0, 10.0), _run("logo", 0, 13.0),
            _run("full", 1, 20.0), _run("logo", 1, 26.0),  # a round twice as slow: the same ratio
            _run("full", 2, 11.0), _run("logo", 2, 0, status="timeout")]
    full, logo = ms.summarize(rows)
    assert full["ms_median"] == 11.0 and full["median_run"]["repeat"] == 2 and full["vs_full"] == 1.0
    assert logo["ms_median"] == 19.5 and len(logo["ok"]) == 2 and logo["vs_full"] == pytest.approx(1.3)
    table = ms.table(rows, "small")
    assert "| logo | on | auto | 19.5 (13.0-26.0, 2/3 runs) |" in table and table.rstrip().endswith("| 1.30x |")
    assert "| full | on | auto | 11.0 (10.0-20.0, 3/3 runs) |" in table


def test_backends_pair_each_kind_with_full_of_the_same_backend():
    """--backends: every (kind, backend) is a row of its own and "vs full" divides by full attention run with the
    same attention backend in the same round."""
    ms = _model_step_module()
    rows = [{**_run("full", 0, 10.0), "backend": "triton"}, {**_run("full", 0, 8.0), "backend": "flash"},
            {**_run("logo", 0, 11.0), "backend": "triton"}, {**_run("logo", 0, 9.0), "backend": "flash"}]
    entries = {(e["kind"], e["backend"]): e for e in ms.summarize(rows)}
    assert entries[("logo", "triton")]["vs_full"] == pytest.approx(1.1)
    assert entries[("logo", "flash")]["vs_full"] == pytest.approx(9.0 / 8.0)
    assert "| logo | on | flash | 9.0 |" in ms.table(rows, "small")


def test_repeats_must_be_positive():
    p = subprocess.run([sys.executable, "benchmarks/model_step.py", "--repeats", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--repeats must be >= 1" in p.stderr


def test_idle_gaps_sum_the_gpu_timeline_gaps_by_kernel_pair():
    """Gaps between kernels, copies and memsets (not CPU events), overlaps counted once, per profiled step."""
    model_step = _model_step_module()
    events = [dict(cat="kernel", name="a", ts=0, dur=10), dict(cat="kernel", name="b", ts=15, dur=5),
              dict(cat="cpu_op", name="host", ts=20, dur=100), dict(cat="gpu_memset", name="m", ts=30, dur=2),
              dict(cat="kernel", name="a", ts=40, dur=30), dict(cat="kernel", name="c", ts=45, dur=5),
              dict(cat="kernel", name="b", ts=80, dur=1)]

    class Prof:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    out = model_step.idle_gaps(Prof(), n=2, top=5)
    # gaps: a->b 5, b->m 10, m->a 8, a->b 10 (c ends inside a): 33 us over 2 steps
    assert out["gpu_idle_ms_per_step"] == pytest.approx(33 / 1e3 / 2)
    got = {(g["before"], g["after"]): (g["ms"], g["gaps"]) for g in out["idle_gaps"]}
    assert got == {("a", "b"): (0.0075, 1.0), ("b", "m"): (0.005, 0.5), ("m", "a"): (0.004, 0.5)}


def test_idle_gaps_split_by_when_the_host_issued_the_next_kernel():
    """The part of a gap before the next kernel's launch call returned is host-bound; a kernel issued before the
    GPU ran dry leaves only queued idle time."""
    model_step = _model_step_module()
    events = [dict(cat="kernel", name="a", ts=0, dur=10, args=dict(correlation=1)),
              dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=9, dur=4, args=dict(correlation=2)),
              dict(cat="kernel", name="b", ts=15, dur=5, args=dict(correlation=2)),  # gap 5, host-bound 3
              dict(cat="cuda_driver", name="cuLaunchKernelEx", ts=1, dur=2, args=dict(correlation=3)),
              dict(cat="kernel", name="c", ts=26, dur=4, args=dict(correlation=3)),  # gap 6, issued long before
              dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=40, dur=5, args=dict(correlation=4)),
              dict(cat="kernel", name="d", ts=44, dur=1, args=dict(correlation=4))]  # gap 14, all host-bound

    class Prof:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    out = model_step.idle_gaps(Prof(), n=1, top=5)
    assert out["gpu_idle_ms_per_step"] == pytest.approx(25 / 1e3)
    assert out["gpu_idle_host_bound_ms_per_step"] == pytest.approx(17 / 1e3)
    got = {(g["before"], g["after"]): g["host_bound_ms"] for g in out["idle_gaps"]}
    assert got == {("a", "b"): 0.003, ("b", "c"): 0.0, ("c", "d"): 0.014}


def test_trainer_mfu_reads_the_documents_of_each_micro_batch():
    """The trainer's log keeps each micro-batch's document lengths (rows without offsets: one document per row)
    for MFU's attention FLOPs."""
    import torch

    from data.loader import Batch, StepData
    from logo.train.trainer import _StepLog

    def batch(rows, seq, cu=None):
        x = torch.zeros(rows, seq, dtype=torch.long)
        return Batch(x, x, None if cu is None else torch.tensor(cu, dtype=torch.int32), x > -1)

    step = StepData([batch(2, 8, [0, 5, 8, 16]), batch(3, 4)], 40)
    log = _StepLog(None, None, 1e15, *[None] * 6)  # a device peak: MFU is logged
    log.add_documents(step)
    assert [d.tolist() for d in log.documents] == [[5, 3, 8], [4, 4, 4]]
    no_peak = _StepLog(*[None] * 9)  # off CUDA no MFU, so nothing is kept
    no_peak.add_documents(step)
    assert no_peak.documents == []
