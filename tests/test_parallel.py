"""Tensor, sequence and context parallelism on CPU (gloo, 2 or 4 processes) == one process.

In process (fp64, one forward/backward): tp=2 and cp=2 give the loss and every gradient of the plain model, for
full attention and LoGo (documents cut across shard edges), and every tp rank routes the same tokens; tp=2 also with
its blocks compiled (`parallelize`'s order: the plans, then compile), where the eager embedding hands the first
compiled block a tensor whose collective is still in flight.
Through train.py (torchrun, slow): per-step losses, gradient norms and thresholds of tp=2, cp=2 and
dp=2 x cp=2 equal one process; a run saved with dp=2 resumes with tp=2 / cp=2 and continues with the same loss.
"""
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from conftest import TINY_RUN, free_port, read_metrics, run_train, scratch_dir, start_ranks
from data.loader import Batch
from logo.config import AttentionConfig, ModelConfig
from logo.model import Transformer

T = 16  # tokens per row (window 4: halos of 3 rows, longer than many of the documents' pieces)


def build(kind: str, bf16: bool = False) -> Transformer:
    """fp64, or fp32 weights for a bf16 autocast forward (what a GPU runs without FSDP)."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, ffn_hidden=64, vocab_size=128,
                      attention=AttentionConfig(kind=kind, window=4, gate_init_std=0.5))
    model = Transformer(cfg)
    model.init_weights()
    return model if bf16 else model.double()


def forward(model, mb: Batch, bf16: bool, **kw):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(mb.inputs, cu_seqlens=mb.cu_seqlens, **kw)


def micro_batch() -> Batch:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (2, T + 1), generator=g)
    cu = torch.tensor([0, 5, 16, 21, 27, 32], dtype=torch.int32)  # documents across chunk and row edges
    return Batch(tokens[:, :-1], tokens[:, 1:], cu, torch.ones(2, T, dtype=torch.bool))


def loss_sum(out, labels):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _worker(rank, port, out_dir, layout, kind, compiled, bf16=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tp, cp = layout
    dist.init_process_group("gloo", rank=rank, world_size=tp * cp)
    try:
        from logo.parallel import ParallelDims, parallelize
        from logo.parallel.cp import context_parallel, shard_batch
        dims = ParallelDims.build(tp * cp, tp, cp, "cpu")
        model, mb = build(kind, bf16), micro_batch()
        parallelize(model, None, torch.float32 if bf16 else torch.float64, compile_blocks=compiled, tp_mesh=dims.submesh("tp"),
                    cp_mesh=dims.submesh("cp"))
        if tp > 1:
            out = forward(model, mb, bf16)  # logits in fp64 (the fused losses work in fp32)
            loss = loss_sum(out, mb.labels)
            loss.backward()
            grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # the head is not tp-split
                     for n, p in model.named_parameters()}
        else:
            local, positions, lay = shard_batch(mb, cp, rank, window=4)
            with context_parallel(model, lay):
                out = model(local.inputs, cu_seqlens=local.cu_seqlens, positions=positions)
                loss = loss_sum(out, local.labels)
                loss.backward()
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # each cp rank holds its share of the tokens
            grads = {n: p.grad for n, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g)
        torch.save({"loss": loss.detach(), "grads": grads, "routing": out.routing},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank done with every collective before any tears its group down
    finally:
        dist.destroy_process_group()


def mixed_documents(B: int, T: int, seed: int) -> Batch:
    """A (B, T) micro-batch whose first document has 48 tokens, then documents of 1 to T tokens, cut at the
    row edges."""
    g = torch.Generator().manual_seed(seed)
    cuts, at = {m * T for m in range(B + 1)} | {48}, 48
    while at < B * T:
        cuts.add(at)
        at += int(torch.randint(1, T, (1,), generator=g))
    tokens = torch.randint(0, 128, (B, T), generator=g)
    return Batch(tokens, tokens, torch.tensor(sorted(cuts), dtype=torch.int32), torch.ones(B, T, dtype=torch.bool))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_documents_split_into_balanced_pieces(cp):
    """Every global row on exactly one rank, B*T/cp rows each; every local piece inside one document at its
    recorded offset, in document order, with its true rotary position; causal work inside every document whose
    length 2*cp divides is equal on every rank, and the ranks' whole work within 5%."""
    from logo.parallel.cp import shard_batch
    B, T = 2, 96
    mb = mixed_documents(B, T, seed=cp)
    cu, n = mb.cu_seqlens.long(), B * T // cp
    seen, work = [], []
    for r in range(cp):
        local, pos, lay = shard_batch(mb, cp, r, window=8)
        g = lay.scatter_index[r * n:(r + 1) * n]  # the global rows of this rank's local rows
        assert local.inputs.shape == (1, n) and torch.equal(local.inputs[0], mb.inputs.flatten()[g])
        assert torch.equal(pos, g % T)
        doc = torch.searchsorted(cu[1:], g, right=True)
        piece = torch.searchsorted(local.cu_seqlens[1:].long(), torch.arange(n), right=True)
        assert torch.equal(doc, lay.piece_doc[piece]) and bool((doc.diff() >= 0).all())
        assert torch.equal(g - cu[doc], (lay.piece_offset[piece] + lay.piece_pos).long())
        work.append(torch.zeros(len(cu) - 1, dtype=torch.int64).index_add_(0, doc, g - cu[doc] + 1))
        seen.append(g)
        moved = lay.to("cpu")  # every tensor field travels (a GPU gets them through pinned memory)
        assert len(lay.tensors()) == 15 and all(torch.equal(a, b) for a, b in zip(moved.tensors(), lay.tensors()))
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(B * T))
    work = torch.stack(work)  # (cp, documents)
    even = (cu.diff() % (2 * cp) == 0)
    assert even.any() and bool((work[:, even] == work[0, even]).all())
    total = work.sum(1).double()
    assert total.max() / total.min() < 1.05, total


