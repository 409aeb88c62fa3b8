"""The LoGo layer's branches as one op pair (`logo::logo_branches_fwd/bwd`, logo/kernels/branches.py) against the
separate ops it replaces (rope_transform, then the sliding window and the query-sparse attention), opcheck, the
rope backward's added v gradient, and the layer with the op pair on and off.

Tolerances: the op runs the same kernels (Triton, interpreted on CPU) or the same reference as the separate ops, so
outputs are equal; gradients differ only where v's two gradients are added: inside the RoPE + transform backward
(one rounding) instead of by autograd after both were rounded to the input dtype. float64 reference and float32:
1e-12 / 1e-6 relative in norm; bfloat16: 1e-2 (one bf16 rounding of dv).
"""
import pytest
import torch

from logo.config import AttentionConfig, ModelConfig
from logo.kernels import branches, dispatch, ops
from logo.model.layers import PackedSeqs, rope_cos_sin
from logo.model.logo_attention import LoGoAttention
from logo.model.routing import partition

from conftest import close_in_norm as close, kept_for_backward, logo_layer_step

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
D = 64 if CUDA else 16
WINDOW = 5
TOL = {torch.float64: (1e-12, 0.0), torch.float32: (1e-6, 1e-7), torch.bfloat16: (1e-2, 1e-3)}


def problem(dtype, select: str = "half", seed: int = 0, cu=(0, 10, 24, 31, 48)):
    """q, k, v (N, H, D) leaves, A (3, H, D, D) near identity, angles, a packed layout of several documents (two rows
    of T=24), and a selection of the rows: none, one, half (random) or all."""
    B, T, H = 2, 24, 2
    g = torch.Generator().manual_seed(seed)
    n = B * T
    q, k, v = (torch.randn(n, H, D, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
               for _ in range(3))
    A = (torch.eye(D, dtype=torch.float64) + 0.2 * torch.randn(3, H, D, D, generator=g, dtype=torch.float64))
    A = A.to(DEVICE, torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    cos, sin = (t.to(DEVICE) for t in rope_cos_sin(T, D, 10000.0, "cpu"))
    seqs = PackedSeqs.build(B, T, DEVICE, torch.tensor(cu, dtype=torch.int32))
    z = {"none": torch.zeros(n, dtype=torch.bool), "one": torch.arange(n) == 17, "all": torch.ones(n, dtype=torch.bool),
         "half": torch.rand(n, generator=g) > 0.5}[select].to(DEVICE)
    return q, k, v, A, cos, sin, seqs, partition(z, seqs)


def separate(q, k, v, A, cos, sin, seqs, sel, impl):
    """What the layer runs without the op pair (`LoGoAttention.attend_branches`): three differentiable ops."""
    qr, kr, qg, kg, vg = ops.rope_transform(q, k, v, A, cos, sin, impl != "reference")
    o_local = ops.sliding_window_attention(qr, kr, v, seqs.cu_seqlens, WINDOW, impl=impl)
    o_global = ops.query_sparse_attention(qg, kg, vg, seqs.pos, sel.rows, sel.cu_seqlens_q, seqs.cu_seqlens,
                                          impl=impl)
    return o_local, o_global


def merged(q, k, v, A, cos, sin, seqs, sel, impl, keep_rotated=False):
    return branches.logo_branches(q, k, v, A, cos, sin, seqs.pos, sel.rows, sel.cu_seqlens_q, seqs.cu_seqlens,
                                  WINDOW, keep_rotated, impl=impl)


def outputs_and_grads(fn, inputs, seed=7):
    q, k, v, A = inputs[:4]
    outs = fn(*inputs)
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o) for o in outs]
    return tuple(o.detach() for o in outs) + torch.autograd.grad(outs, (q, k, v, A), grads)


CASES = [(torch.float64, "reference"), (torch.float32, "triton"), (torch.bfloat16, "triton")]
if not CUDA:  # the interpreter is slow: bf16 once, at the default selection only (below)
    CASES = CASES[:2]


