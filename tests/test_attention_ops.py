"""The attention custom ops (`logo.kernels.ops`): `torch.library.opcheck` on both ops (reference inside on CPU;
the Triton kernels under the CPU interpreter at a tiny shape), and a LoGo block compiled with fullgraph=True
equal to eager in outputs and gradients (aot_eager on CPU, inductor on a GPU). Tolerances: float64 1e-12;
compiled vs eager float32 on CPU 1e-5 (aot_eager runs the same kernels, only graph-level reordering)."""
import math

import pytest
import torch

from logo.config import AttentionConfig, ModelConfig
from logo.kernels import ops
from logo.kernels import reference as R
from logo.model.layers import PackedSeqs, rope_cos_sin
from logo.model.routing import partition
from logo.model.transformer import TransformerBlock

from conftest import kept_for_backward

CUDA = torch.cuda.is_available()


def problem(dtype, mode, seed=0, H=2, D=16):
    """Random q, k, v over three documents and a selection (rows, every row's q_pos, cu_q)."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 7, 8, 19], dtype=torch.int32)
    n = int(cu[-1])
    q, k, v = (torch.randn(n, H, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3))
    seqs = PackedSeqs.build(1, n, "cpu", cu)
    z = {"none": torch.zeros(n, dtype=torch.bool), "all": torch.ones(n, dtype=torch.bool),
         "random": torch.rand(n, generator=g) < 0.5}[mode]
    sel = partition(z, seqs)
    return q, k, v, seqs.pos, sel.rows, sel.cu_seqlens_q, cu


@pytest.mark.parametrize("mode", ["random", "none", "all"])
@pytest.mark.parametrize("window", [0, 5])
def test_opcheck_sparse_reference(mode, window):
    q, k, v, pos, rows, cu_q, cu = problem(torch.float64, mode)
    args = (q, k, v, pos, rows, cu_q, cu, 0.25, window, "reference")
    torch.library.opcheck(torch.ops.logo.range_attention_fwd.default, args)
    o, lse = torch.ops.logo.range_attention_fwd(*args)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.logo.range_attention_bwd.default,
                          (do, q.detach(), k.detach(), v.detach(), o.detach(), lse, pos, rows, cu_q, cu, 0.25,
                           window, "reference"))


@pytest.mark.parametrize("window", [0, 3])
def test_opcheck_dense_reference(window):
    q, k, v, _, _, _, cu = problem(torch.float64, "all")
    torch.library.opcheck(torch.ops.logo.range_attention_fwd.default,
                          (q, k, v, None, None, cu, cu, 0.25, window, "reference"))


def test_opcheck_triton_interpreted():
    """The Triton kernels inside the op (interpreter on CPU, compiled on a GPU), float32."""
    dev = "cuda" if CUDA else "cpu"
    q, k, v, pos, rows, cu_q, cu = (t.detach().to(dev) for t in problem(torch.float32, "random", seed=2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.logo.range_attention_fwd.default,
                          (q, k, v, pos, rows, cu_q, cu, 0.25, 0, "triton"))


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("window", [0, 4])
def test_head_major_inputs_equal_contiguous(impl, window):
    """q, k, v, dO laid out head-major ((H, N, D) memory viewed as (N, H, D), as a per-head batched matmul
    leaves the global branch's q, k, v): the ops read them in place (no copy) and give the same outputs and
    gradients as contiguous inputs, in contiguous tensors (the fake outputs' layout); opcheck passes."""
    dev = "cuda" if (CUDA and impl != "reference") else "cpu"
    q, k, v, pos, rows, cu_q, cu = (t.detach().to(dev) for t in problem(torch.float32, "random", seed=4))
    head_major = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)]  # strides (D, N*D, 1)
    args = (pos, rows, cu_q, cu, 0.25, window, impl)
    o, lse = torch.ops.logo.range_attention_fwd(q, k, v, *args)
    o2, lse2 = torch.ops.logo.range_attention_fwd(*head_major, *args)
    assert o2.is_contiguous() and not head_major[0].is_contiguous()
    torch.testing.assert_close(o2, o, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse2, lse, atol=1e-6, rtol=1e-5)
    do = torch.randn_like(o)
    want = torch.ops.logo.range_attention_bwd(do, q, k, v, o, lse, *args)
    do_hm = do.transpose(0, 1).contiguous().transpose(0, 1)
    got = torch.ops.logo.range_attention_bwd(do_hm, *head_major, o2, lse2, *args)
    for a, b in zip(got, want):
        assert a.is_contiguous()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.library.opcheck(torch.ops.logo.range_attention_fwd.default, (*head_major, *args))
    torch.library.opcheck(torch.ops.logo.range_attention_bwd.default, (do_hm, *head_major, o2, lse2, *args))