def test_row_gather_backward_sums_every_use_without_atomics():
    """The context-parallel row gather's backward (gathers over the host-built inverse) equals autograd's
    index_select backward, with rows used 0 to 3 times and outputs whose gradient is known to be zero left out."""
    import numpy as np
    from logo.parallel.cp import _GatherRows, gather_inverse
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    index = np.array([3, 0, 3, 5, 3, 0, 6, 1])
    used = np.array([True, True, True, True, True, False, True, True])  # output 5's gradient: zero
    grad = torch.randn(8, 2, 3, dtype=torch.float64, generator=g) * torch.from_numpy(used)[:, None, None]
    inverse = gather_inverse(index, 7, used)
    assert inverse.shape == (3, 7)  # row 3 used three times
    out = _GatherRows.apply(x, torch.from_numpy(index), inverse)
    assert torch.equal(out, x[torch.from_numpy(index)])
    (got,) = torch.autograd.grad(out, x, grad)
    (want,) = torch.autograd.grad(x.index_select(0, torch.from_numpy(index)), x, grad)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("cp", [2, 4])
def test_halos_are_the_window_before_each_piece(cp):
    """The sliding window's [halo, piece] sequences of every rank, built from its own rows and the rows every
    rank exports: each piece preceded by the `window - 1` rows before it inside its document (fewer at the
    document's start); query rows of the halo are the zero row; the kept rows are the local rows in order."""
    from logo.parallel.cp import shard_batch
    B, T, window = 2, 96, 8
    mb = mixed_documents(B, T, seed=10 + cp)
    cu, n = mb.cu_seqlens.long(), B * T // cp
    lays = [shard_batch(mb, cp, r, window) for r in range(cp)]
    rows = [lay.scatter_index[r * n:(r + 1) * n] for r, (_, _, lay) in enumerate(lays)]
    exported = torch.cat([rows[s][lay.export_index] for s, (_, _, lay) in enumerate(lays)])
    for r, (local, _, lay) in enumerate(lays):
        ext = torch.cat((exported, rows[r]))[lay.kv_index]  # global row of every [halo, piece] row
        expect, q = [], []
        for p in range(len(local.cu_seqlens) - 1):
            a, b = int(local.cu_seqlens[p]), int(local.cu_seqlens[p + 1])
            start = int(rows[r][a])
            doc_start = int(cu[torch.searchsorted(cu[1:], torch.tensor(start), right=True)])
            halo = list(range(max(doc_start, start - (window - 1)), start))
            expect += halo + rows[r][a:b].tolist()
            q += [0] * len(halo) + list(range(1 + a, 1 + b))
        assert ext.tolist() == expect and lay.q_index.tolist() == q
        assert torch.equal(lay.kv_index[lay.keep_index], cp * len(lay.export_index) + torch.arange(n))
        assert int(lay.cu_halo[-1]) == len(expect)


