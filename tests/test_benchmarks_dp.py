"""benchmarks/profile_step.py and benchmarks/weak_scaling.py run on CPU (so they cannot rot), and the
profile's GPU breakdown divides a known timeline exactly."""
import json
import sys

import pytest

from conftest import ROOT, TINY_RUN, run_python

sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_step  # noqa: E402

CPU_ARGS = [a for a in TINY_RUN if not a.startswith("logging.progress_bar")]


def X(name, ts, dur, cat, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": 1, "args": args}


def gpu_trace():
    """Two 100 us steps: host phases, kernels launched in them (one runs past its phase), NCCL kernels partly
    hidden under compute, two host syncs."""
    ann = [("ProfilerStep#1", 0, 100), ("ProfilerStep#2", 100, 100), ("logo/forward", 0, 30),
           ("logo/backward", 30, 40), ("logo/optimizer", 70, 10), ("logo/controller", 75, 3), ("logo/sync", 80, 15),
           ("logo/forward", 100, 30), ("logo/backward", 130, 40), ("logo/optimizer", 170, 10), ("logo/log", 180, 20)]
    ev = [X(n, t, d, "user_annotation") for n, t, d in ann]
    kernels = [(1, 1, 5, 30), (2, 31, 35, 25), (3, 71, 72, 2), (4, 76, 76, 1), (5, 101, 105, 20), (6, 131, 130, 35)]
    for corr, launch, start, dur in kernels:
        ev.append(X("cudaLaunchKernel", launch, 0.5, "cuda_runtime", correlation=corr))
        ev.append(X(f"gemm_{corr}", start, dur, "kernel", correlation=corr, stream=7))
    ev += [X("ncclDevKernel_AllGather_RING_LL", 0, 10, "kernel", correlation=90, stream=20),
           X("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 55, 15, "kernel", correlation=91, stream=21),
           X("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 160, 12, "kernel", correlation=92, stream=7),
           X("cudaStreamSynchronize", 81, 10, "cuda_runtime"), X("cudaStreamSynchronize", 181, 5, "cuda_runtime")]
    ev += [X("aten::mm", 1, 4, "cpu_op"), X("aten::addmm", 2, 1, "cpu_op"), X("aten::mm", 31, 2, "cpu_op")]
    return {"traceEvents": ev}


def test_gpu_breakdown_of_a_known_timeline():
    s = profile_step.analyze(gpu_trace(), 2, "cuda (test)", 2, 0)
    us = {k: v * 2e3 for k, v in s["breakdown_ms"].items()}  # back to microseconds over both steps
    want = {"compute forward": 50, "compute backward": 60, "compute optimizer": 2, "compute controller": 1,
            "exposed all_gather": 5, "exposed reduce_scatter": 10, "exposed all_reduce": 7,
            "GPU idle, host in optimizer": 13, "GPU idle, host in controller": 2, "GPU idle, host in sync": 15,
            "GPU idle, host in between": 5, "GPU idle, host in forward": 10, "GPU idle, host in log": 20}
    assert us.keys() == want.keys() and all(us[k] == pytest.approx(v) for k, v in want.items()), us
    assert s["step_ms"] == pytest.approx(0.1) and sum(want.values()) == 200  # the rows add up to the steps
    assert s["communication_hidden_fraction"] == pytest.approx(1 - 22 / 37)
    assert s["host_syncs"]["per_step"] == 1 and s["host_syncs"]["wait_ms"] == pytest.approx(15 / 2e3)
    assert set(s["host_syncs"]["by_phase"]) == {"sync", "log"}
    # the host thread: top-level ops 4 + 2 us (the nested addmm not counted twice), 6 launches of 0.5 us and
    # 2 syncs of 10 and 5 us in the two steps
    (name, h), = s["host_threads"].items()
    assert name == "aten::mm (tid 1)" and h["op_ms"] == pytest.approx(6 / 2e3)
    assert h["api_calls"] == pytest.approx(4) and h["api_mean_us"] == pytest.approx(18 / 8)
    text = profile_step.format_summary(s)
    assert "exposed reduce_scatter" in text and "host syncs: 1.0 per step" in text
    assert "host thread aten::mm (tid 1): 0.0 ms in torch ops, 4 CUDA API calls of 2.2 us" in text


def test_profile_step_runs_on_cpu(tmp_path, default_corpus):
    p = run_python([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--out", str(tmp_path),
                    "--warmup", "0", "--steps", "2", "--fixed-routing", "--", *CPU_ARGS], timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step breakdown: cpu, rank 0 of 1, 2 steps" in p.stdout
    s = json.loads((tmp_path / "summary_rank0.json").read_text())
    assert s["device"] == "cpu" and s["steps"] == 2
    assert sum(s["breakdown_ms"].values()) == pytest.approx(s["step_ms"], rel=1e-6)
    assert s["breakdown_ms"]["host forward"] > 0 and s["breakdown_ms"]["host backward"] > 0
    assert {"data", "optimizer", "log"} <= set(s["host_phase_ms"])
    assert json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    assert not (tmp_path / "run" / "checkpoints").exists()  # no final checkpoint
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["lr"] == pytest.approx(1e-12)  # --fixed-routing


@pytest.mark.slow
def test_weak_scaling_one_vs_two_gloo_ranks(tmp_path, default_corpus):
    """One and two gloo ranks with the same work per rank; --fixed-routing: the LoGo layers' realized ratio is
    reported and, with the weights held still and quantile thresholds, it is rho (0.5) in the steps used."""
    p = run_python([sys.executable, str(ROOT / "benchmarks" / "weak_scaling.py"), "--cpu", "--gpus", "1", "2",
                    "--micro-batch", "8", "--accum", "2", "--steps", "4", "--fixed-routing", "--out", str(tmp_path),
                    "--", "model=tiny", "attention=logo", "stage.seq_len=64", "attention.window=8"], timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "weak_scaling.json").read_text())
    assert "attention.budget_control=quantile" in res["overrides"]
    one, two = res["runs"]
    assert (one["world_size"], two["world_size"]) == (1, 2) and one["efficiency"] == 1.0
    assert two["efficiency"] == pytest.approx(two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"])
    for r in (one, two):
        assert r["steps_used"] == [3, 4] and r["tokens_per_s_per_gpu"] > 0 and r["peak_memory_gib_per_gpu"] > 0
        assert r["step_time_min_vs_median"] <= 0 <= r["step_time_max_vs_median"]
        assert not (tmp_path / f"gpus_{r['world_size']}" / "checkpoints").exists()
        # 1,024 tokens per rank and micro-batch: one batch's gate quantile misses the next batch's by a few percent
        assert abs(r["global_ratio_median"] - 0.5) <= 0.08, r
    plans = [json.loads((tmp_path / f"gpus_{n}" / "plan.json").read_text()) for n in (1, 2)]
    assert [p["global_batch_tokens"] for p in plans] == [1024, 2048]  # the global batch scales with the ranks
    assert plans[0]["lr"] == pytest.approx(1e-12)
    rows = [json.loads(ln) for ln in (tmp_path / "gpus_2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["step_time_s"] > 0 for r in rows)
    assert "| 2 |" in p.stdout and "efficiency" in p.stdout and "global ratio" in p.stdout


def test_context_parallel_balance_of_the_two_splits():
    """document_work.cp_imbalance: one document per row, both splits balance causal work exactly; a row of a long
    and a short document loads the row split's ranks unevenly, the document split evenly (within the extra
    tokens' rounding); the works counted equal the window's whole causal work."""
    import numpy as np
    import document_work
    from logo.parallel.cp import split_documents
    assert document_work.cp_imbalance(np.array([0, 64]), 2) == (1.0, 1.0)
    cu = np.array([0, 50, 64])
    by_docs, by_rows = document_work.cp_imbalance(cu, 2)
    assert by_rows > 1.5 and by_docs < 1.05
    pieces = split_documents(cu, 2)
    total = sum(document_work.causal_work(p[:, 0], p[:, 1], cu[p[:, 2]]) for p in pieces)
    assert total == sum(L * (L + 1) / 2 for L in np.diff(cu))


def test_sync_stacks_names_the_frames_and_refuses_a_cpu_run(capsys):
    """The sync debug warnings are counted by stack (frames of this project), other warnings pass through; the
    script needs CUDA and says so in one line."""
    import warnings

    from sync_stacks import SyncStacks, main

    stacks = SyncStacks()
    passed = []
    stacks._show = lambda *a, **k: passed.append(a[0])

    def caller():
        stacks("called a synchronizing CUDA operation", UserWarning, "x.py", 1)
    for _ in range(3):
        caller()
    stacks("something else", UserWarning, "x.py", 1)
    (stack, n), = stacks.counts.items()
    assert n == 3 and "test_benchmarks_dp.py" in stack and "caller" in stack and passed == ["something else"]
    with warnings.catch_warnings():
        assert main(["--", "model=tiny", "parallel.device=cpu"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_document_work_balanced_ranks_are_never_slower_than_slices():
    """document_work.slowest_balanced: the heaviest rank's step work with the loader's dealing; with windows of
    very different work it is lower than contiguous slices' (the same draws), and never below the mean."""
    import numpy as np

    import document_work
    w = np.array([0.1, 0.1, 0.1, 1.0, 1.0, 0.2])
    share, gpus, per = 0.5, 4, 2
    balanced = document_work.slowest_balanced(w, share, gpus, per, 400, np.random.default_rng(0))
    rng = np.random.default_rng(0)
    sliced = np.array([(1 - share) + share * rng.choice(w, size=gpus * per).reshape(gpus, per).mean(1).max()
                       for _ in range(400)])
    assert (balanced <= sliced + 1e-12).all() and balanced.mean() < sliced.mean()
    assert balanced.min() >= (1 - share) + share * w.min()
