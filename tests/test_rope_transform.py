"""The fused RoPE + per-head transform op (`logo::rope_transform_fwd/bwd`: RoPE of q, k and of their transforms,
and v's transform, not rotated): the Triton kernel against the pure-PyTorch reference, the reference against the
model's unfused formula, opcheck, and the LoGo layer with the fused path equal to the unfused one.

Kernel vs reference (reference in float64; ||out - ref|| <= rtol ||ref|| + atol sqrt(numel)):
- float32 inputs: rtol 2e-5 (ieee fp32 dots; summation order only).
- bfloat16 inputs: rtol 2e-2. Both sides see the same 16-bit x and A; the kernel rounds the outputs once and the
  inverse-rotated gradient once before its products (as the unfused path's bf16 matmul does): ~4e-3 relative.
On a machine without a GPU the kernels run under the Triton CPU interpreter (conftest.py) at small head dims.
"""
import pytest
import torch

from logo.config import AttentionConfig, ModelConfig
from logo.kernels import dispatch, ops
from logo.kernels import reference as R
from logo.kernels.rope import apply_rope
from logo.model.layers import PackedSeqs, rope_cos_sin
from logo.model.logo_attention import LoGoAttention

from conftest import close_in_norm as close, kept_for_backward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HEAD_DIMS = (64, 128) if CUDA else (16, 32)
RTOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


def problem(B, T, H, D, dtype, seed=0, head_major=False):
    """q, k, v (B*T, H, D) (optionally head-major memory, as a batched matmul leaves it), A (3, H, D, D) near
    identity, the angles."""
    g = torch.Generator().manual_seed(seed)
    n = B * T
    q, k, v = (torch.randn(n, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    if head_major:
        q, k, v = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))  # (N, H, D) of (H, N, D)
    A = torch.eye(D, dtype=torch.float64) + 0.2 * torch.randn(3, H, D, D, generator=g, dtype=torch.float64)
    cos, sin = rope_cos_sin(T, D, 10000.0, "cpu")
    to = dict(device=DEVICE)
    return (*(x.to(dtype=dtype, **to) for x in (q, k, v)), A.to(dtype=torch.float32, **to), cos.to(**to),
            sin.to(**to))