@pytest.mark.parametrize("kind,layout,compiled", [
    pytest.param("full", (2, 1), False, marks=pytest.mark.slow), ("logo", (2, 1), False), ("logo", (2, 1), True),
    pytest.param("full", (1, 2), False, marks=pytest.mark.slow), ("logo", (1, 2), False), ("logo", (1, 4), False)],
    ids=["tp2-full", "tp2-logo", "tp2_compiled-logo", "cp2-full", "cp2-logo", "cp4-logo"])
def test_tensor_and_context_parallel_equal_one_process(tmp_path, layout, compiled, kind):
    world = layout[0] * layout[1]
    start_ranks(_worker, (free_port(), str(tmp_path), layout, kind, compiled), world)
    model, mb = build(kind), micro_batch()
    out = model(mb.inputs, cu_seqlens=mb.cu_seqlens)
    ref = loss_sum(out, mb.labels)
    ref.backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r in ranks:
        torch.testing.assert_close(r["loss"], ref.detach(), rtol=1e-12, atol=1e-10)
        for n, p in model.named_parameters():
            torch.testing.assert_close(r["grads"][n], p.grad, rtol=1e-9, atol=1e-12, msg=n)
    if kind == "logo":
        if layout[0] > 1:  # tp ranks see the same tokens: the same routing decisions, equal to one process
            assert torch.equal(ranks[0]["routing"][:, :2], ranks[1]["routing"][:, :2])
            assert torch.equal(ranks[0]["routing"][:, :2], out.routing[:, :2])
        else:  # cp ranks hold different tokens: their counts add up to one process's
            torch.testing.assert_close(sum(r["routing"][:, :2] for r in ranks), out.routing[:, :2])
        assert 0 < out.routing[:, 0].sum() < out.routing[:, 1].sum()  # routing is really mixed


def _compiled_cp_worker(rank, port, out_dir, batches, ac):
    """cp=2, compiled blocks: each micro-batch's forward and backward, with the collectives this rank issued for it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from logo.parallel import ParallelDims, parallelize
        from logo.parallel.cp import context_parallel, shard_batch
        dims = ParallelDims.build(2, 1, 2, "cpu")
        model = build("logo")
        group = dims.submesh("cp").get_group()
        parallelize(model, None, torch.float64, compile_blocks=True, activation_checkpointing=ac,
                    cp_mesh=dims.submesh("cp"))
        issued, losses = [], []
        for mb in batches:
            local, positions, lay = shard_batch(mb, 2, rank, window=4)
            before = group._get_sequence_number_for_group()
            with context_parallel(model, lay):
                out = model(local.inputs, cu_seqlens=local.cu_seqlens, positions=positions)
                loss = loss_sum(out, local.labels)
                loss.backward()
            issued.append(group._get_sequence_number_for_group() - before)
            losses.append(loss.detach().clone())
        for loss in losses:
            dist.all_reduce(loss)
        grads = {n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): p.grad
                 for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        breaks = dict(torch._dynamo.utils.counters["graph_break"])  # a break: the block (partly) ran eagerly
        torch.save({"issued": issued, "losses": losses, "grads": grads, "breaks": breaks},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_compiled_context_parallel_issues_the_same_collectives_on_every_rank(tmp_path, ac):
    """Compiled blocks under cp=2 over micro-batches whose pieces differ in shape from rank to rank (the first
    compiled graph is static, later ones dynamic, and a rank reuses the static one when its shapes recur): every
    micro-batch issues the same collectives on both ranks (one issuing a collective the other does not deadlocks
    NCCL): one all-gather per gathered tensor in the forward, its reduce-scatter in the backward, and with
    activation checkpointing every all-gather once more in the recomputed forward; the losses and gradients equal
    one process's."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (4, 2, T), generator=g)
    cus = [[0, 5, 16, 21, 27, 32], [0, 3, 16, 29, 32], [0, 11, 16, 18, 32], [0, 5, 16, 21, 27, 32]]
    batches = [Batch(t, t, torch.tensor(cu, dtype=torch.int32), torch.ones(2, T, dtype=torch.bool))
               for t, cu in zip(tokens, cus)]
    start_ranks(_compiled_cp_worker, (free_port(), str(tmp_path), batches, ac), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    per_layer = 3 + 3 + 3 * ac  # forward: the global keys, values and the window's halo rows; backward: their
    # reduce-scatters (and the recomputed forward's all-gathers)
    assert ranks[0]["issued"] == ranks[1]["issued"] == [per_layer * 2] * len(batches)
    assert ranks[0]["breaks"] == ranks[1]["breaks"] == {}
    model = build("logo")
    for mb, got in zip(batches, ranks[0]["losses"]):
        ref = loss_sum(model(mb.inputs, cu_seqlens=mb.cu_seqlens), mb.labels)
        ref.backward()
        torch.testing.assert_close(got, ref.detach(), rtol=1e-12, atol=1e-10)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ranks[0]["grads"][n], p.grad, rtol=1e-9, atol=1e-12, msg=n)


