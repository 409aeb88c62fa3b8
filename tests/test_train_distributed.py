"""2-process torchrun data-parallel FSDP2 on CPU (gloo) == one process on the same global batch."""
import json

import pytest

from conftest import TINY_RUN, read_metrics, run_train

STEPS = 4
LAYERS = 4


@pytest.mark.slow
def test_torchrun_fsdp_matches_single_process(tmp_path, default_corpus):
    args = [*TINY_RUN, f"train.steps={STEPS}", "checkpoint.interval=2"]
    single = tmp_path / "single"
    dist = tmp_path / "dist"
    run_train(*args, f"run.dir={single}")
    p = run_train(*args, f"run.dir={dist}", nproc=2, timeout=600)
    assert "FSDP2 data parallel over 2 ranks" in p.stderr + p.stdout

    plan_s = json.loads((single / "plan.json").read_text())
    plan_d = json.loads((dist / "plan.json").read_text())
    # the same global batch, split differently: 2 micro-batches x 1 rank vs 1 micro-batch x 2 ranks
    assert (plan_s["world_size"], plan_s["micro_batch"], plan_s["grad_accum"]) == (1, 2, 2)
    assert (plan_d["world_size"], plan_d["micro_batch"], plan_d["grad_accum"]) == (2, 2, 1)
    assert plan_s["steps"] == plan_d["steps"] and plan_s["tokens_total"] == plan_d["tokens_total"]

    a, b = read_metrics(single), read_metrics(dist)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert rb["logo/threshold_spread"] == 0.0  # identical thresholds on both ranks after every step
        for i in range(LAYERS):
            assert rb[f"logo/threshold/layer_{i}"] == ra[f"logo/threshold/layer_{i}"]  # == the single process
        # losses agree up to float summation order (sharded reduce-scatter vs local accumulation)
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3)
    ck = sorted(x.name for x in (dist / "checkpoints").iterdir())
    assert ck[-1] == f"step_{STEPS:08d}" and (dist / "checkpoints" / ck[-1] / ".metadata").exists()