def test_op_gradients_match_plain_reference():
    """The custom op's registered autograd equals the plain-autograd reference (float64)."""
    q, k, v, pos, rows, cu_q, cu = problem(torch.float64, "random", seed=5)
    o = ops.query_sparse_attention(q, k, v, pos, rows, cu_q, cu)
    want = R.query_sparse_attention(q, k, v, pos, rows, cu_q, cu)
    g = torch.randn_like(o)
    torch.testing.assert_close(o, want, atol=1e-12, rtol=0)
    for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def logo_block(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=2, vocab_size=64,
                      attention=AttentionConfig(kind="logo", window=4, gate_init_std=0.5)).validate()
    block = TransformerBlock(cfg, 0, "logo").to(device)
    block.init_weights(0.3, 0.3)
    return block.to(dtype), cfg


def run_block(block, x0, cos, sin, seqs):
    x = x0.clone().requires_grad_()
    out, _, stats = block(x, cos, sin, seqs)
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    grads = [x.grad] + [p.grad for _, p in sorted(block.named_parameters())]
    for p in block.parameters():
        p.grad = None
    return out.detach(), stats, grads


@pytest.mark.parametrize("threshold", [0.5, 2.0, -1.0], ids=["some", "none", "all"])
def test_logo_block_compiled_fullgraph_equals_eager(threshold):
    """Whole block (norms, projections, gate, routing, both attention ops, fusion, W_o, FFN) in one graph."""
    device = "cuda" if CUDA else "cpu"
    block, cfg = logo_block(device)
    block.attention.threshold.fill_(threshold)
    B, T = 2, 16
    x0 = torch.randn(B, T, cfg.dim, device=device)
    seqs = PackedSeqs.build(B, T, device, torch.tensor([0, 5, 16, 20, 32], dtype=torch.int32, device=device))
    cos, sin = rope_cos_sin(T, cfg.head_dim, 10000.0, device)
    want, wstats, wgrads = run_block(block, x0, cos, sin, seqs)
    if threshold == 0.5:
        assert 0 < wstats[0] < B * T
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    got, stats, grads = run_block(compiled, x0, cos, sin, seqs)
    torch.testing.assert_close(stats[:2], wstats[:2], atol=0, rtol=0)  # same decisions: selected, valid counts
    torch.testing.assert_close(stats, wstats, atol=1e-5, rtol=1e-6)  # sums of p: inductor's reduction order
    # fp32: aot_eager (CPU) runs eager's kernels; inductor (GPU) fuses and reorders fp32 reductions (on an H100
    # outputs differed by up to 4e-5 absolute, 1.2e-4 relative, in 5 of 2048 elements)
    tol = 2e-4 if CUDA else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_compiled_block_keeps_fewer_activations_with_recompute():
    """A compiled block recomputes the branch inputs in the backward (`AttentionOps.recomputes_branch_inputs`): it
    keeps less for its backward than with them kept (as under activation checkpointing, `block_recomputed`), with
    the same outputs and gradients (the policy reaches the compiled graph)."""
    device = "cuda" if CUDA else "cpu"
    B, T = 2, 16
    results = {}
    for mode in ("never", "compiled"):
        block, cfg = logo_block(device)
        block.attention.attention_ops.block_recomputed = mode == "never"
        seqs = PackedSeqs.build(B, T, device)
        cos, sin = rope_cos_sin(T, cfg.head_dim, 10000.0, device)
        x0 = torch.randn(B, T, cfg.dim, device=device, generator=torch.Generator(device).manual_seed(2))
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
        with kept_for_backward() as storages:
            out, _, grads = run_block(compiled, x0, cos, sin, seqs)
        results[mode] = (sum(storages.values()), out, grads)
    (kept, out, grads), (kept_r, out_r, grads_r) = results["never"], results["compiled"]
    one_nhd = B * T * cfg.dim * 4  # one (N, H, D) fp32 tensor
    assert kept - kept_r >= 2 * one_nhd, (kept, kept_r)
    # aot_eager (CPU) repeats eager's kernels; inductor (GPU) fuses the two graphs differently (on an H100: 2 of
    # 64 gradient elements 1.5e-5 apart, 2.3e-6 relative)
    tol = 2e-4 if CUDA else 1e-6
    torch.testing.assert_close(out_r, out, atol=tol, rtol=tol)
    for a, b in zip(grads_r, grads):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_new_selection_counts_do_not_recompile():
    """Sizes that vary per step (how many rows are selected) live on the device: one graph for every threshold."""
    device = "cuda" if CUDA else "cpu"
    block, cfg = logo_block(device, seed=1)
    B, T = 1, 12
    seqs = PackedSeqs.build(B, T, device)
    cos, sin = rope_cos_sin(T, cfg.head_dim, 10000.0, device)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if not CUDA else "inductor")
    x = torch.randn(B, T, cfg.dim, device=device)
    counts = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b in (0.3, 0.5, 0.7, 2.0):
            block.attention.threshold.fill_(b)
            _, _, stats = compiled(x, cos, sin, seqs)
            counts.add(int(stats[0]))
    assert len(counts) >= 3
    assert math.isfinite(float(stats.sum()))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_logo_layer_has_no_host_sync_on_gpu():
    """Forward and backward of the LoGo layer (gate, routing, both Triton ops, fusion) at a realistic shape
    (8k tokens in three documents, 8 heads of 128, bf16) with CUDA's sync debug mode raising on any host sync
    (after a warm-up step: compiling the glue synchronises, once)."""
    from logo.model.logo_attention import LoGoAttention
    torch.manual_seed(0)
    cfg = ModelConfig(dim=1024, n_layers=1, n_heads=8, attention=AttentionConfig(kind="logo", window=128)).validate()
    layer = LoGoAttention(cfg).cuda()
    layer.init_weights(0.02, 0.02)
    B, T = 2, 4096
    seqs = PackedSeqs.build(B, T, "cuda", torch.tensor([0, 1000, 4096, 8192], dtype=torch.int32, device="cuda"))
    cos, sin = rope_cos_sin(T, 128, 10000.0, "cuda")
    x = torch.randn(B, T, 1024, device="cuda", requires_grad=True)
    with torch.no_grad():
        layer.threshold.copy_(layer.gate_probs(x).median().reshape(1))
    with torch.autocast("cuda", dtype=torch.bfloat16):  # warm-up
        layer(x, cos, sin, seqs)[0].float().square().mean().backward()
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _, stats = layer(x, cos, sin, seqs)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 0.3 < float(stats[0] / stats[1]) < 0.7
    assert torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_compiled_logo_block_at_realistic_shape_on_gpu():
    """A bf16 LoGo block (dim 1024, 8 heads of 128, 8k tokens) compiled fullgraph with inductor equals eager within
    bf16 tolerance (2e-2 relative norm), and a second threshold does not recompile."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=1024, n_layers=1, n_heads=8, attention=AttentionConfig(kind="logo", window=128)).validate()
    block = TransformerBlock(cfg, 0, "logo").cuda()
    block.init_weights(0.02, 0.02)
    B, T = 1, 8192
    seqs = PackedSeqs.build(B, T, "cuda", torch.tensor([0, 3001, 8192], dtype=torch.int32, device="cuda"))
    cos, sin = rope_cos_sin(T, 128, 10000.0, "cuda")
    x = torch.randn(B, T, 1024, device="cuda")

    def run(fn):
        xx = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _, stats = fn(xx, cos, sin, seqs)
        out.float().square().mean().backward()
        return out.float(), stats, xx.grad

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    for b in (0.5, 0.45):
        block.attention.threshold.fill_(b)
        want, wstats, wgrad = run(block)
        with torch._dynamo.config.patch(error_on_recompile=b != 0.5):
            got, stats, grad = run(compiled)
        # same decisions but for gates within rounding of the threshold (inductor reorders the fp32 gate product)
        assert (stats[0] - wstats[0]).abs() <= 8, (stats[0], wstats[0])
        for a, e in ((got, want), (grad, wgrad)):
            assert (a - e).norm() <= 2e-2 * e.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_logo_block_replays_as_cuda_graph():
    """train.compile_mode=reduce-overhead: a LoGo block compiled with CUDA graphs (the custom ops and the routing
    have static shapes and make no host sync, so the graph captures them) equals eager, step after step, as the
    threshold and the input change between replays (new values in the same buffers)."""
    block, cfg = logo_block("cuda", seed=3)
    B, T = 2, 16
    seqs = PackedSeqs.build(B, T, "cuda", torch.tensor([0, 5, 16, 20, 32], dtype=torch.int32, device="cuda"))
    cos, sin = rope_cos_sin(T, cfg.head_dim, 10000.0, "cuda")
    torch._dynamo.reset()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator("cuda").manual_seed(0)
    for step, b in enumerate((0.5, 0.5, 0.45, 0.55, 2.0)):  # the first replays record, later ones replay
        block.attention.threshold.fill_(b)
        x0 = torch.randn(B, T, cfg.dim, device="cuda", generator=g)
        want, wstats, wgrads = run_block(block, x0, cos, sin, seqs)
        torch.compiler.cudagraph_mark_step_begin()
        got, stats, grads = run_block(compiled, x0, cos, sin, seqs)
        assert torch.equal(stats[:2], wstats[:2]), (step, stats[:2], wstats[:2])
        # fp32, inductor's fused and reordered reductions (on an H100: one weight-gradient element of 4096 off by
        # 2.1e-4 absolute, the rest within 2e-4)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        for a, e in zip(grads, wgrads):
            torch.testing.assert_close(a, e, atol=5e-4, rtol=1e-3)