def test_tensor_parallel_under_bf16_autocast_equals_one_process(tmp_path):
    """The GPU path without FSDP: fp32 weights, bf16 autocast. The LoGo gate then takes its weight gradient from
    the projections' bf16 copy of x through a custom autograd function whose inputs tensor parallelism makes
    DTensors; the gradients of every parameter match one process within bf16 rounding."""
    start_ranks(_worker, (free_port(), str(tmp_path), (2, 1), "logo", False, True), 2)
    model, mb = build("logo", bf16=True), micro_batch()
    out = forward(model, mb, bf16=True)
    ref = loss_sum(out, mb.labels)
    ref.backward()
    for r in (torch.load(tmp_path / f"rank{r}.pt") for r in range(2)):
        torch.testing.assert_close(r["loss"], ref.detach(), rtol=2e-2, atol=0)
        assert torch.equal(r["routing"][:, :2], out.routing[:, :2])
        for n, p in model.named_parameters():
            err = (r["grads"][n] - p.grad).norm() / p.grad.norm()
            assert err < 5e-2, (n, float(err))


# ---- through train.py (torchrun) --------------------------------------------------------------------------

STEPS = 3
ARGS = [*TINY_RUN, f"train.steps={STEPS}", "checkpoint.interval=2", "eval.interval=0"]


def _thresholds(row):
    return [row[k] for k in sorted(row) if k.startswith("logo/threshold/")]


@pytest.fixture(scope="module")
def single(tmp_path_factory, default_corpus):
    with scratch_dir(tmp_path_factory, "single") as d:
        run_train(*ARGS, f"run.dir={d}")
        yield read_metrics(d)


def _assert_same_steps(a, b):
    for ra, rb in zip(a, b, strict=True):
        assert rb["step"] == ra["step"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
        assert _thresholds(rb) == _thresholds(ra)  # bitwise: the controller counts each token once
        assert rb.get("logo/threshold_spread", 0.0) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("overrides,nproc", [(["parallel.tp=2"], 2), (["parallel.cp=2"], 2),
                                             (["parallel.cp=2", "parallel.data_parallel=replicate"], 2),
                                             (["parallel.cp=2"], 4)], ids=["tp2", "cp2", "cp2_replicate", "dp2xcp2"])
def test_trainer_layouts_equal_one_process(single, tmp_path, overrides, nproc):
    run_train(*ARGS, *overrides, f"run.dir={tmp_path}", nproc=nproc, timeout=900)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["dp"] * plan["cp"] * plan["tp"] == plan["world_size"] == nproc
    _assert_same_steps(single, read_metrics(tmp_path))


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, default_corpus):
    """The same run by dp=2 (FSDP): checkpoints at steps 2 and 3."""
    with scratch_dir(tmp_path_factory, "dp2") as d:
        run_train(*ARGS, f"run.dir={d}", nproc=2, timeout=600)
        yield d


def _copy_run(src, dst):
    """A copy of the run directory `src` without its last checkpoint (shards hard-linked: a resume only reads
    them; every other file copied, as a resume rewrites some in place)."""
    def copy(s, d):
        return os.link(s, d) if s.endswith(".distcp") else shutil.copy2(s, d)
    shutil.copytree(src, dst, copy_function=copy, ignore=lambda d, names: [f"step_{STEPS:08d}"])


@pytest.mark.slow
@pytest.mark.parametrize("resume_with", ["parallel.tp=2", "parallel.cp=2"])
def test_checkpoint_resumes_with_another_layout(single, dp2, tmp_path, resume_with):
    """Saved at step 2 by dp=2 (FSDP), resumed by another layout (DCP resharding): step 3 as one process."""
    d = tmp_path / "run"
    _copy_run(dp2, d)
    assert sorted(x.name for x in (d / "checkpoints").iterdir()) == ["step_00000002"]
    p = run_train(*ARGS, resume_with, f"run.dir={d}", nproc=2, timeout=600)
    assert "resumed from" in p.stderr + p.stdout
    last = read_metrics(d)[-1]
    _assert_same_steps(single[-1:], [last])


# ---- layout checks and the memory estimate ----------------------------------------------------------------

