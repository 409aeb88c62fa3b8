"""2-process torchrun data parallelism on CPU (gloo) == one process on the same global batch: FSDP2 with the
default options and with every other choice of them (reshard, explicit prefetch depth, bf16 reduction,
synchronous data loading), and replication (DDP) with gradient accumulation (its no-sync micro-batch)."""
import json

import pytest

from conftest import TINY_RUN, read_metrics, run_train, scratch_dir

STEPS = 4
LAYERS = 4
ARGS = [*TINY_RUN, f"train.steps={STEPS}", "checkpoint.interval=2"]
OPTIONS = {  # name: (overrides, relative tolerance of loss and grad norm vs the single process)
    "defaults": ([], 1e-4),  # reshard auto, prefetch 1/1, fp32 reduction, background data prefetch
    "never_prefetch2_bf16": (["parallel.reshard_after_forward=never", "parallel.forward_prefetch=2",
                              "parallel.backward_prefetch=2", "parallel.reduce_dtype=bf16"], 1e-2),
    "always_implicit_sync_data": (["parallel.reshard_after_forward=always", "parallel.forward_prefetch=0",
                                   "parallel.backward_prefetch=0", "data.prefetch=false"], 1e-4),
    "replicate_accumulating": (["parallel.data_parallel=replicate", "train.micro_batch=1"], 1e-4),
    "replicate_small_buckets": (["parallel.data_parallel=replicate", "parallel.bucket_mb=1"], 1e-4),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory, default_corpus):
    with scratch_dir(tmp_path_factory, "single") as d:
        run_train(*ARGS, f"run.dir={d}")
        yield d


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIONS))
def test_torchrun_fsdp_matches_single_process(single, tmp_path, name):
    overrides, rel = OPTIONS[name]
    dist = tmp_path / "dist"
    p = run_train(*ARGS, *overrides, f"run.dir={dist}", nproc=2, timeout=600)
    replicated = name.startswith("replicate")
    wrapper = "DDP data parallel over 2 ranks" if replicated else "FSDP2 data parallel over 2 ranks"
    assert wrapper in p.stderr + p.stdout

    plan_s = json.loads((single / "plan.json").read_text())
    plan_d = json.loads((dist / "plan.json").read_text())
    # the same global batch, split differently: 2 micro-batches x 1 rank vs 1 micro-batch x 2 ranks
    assert (plan_s["world_size"], plan_s["micro_batch"], plan_s["grad_accum"]) == (1, 2, 2)
    assert (plan_d["world_size"], plan_d["micro_batch"] * plan_d["grad_accum"]) == (2, 2)
    assert plan_d["data_parallel"] == ("replicate" if replicated else "shard")
    assert plan_s["steps"] == plan_d["steps"] and plan_s["tokens_total"] == plan_d["tokens_total"]

    a, b = read_metrics(single), read_metrics(dist)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert rb["logo/threshold_spread"] == 0.0  # identical thresholds on both ranks after every step
        for i in range(LAYERS):
            assert rb[f"logo/threshold/layer_{i}"] == ra[f"logo/threshold/layer_{i}"]  # == the single process
        # losses agree up to float summation order (sharded reduce-scatter vs local accumulation; bf16 reduction
        # rounds the gradients)
        assert rb["loss"] == pytest.approx(ra["loss"], rel=rel)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=10 * rel)
    # held-out loss at the last step (smoke stage: eval on): the same windows on 1 and 2 ranks
    assert b[-1]["eval/loss"] == pytest.approx(a[-1]["eval/loss"], rel=1e-4)
    ck = sorted(x.name for x in (dist / "checkpoints").iterdir())
    assert ck[-1] == f"step_{STEPS:08d}" and (dist / "checkpoints" / ck[-1] / ".metadata").exists()