def unfused(q, k, v, A, cos, sin, B):
    """The model's unfused arithmetic: einsum transform, then apply_rope (not of v's transform)."""
    return (apply_rope(q, cos, sin, B), apply_rope(k, cos, sin, B),
            apply_rope(torch.einsum("nhd,hde->nhe", q, A[0]), cos, sin, B),
            apply_rope(torch.einsum("nhd,hde->nhe", k, A[1]), cos, sin, B), torch.einsum("nhd,hde->nhe", v, A[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("shape", [(2, 37, 3), (1, 100, 2)], ids=["two_rows", "one_row"])
@pytest.mark.parametrize("head_major", [False, True])
def test_kernel_matches_reference(shape, D, dtype, head_major):
    """All five outputs and the four gradients (dA of each transform on its own), over row counts that are not
    multiples of the block."""
    B, T, H = shape
    q, k, v, A, cos, sin = problem(B, T, H, D, dtype, seed=D, head_major=head_major)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(q.shape, generator=g).to(device=DEVICE, dtype=dtype) for _ in range(5)]
    A16 = A.to(dtype).double()  # the reference sees the kernel's rounded A, in float64
    x64 = (q.double(), k.double(), v.double())
    want = R.rope_transform_forward(*x64, A16, cos, sin) + R.rope_transform_backward(
        *(t.double() for t in grads), *x64, A16, cos, sin)
    got = (ops.rope_transform_fwd(q, k, v, A, cos, sin, True)
           + ops.rope_transform_bwd(*grads, q, k, v, A, cos, sin, True))
    assert got[8].dtype == torch.float32 and got[4].dtype == got[7].dtype == dtype
    got, want = got[:8] + tuple(got[8]), want[:8] + tuple(want[8])
    names = ("q_rot", "k_rot", "qg_rot", "kg_rot", "vg", "dq", "dk", "dv", "dA_q", "dA_k", "dA_v")
    for name, a, b in zip(names, got, want, strict=True):
        close(a, b, RTOL[dtype], ATOL[dtype], name)


def test_v_transform_is_not_rotated():
    """The kernel's v output is v A_2 itself and its gradients those of the plain product, float32: a rotated
    output, or a rotation in dv or dA_2, is off by far more than the tolerance (rows up to 36 turn the first pairs
    by up to 36 radians)."""
    q, k, v, A, cos, sin = problem(2, 37, 3, HEAD_DIMS[0], torch.float32, seed=5)
    gv = torch.randn(v.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    zeros = [torch.zeros_like(q) for _ in range(4)]
    vg = ops.rope_transform_fwd(q, k, v, A, cos, sin, True)[4]
    _, _, dv, dA = ops.rope_transform_bwd(*zeros, gv, q, k, v, A, cos, sin, True)
    v64, A64, g64 = v.double(), A[2].double(), gv.double()
    for name, a, b in (("vg", vg, torch.einsum("nhd,hde->nhe", v64, A64)),
                       ("dv", dv, torch.einsum("nhe,hde->nhd", g64, A64)),
                       ("dA_v", dA[2], torch.einsum("nhd,nhe->hde", v64, g64)),
                       ("dA_qk", dA[:2], torch.zeros_like(dA[:2]))):
        close(a, b, RTOL[torch.float32], ATOL[torch.float32], name)
    with pytest.raises(AssertionError):  # the check tells a rotated output apart
        close(vg, apply_rope(torch.einsum("nhd,hde->nhe", v64, A64), cos.double(), sin.double(), 2), 0.05, 0, "")


@pytest.mark.parametrize("layout", ["contiguous", "qkv_rows", "head_major"])
@pytest.mark.parametrize("N", [1, 300, 2100], ids=["one_row", "few_chunks", "many_chunks"])
def test_transform_grads_over_strided_views(layout, N):
    """dA_t = x_t^T g_t per head, split over row chunks, read from x's own memory: contiguous, a slice of fused
    q|k|v rows (as the QKV projection leaves q and v), or head-major; k contiguous (other layouts than q, v)."""
    from logo.kernels.triton._rope import _transform_grads
    H, D = 3, 16
    gen = torch.Generator().manual_seed(3)
    views = {"contiguous": lambda b: b.transpose(0, 1).contiguous(), "qkv_rows": lambda b: b[:, 1],
             "head_major": lambda b: b.transpose(0, 1)}

    def base():
        return torch.randn(N, 3, H, D, generator=gen) if layout == "qkv_rows" else torch.randn(H, N, D, generator=gen)

    q, v = views[layout](base()), views[layout](base())  # (N, H, D)
    k = torch.randn(N, H, D, generator=gen)
    g = torch.randn(3, N, H, D, generator=gen)
    want = torch.stack([torch.einsum("nhd,nhe->hde", x.double(), gt.double()) for x, gt in zip((q, k, v), g)])
    got = _transform_grads(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), g.to(DEVICE))
    assert got.dtype == torch.float32 and got.shape == (3, H, D, D)
    close(got.cpu(), want, RTOL[torch.float32], ATOL[torch.float32], "dA")


def test_reference_equals_unfused_model_path():
    """The reference is the model's unfused arithmetic (einsum transform, then apply_rope), in float64."""
    B, T, H, D = 2, 9, 2, 8
    q, k, v, A, cos, sin = (t.cpu() for t in problem(B, T, H, D, torch.float64))
    q, k, v, A = q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), A.double().requires_grad_()
    want = unfused(q, k, v, A, cos, sin, B)
    got = R.rope_transform_forward(q, k, v, A, cos, sin)
    g = [torch.randn_like(t) for t in want]
    dwant = torch.autograd.grad(want, (q, k, v, A), g)
    dgot = R.rope_transform_backward(*g, q, k, v, A, cos, sin)
    for a, b in zip(got + dgot, want + dwant, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_reference_rounds_like_the_unfused_path():
    """bfloat16: each output rounded once from the float32 product, v A_2 as the unfused einsum rounds it."""
    q, k, v, A, cos, sin = (t.cpu() for t in problem(2, 9, 2, 16, torch.bfloat16))
    vg = R.rope_transform_forward(q, k, v, A, cos, sin)[4]
    assert vg.dtype == torch.bfloat16
    torch.testing.assert_close(vg, torch.einsum("nhd,hde->nhe", v, A[2].to(v.dtype)), atol=0, rtol=0)


@pytest.mark.parametrize("use_triton", [False, True])
def test_opcheck(use_triton):
    """Schema, fake (meta) outputs, registered autograd (reference inside; the kernels interpreted on CPU)."""
    q, k, v, A, cos, sin = problem(2, 5, 2, HEAD_DIMS[0], torch.float32)  # the GPU's dots need D >= 32
    for t in (q, k, v, A):
        t.requires_grad_()
    torch.library.opcheck(ops.rope_transform_fwd, (q, k, v, A, cos, sin, use_triton))
    grads = [torch.randn_like(q) for _ in range(5)]
    torch.library.opcheck(ops.rope_transform_bwd, (*grads, q.detach(), k.detach(), v.detach(), A.detach(), cos, sin,
                                                   use_triton))


def test_op_gradients_equal_autograd_of_the_formula():
    """The op's registered backward equals autograd through the formula (float64, reference inside), also when
    only some outputs are used."""
    B, T, H, D = 1, 11, 2, 8
    q, k, v, A, cos, sin = (t.cpu() for t in problem(B, T, H, D, torch.float64))
    xs = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), A.double().requires_grad_())
    got, want = ops.rope_transform(*xs, cos, sin), unfused(*xs, cos, sin, B)
    g = [torch.randn_like(t) for t in got]
    for a, b in zip(torch.autograd.grad(got, xs, g), torch.autograd.grad(want, xs, g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    for out, x in ((2, q), (4, v)):  # one output, the gradients of its input and of A
        a = torch.autograd.grad(ops.rope_transform(*xs, cos, sin)[out].sum(), (x, xs[3]))
        b = torch.autograd.grad(unfused(*xs, cos, sin, B)[out].sum(), (x, xs[3]))
        for da, db in zip(a, b):
            torch.testing.assert_close(da, db, atol=1e-12, rtol=0)


def test_bad_inputs_are_named():
    q, k, v, A, cos, sin = problem(2, 5, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"A \(3, H, D, D\); got \(10, 2, 16\), \(10, 2, 16\), \(10, 2, 16\) and "
                                         r"\(2, 2, 16, 16\)"):
        ops.rope_transform(q, k, v, A[:2], cos, sin)
    with pytest.raises(ValueError, match=r"of one shape.*\(9, 2, 16\)"):
        ops.rope_transform(q, k, v[:9], A, cos, sin)
    with pytest.raises(ValueError, match="one dtype"):
        ops.rope_transform(q, k, v.double(), A, cos, sin)
    with pytest.raises(ValueError, match="T dividing"):
        ops.rope_transform(q, k, v, A, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="head dim"):
        xs = torch.zeros(4, 2, 24, device=DEVICE)
        c = torch.zeros(4, 12, device=DEVICE)
        ops.rope_transform(xs, xs, xs, torch.zeros(3, 2, 24, 24, device=DEVICE), c, c, use_triton=True)


class _SeparateOps(dispatch.AttentionOps):
    """The branches as separate ops (the op pair: test_logo_branches.py), with the fused RoPE + transform or (not
    `fused`) the einsum + RoPE, and the branch inputs recomputed in the backward or kept."""

    def __init__(self, fused: bool, recompute: str):
        self.fused, self.recompute = fused, recompute

    def fuses_branches(self, q, A, backend):
        return False

    def recomputes_branch_inputs(self):
        return torch.is_grad_enabled() and self.recompute == "always"

    def fuses_rope_transform(self, q, A, backend):
        return self.fused and super().fuses_rope_transform(q, A, backend)


def _layer(fused: bool, recompute: str = "never"):
    D = HEAD_DIMS[-1]
    torch.manual_seed(0)
    cfg = ModelConfig(dim=2 * D, n_heads=2, n_layers=1,
                      attention=AttentionConfig(kind="logo", window=8, backend="triton", gate_init_std=0.5))
    layer = LoGoAttention(cfg).to(DEVICE)
    layer.attention_ops = _SeparateOps(fused, recompute)
    layer.init_weights(0.5, 0.5)
    with torch.no_grad():  # a transform away from identity, so its gradient and product matter
        layer.transform.A.add_(0.1 * torch.randn_like(layer.transform.A))
    return layer, cfg, D


def _run(layer, cfg, D):
    B, T = 2, 24
    x = torch.randn(B, T, cfg.dim, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(3),
                    requires_grad=True)
    seqs = PackedSeqs.build(B, T, DEVICE, torch.tensor([0, 10, 24, 31, 48], dtype=torch.int32, device=DEVICE))
    cos, sin = rope_cos_sin(T, D, 10000.0, DEVICE)
    with kept_for_backward() as kept:
        out, _, stats = layer(x, cos, sin, seqs)
    assert 0 < stats[0] < B * T
    out.square().sum().backward()
    grads = (x.grad, layer.transform.A.grad, layer.wq.weight.grad, layer.wv.weight.grad)
    return (out.detach(), *grads), sum(kept.values())


def test_logo_layer_fused_equals_unfused(monkeypatch):
    """The LoGo layer on the Triton backend: fused RoPE + transform (q, k, v) against the unfused einsum + RoPE
    (the PyTorch composition without the fused kernel), float32: output and the gradients of x, A (each transform's), W_q, W_v; the fused
    op runs only when on."""
    calls = []
    monkeypatch.setattr(dispatch, "rope_transform", lambda *a, **k: calls.append(1) or ops.rope_transform(
        *a[:6], use_triton=True))
    fused, _ = _run(*_layer(True))
    assert len(calls) == 1  # q, k and v together
    plain, _ = _run(*_layer(False))
    assert len(calls) == 1
    fused, plain = fused[:2] + tuple(fused[2]) + fused[3:], plain[:2] + tuple(plain[2]) + plain[3:]
    for name, a, b in zip(("out", "dx", "dA_q", "dA_k", "dA_v", "dWq", "dWv"), fused, plain, strict=True):
        close(a, b, 2e-5, 1e-6, name)


def test_fused_op_is_recomputed_not_kept():
    """Branch inputs recomputed in the backward: the fused op's five outputs are recomputed in the backward (not kept),
    with the same gradients."""
    (out, *grads), kept_never = _run(*_layer(True, "never"))
    (out_r, *grads_r), kept_always = _run(*_layer(True, "always"))
    layer, cfg, D = _layer(True)
    one_nhd = 2 * 24 * cfg.dim * 4  # one (N, H, D) float32 tensor
    assert kept_never - kept_always >= 5 * one_nhd, (kept_never, kept_always)
    torch.testing.assert_close(out_r, out, atol=0, rtol=0)
    for a, b in zip(grads_r, grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