@pytest.mark.parametrize("dtype,impl", CASES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("keep_rotated", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("select", ["half", "none", "one", "all"])
def test_one_op_equals_the_separate_ops(dtype, impl, keep_rotated, select):
    """Both branch outputs and the gradients of q, k, v and A (each transform's), over several documents and none,
    one, half or all of the rows selected."""
    inputs = problem(dtype, select)
    want = outputs_and_grads(lambda *a: separate(*a, impl), inputs)
    got = outputs_and_grads(lambda *a: merged(*a, impl, keep_rotated), inputs)
    rtol, atol = TOL[dtype]
    for name, a, b in zip(("o_local", "o_global", "dq", "dk", "dv", "dA"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        close(a, b, rtol, atol, name)
    if select == "none":
        assert not got[1].any()


@pytest.mark.skipif(CUDA, reason="covered by the parametrized test on the GPU")
def test_one_op_equals_the_separate_ops_bf16_interpreted():
    inputs = problem(torch.bfloat16)
    want = outputs_and_grads(lambda *a: separate(*a, "triton"), inputs)
    got = outputs_and_grads(lambda *a: merged(*a, "triton"), inputs)
    for name, a, b in zip(("o_local", "o_global", "dq", "dk", "dv", "dA"), got, want, strict=True):
        close(a, b, *TOL[torch.bfloat16], name)


@pytest.mark.parametrize("use_triton", [False, True])
def test_rope_backward_adds_v_gradient(use_triton):
    """rope_transform_backward(..., gv): dv is the plain dv plus gv; nothing else changes (kernel and reference)."""
    q, k, v, A, cos, sin, _, _ = problem(torch.float32)
    q, k, v, A = (t.detach() for t in (q, k, v, A))
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(q.shape, generator=g).to(DEVICE) for _ in range(6)]
    impl = ops._rope_impl(use_triton)
    plain = impl.rope_transform_backward(*grads[:5], q, k, v, A, cos, sin)
    added = impl.rope_transform_backward(*grads[:5], q, k, v, A, cos, sin, gv=grads[5])
    for a, b in zip(added[:2] + added[3:], plain[:2] + plain[3:]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    close(added[2], plain[2] + grads[5], 1e-6, 1e-7, "dv")


@pytest.mark.parametrize("keep_rotated", [False, True])
def test_opcheck(keep_rotated):
    """Schema, fake outputs and registered autograd of the pair (reference inside: the interpreter is too slow for
    opcheck's repeated calls; the kernels' equality with it is tested above)."""
    q, k, v, A, cos, sin, seqs, sel = problem(torch.float64)
    args = (q, k, v, A, cos, sin, seqs.pos, sel.rows, sel.cu_seqlens_q, seqs.cu_seqlens, D ** -0.5, WINDOW,
            keep_rotated, "reference")
    torch.library.opcheck(branches.logo_branches_fwd, args)
    outs = branches.logo_branches_fwd(*(t.detach() if isinstance(t, torch.Tensor) else t for t in args))
    dos = [torch.randn_like(outs[0]) for _ in range(2)]
    rotated = list(outs[4:]) if keep_rotated else []
    torch.library.opcheck(branches.logo_branches_bwd, (*dos, q.detach(), k.detach(), v.detach(), A.detach(), cos, sin,
                                                       *outs[:4], rotated, seqs.pos, sel.rows, sel.cu_seqlens_q,
                                                       seqs.cu_seqlens, D ** -0.5, WINDOW, "reference"))


def test_keep_rotated_keeps_the_rotated_inputs_for_the_backward():
    """keep_rotated=False keeps five (N, H, D) tensors fewer for the backward, same values."""
    kept, results = {}, {}
    for keep in (False, True):
        inputs = problem(torch.float64)
        with kept_for_backward() as storages:
            outs = merged(*inputs, "reference", keep)
        kept[keep] = sum(storages.values())
        results[keep] = torch.autograd.grad(sum(o.square().sum() for o in outs), inputs[:4])
    one_nhd = inputs[0].numel() * 8
    assert kept[True] - kept[False] >= 5 * one_nhd, kept
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bad_inputs_are_named():
    q, k, v, A, cos, sin, seqs, sel = problem(torch.float32)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        branches.logo_branches(q, k, v, A, cos, sin, seqs.pos, sel.rows, sel.cu_seqlens_q, seqs.cu_seqlens, 0)
    with pytest.raises(ValueError, match=r"A \(3, H, D, D\)"):
        branches.logo_branches(q, k, v, A[:2], cos, sin, seqs.pos, sel.rows, sel.cu_seqlens_q, seqs.cu_seqlens, 4)
    with pytest.raises(ValueError, match=r"rows must be \(48,\)"):
        branches.logo_branches(q, k, v, A, cos, sin, seqs.pos, sel.rows[:9], sel.cu_seqlens_q, seqs.cu_seqlens, 4)


class _Ops(dispatch.AttentionOps):
    """The plain ops with the op pair on or off and the branch inputs recomputed always, never or (compiled) while
    torch.compile traces (the default)."""

    def __init__(self, fuse: bool, recompute: str):
        self.fuse, self.recompute = fuse, recompute

    def fuses_branches(self, q, A, backend):
        return self.fuse and super().fuses_branches(q, A, backend)

    def recomputes_branch_inputs(self):
        if self.recompute == "compiled":
            return super().recomputes_branch_inputs()
        return torch.is_grad_enabled() and self.recompute == "always"


def _layer(fuse_branches: bool, recompute: str):
    torch.manual_seed(0)
    cfg = ModelConfig(dim=2 * D, n_heads=2, n_layers=1,
                      attention=AttentionConfig(kind="logo", window=WINDOW, backend="triton", gate_init_std=0.5))
    layer = LoGoAttention(cfg).to(DEVICE)
    layer.attention_ops = _Ops(fuse_branches, recompute)
    layer.init_weights(0.5, 0.5)
    with torch.no_grad():  # a transform away from identity, so its gradient and product matter
        layer.transform.A.add_(0.1 * torch.randn_like(layer.transform.A))
    return layer, cfg


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_layer_with_one_op_equals_separate_ops(monkeypatch, recompute):
    """The LoGo layer, float32 on the Triton backend: the op pair (one op call) against the separate ops composed in
    PyTorch (and the recompute policy's checkpoint for `always`): output and the gradients of x, A, W_q, W_v."""
    calls = []
    real = branches.logo_branches
    monkeypatch.setattr(branches, "logo_branches", lambda *a, **k: calls.append(a[11]) or real(*a, **k))
    results = []
    for fuse in (True, False):
        layer, _ = _layer(fuse, recompute)
        out, dx, stats = logo_layer_step(layer)
        assert 0 < stats[0] < 48
        results.append((out, dx, layer.transform.A.grad, layer.wq.weight.grad, layer.wv.weight.grad))
    assert calls == [recompute == "never"]  # once, with the op pair; keep_rotated unless recomputing
    for name, a, b in zip(("out", "dx", "dA", "dWq", "dWv"), *results, strict=True):
        close(a, b, 1e-6, 1e-7, name)


def test_no_op_pair_under_context_parallelism():
    """Context parallelism's ops (with a micro-batch layout set) call the separate ops, each with its communication;
    the plain ops run the pair where the fused RoPE + transform runs."""
    from logo.parallel.cp import ContextParallelOps
    layer, _ = _layer(True, "never")
    q, A = torch.zeros(4, 2, D, device=DEVICE), layer.transform.A
    assert dispatch.AttentionOps().fuses_branches(q, A, "triton")
    assert not dispatch.AttentionOps().fuses_branches(q, None, "triton")  # no LP transforms
    assert not dispatch.AttentionOps().fuses_branches(q, A, "reference")
    assert ContextParallelOps(None).fuses_branches(q, A, "triton")  # no layout: the plain ops
    assert not ContextParallelOps(None, layout=object()).fuses_branches(q, A, "triton")


@pytest.mark.parametrize("recompute", ["compiled", "never"])
def test_compiled_layer_with_one_op_equals_eager(recompute):
    """The layer compiled with fullgraph=True (aot_eager on CPU: the interpreted kernels run on real tensors only)
    traces the op pair (recomputing or keeping the rotated inputs) and equals eager."""
    layer, _ = _layer(True, recompute)
    results = []
    torch._dynamo.reset()
    for fn in (layer, torch.compile(layer, backend="inductor" if CUDA else "aot_eager", fullgraph=True)):
        out, dx, _ = logo_layer_step(layer, fn)
        results.append((out, dx, layer.transform.A.grad.clone()))
        layer.zero_grad(set_to_none=True)
    for name, a, b in zip(("out", "dx", "dA"), *results, strict=True):
        close(a, b, 1e-5 if CUDA else 1e-6, 1e-7, name)
