"""BudgetController across 2 gloo ranks: thresholds equal on every rank and equal to one process that sees
the whole global batch (counts are summed over ranks before the sign is taken); the model plain or sharded with
FSDP2 under each choice of the FSDP options."""
import os

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, start_ranks
from logo.config import AttentionConfig, model_config
from logo.model import BudgetController, Transformer
from logo.parallel import sum_over_ranks

FSDP_OPTIONS = {  # None: the plain model on each rank (tests/test_train_distributed.py covers "always"/0/0)
    "plain": None,
    "fsdp_defaults": {},
    "fsdp_never_prefetch2_bf16": dict(reshard_after_forward="never", forward_prefetch=2, backward_prefetch=2,
                                      reduce_dtype=torch.bfloat16),
}

STEPS, MICRO, B, T = 6, 2, 2, 24


def build(budget_control="threshold"):
    torch.manual_seed(0)
    cfg = model_config("tiny", vocab_size=200,
                       attention=AttentionConfig(kind="logo", window=4, gamma=0.02, rho=0.3, threshold_init=0.5,
                                                 budget_control=budget_control))
    model = Transformer(cfg)
    model.init_weights()
    with torch.no_grad():
        for layer in model.logo_layers():
            layer.gate.weight.normal_(0, 0.5)
    return model


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 200, (2 * MICRO * B, T), generator=g)  # 2 ranks x MICRO micro-batches x B rows


def run_steps(model, ctrl, rows_for_step):
    history = []
    for step in range(STEPS):
        rows = rows_for_step(step)
        for micro in rows.split(B):
            with torch.no_grad():
                ctrl.accumulate(model(micro).routing)
        ctrl.step()
        history.append(ctrl.thresholds().clone())
    return torch.stack(history)


def _worker(rank, port, out_dir, fsdp, budget_control="threshold"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = build(budget_control)
        if fsdp is not None:
            from torch.distributed.device_mesh import init_device_mesh
            from logo.parallel import apply_fsdp
            apply_fsdp(model, init_device_mesh("cpu", (2,)), torch.float32, **fsdp)
        ctrl = BudgetController(model, reduce=sum_over_ranks(dist.group.WORLD))
        hist = run_steps(model, ctrl, lambda s: global_batch(s).chunk(2)[rank])
        torch.save(hist, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks done with every collective before either tears its group down
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fsdp", [f if f == "plain" else pytest.param(f, marks=pytest.mark.slow)
                                  for f in FSDP_OPTIONS])
def test_thresholds_match_across_ranks_and_single_process(tmp_path, fsdp):
    start_ranks(_worker, (free_port(), str(tmp_path), FSDP_OPTIONS[fsdp]), 2)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert torch.equal(r0, r1)
    model = build()
    single = run_steps(model, BudgetController(model), global_batch)
    assert torch.equal(r0, single)
    assert not torch.equal(single[0], single[-1])  # the thresholds really moved


def test_quantile_thresholds_match_across_ranks_and_single_process(tmp_path):
    """The quantile controller: histograms are summed over ranks before the quantile is read."""
    start_ranks(_worker, (free_port(), str(tmp_path), None, "quantile"), 2)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert torch.equal(r0, r1)
    model = build("quantile")
    single = run_steps(model, BudgetController(model), global_batch)
    assert torch.equal(r0, single)
    assert not torch.equal(single[0], single[-1])


def _maxima_worker(rank, port, out_dir):
    from logo.train.trainer import _rank_maxima
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ctrl = BudgetController(build())
        with torch.no_grad():  # layer 1's threshold differs by 0.25 between the ranks, the others agree
            ctrl.layers[1].threshold += 0.25 * rank
        full = BudgetController(Transformer(model_config("tiny", vocab_size=200)))  # no LoGo layer: spread 0
        got = torch.stack([_rank_maxima(c, 1.5 + rank, torch.device("cpu")) for c in (ctrl, full)])
        torch.save(got, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_rank_maxima_in_one_all_reduce(tmp_path):
    """The logging record's one collective: the thresholds' spread over ranks (0.25: one layer differs; 0 without
    LoGo layers) and the largest peak memory (1.5 and 2.5 GiB on the two ranks), the same on both ranks."""
    start_ranks(_maxima_worker, (free_port(), str(tmp_path)), 2)
    got = [torch.load(tmp_path / f"r{r}.pt") for r in range(2)]
    assert torch.equal(got[0], got[1]) and got[0].dtype == torch.float64
    torch.testing.assert_close(got[0], torch.tensor([[0.25, 2.5], [0.0, 2.5]], dtype=torch.float64))