def test_memory_estimate_and_layout_errors():
    from logo.config import ConfigError, model_config
    from logo.parallel import ParallelDims
    from logo.parallel.cp import check_cp
    from logo.parallel.memory import estimate
    from logo.parallel.tp import check_tp
    cfg = model_config("1.5b", attention=AttentionConfig(kind="logo"))
    one = estimate(cfg, 131072, 1, 1, 4, 1)
    preset = estimate(cfg, 131072, 1, 8, 8, 1)  # the 128k presets: 8 nodes x cp=8
    assert preset.fits(80, ac=True) and not preset.fits(80, ac=False)
    assert preset.activations < one.activations and preset.logits == one.logits / 2  # half the tokens per rank
    assert estimate(cfg, 32768, 1, 1, 1, 2).activations < estimate(cfg, 32768, 1, 1, 1, 1).activations
    with pytest.raises(ConfigError, match="parallel.tp=3"):
        check_tp(cfg, 3)  # 16 heads
    with pytest.raises(ConfigError, match="parallel.cp=4"):
        check_cp(100, 4)
    with pytest.raises(ConfigError, match="parallel.tp=2, parallel.cp=2"):
        ParallelDims.sizes(6, 2, 2)
    assert (ParallelDims.sizes(8, 2, 2).dp, ParallelDims.sizes(8, 1, 1).dp) == (2, 8)


def test_cuda_graph_blocks_refuse_a_mesh():
    """train.compile_mode=reduce-overhead replays each block as a CUDA graph: with FSDP or tensor parallelism
    (collectives inside the blocks) parallelize refuses, naming the setting, before compiling anything."""
    from logo.config import model_config
    from logo.model import Transformer
    from logo.parallel import parallelize
    model = Transformer(model_config("tiny", attention=AttentionConfig(kind="logo")))
    with pytest.raises(ValueError, match="compile_mode=reduce-overhead"):
        parallelize(model, object(), torch.float32, compile_blocks=True, compile_mode="reduce-overhead")


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_blocks_compile_with_the_mode_and_the_block_options(monkeypatch, mode):
    """Each block is compiled with its mode's Inductor options (reduce-overhead: CUDA graphs) plus
    BLOCK_INDUCTOR_OPTIONS (realize_reads_threshold: the LoGo gate's six-buffer gradient sum is recomputed by the
    attention norm's two backward reductions instead of stored in fp32), as options (torch.compile takes a mode or
    options, not both)."""
    from logo.config import model_config
    from logo.parallel import fsdp
    from logo.parallel import parallelize
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **kw: seen.append((a, kw)))
    model = Transformer(model_config("tiny", attention=AttentionConfig(kind="logo")))
    parallelize(model, None, torch.float32, compile_blocks=True, compile_mode=mode)
    want = {**({"triton.cudagraphs": True} if mode == "reduce-overhead" else {}), "realize_reads_threshold": 8}
    assert fsdp.BLOCK_INDUCTOR_OPTIONS == {"realize_reads_threshold": 8}
    assert seen == [((), {"options": want})] * len(model.layers)


@pytest.mark.parametrize("kind", ["logo", "full", "intra_layer"])
def test_replicate_bucket_follows_the_model(kind):
    """parallel.bucket_mb=null: a model with LoGo layers all-reduces every gradient in one bucket (past DDP's
    first), after the backward; other models, and any under context parallelism or with CUDA-graphed blocks, in
    DDP_BUCKET_MB buckets. The value reaches the DDP that replicate builds; an explicit bucket_mb wins."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh

    from logo.parallel import fsdp, parallelize
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = build(kind, bf16=True)
        mib = fsdp.gradient_mib(model)
        assert mib == -(-sum(4 * p.numel() for p in model.parameters()) // 2**20)
        want = mib + 1 if kind == "logo" else fsdp.DDP_BUCKET_MB
        assert fsdp.ddp_bucket_mb(model) == want
        assert fsdp.ddp_bucket_mb(model, context_parallel=True) == fsdp.DDP_BUCKET_MB
        assert fsdp.ddp_bucket_mb(model, cuda_graphs=True) == fsdp.DDP_BUCKET_MB
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        for bucket_mb, cap in ((None, want), (3, 3)):
            model = build(kind, bf16=True)
            parallelize(model, mesh, torch.float32, fsdp={"bucket_mb": bucket_mb}, data_parallel="replicate")
            forward(model, micro_batch(), bf16=False)  # replicate builds its DDP at the first forward
            assert replicate.state(model)._ddp.bucket_bytes_cap == cap * 2**20
    finally:
        dist.destroy_process_group()
