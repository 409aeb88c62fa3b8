"""The fused ContextNorm + fusion op (`logo::context_fuse_fwd/bwd`): the Triton kernels against the pure-PyTorch
reference, the reference against the model's unfused expression, opcheck, and the LoGo layer with the fused path
equal to the unfused one.

Kernel vs reference (reference in float64 on the kernel's inputs; ||out - ref|| <= rtol ||ref|| + atol sqrt(numel)):
- float32: rtol 1e-5 (reduction order only).
- bfloat16: rtol 2e-2. Both sides round each norm's output and the gradient entering each norm to bf16; the
  float64 reference rounds nothing, so the bound is bf16's relative precision with margin.
On a machine without a GPU the kernels run under the Triton CPU interpreter (conftest.py).
"""
import pytest
import torch

from logo.config import AttentionConfig, ModelConfig
from logo.kernels import dispatch, ops
from logo.kernels import reference as R
from logo.model.logo_attention import LoGoAttention

from conftest import close_in_norm as close, logo_layer_step

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HEAD_DIMS = (64, 128) if CUDA else (16, 32)
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
EPS = 1e-5


def problem(N, H, D, dtype, select, seed=0, device=DEVICE):
    """Branch outputs of different scales (as the two attention ops give), gates, a selection, weights off one."""
    g = torch.Generator().manual_seed(seed)
    o_local = 0.5 * torch.randn(N, H, D, generator=g, dtype=torch.float64)
    o_global = 2.0 * torch.randn(N, H, D, generator=g, dtype=torch.float64)
    p = torch.rand(N, generator=g, dtype=torch.float64)
    z = {"none": torch.zeros(N, dtype=torch.bool), "all": torch.ones(N, dtype=torch.bool),
         "some": torch.rand(N, generator=g) < 0.5}[select]
    w_local, w_global = (1 + 0.3 * torch.randn(H, D, generator=g, dtype=torch.float64) for _ in range(2))
    to = dict(device=device)
    return (o_local.to(dtype=dtype, **to), o_global.to(dtype=dtype, **to), p.to(dtype=torch.float32, **to),
            z.to(**to), w_local.to(dtype=torch.float32, **to), w_global.to(dtype=torch.float32, **to))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("select", ["some", "none", "all"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "additive"])
def test_kernel_matches_reference(select, D, dtype, weighted):
    """Output and all five gradients, over a row count that is not a multiple of the block."""
    N, H = 45, 3
    o_l, o_g, p, z, w_l, w_g = problem(N, H, D, dtype, select, seed=D)
    grad = torch.randn(N, H, D, generator=torch.Generator().manual_seed(1)).to(device=DEVICE, dtype=dtype)
    d64 = [t.double() for t in (o_l, o_g, p)]
    want = (R.context_fuse_forward(*d64, z, w_l.double(), w_g.double(), EPS, weighted),
            *R.context_fuse_backward(grad.double(), *d64, z, w_l.double(), w_g.double(), EPS, weighted))
    got = (ops.context_fuse_fwd(o_l, o_g, p, z, w_l, w_g, EPS, weighted, True),
           *ops.context_fuse_bwd(grad, o_l, o_g, p, z, w_l, w_g, EPS, weighted, True))
    assert got[0].dtype == dtype and got[3].dtype == torch.float32 and got[4].dtype == torch.float32
    for name, a, b in zip(("out", "d_local", "d_global", "dp", "dw_local", "dw_global"), got, want):
        close(a, b, RTOL[dtype], ATOL[dtype], name)
    if select != "all":  # unselected rows: exactly Norm^L(O^L), no gradient into the global branch or the gate
        keep = ~z
        assert (got[2][keep] == 0).all() and (got[3][keep] == 0).all()


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "additive"])
def test_reference_equals_model_expression(weighted):
    """The reference is the layer's unfused arithmetic (two RMSNorm modules, the fusion, the where), in float64,
    outputs and gradients."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_heads=2, n_layers=1, attention=AttentionConfig(
        kind="logo", fusion="weighted" if weighted else "additive", backend="reference")).validate()
    layer = LoGoAttention(cfg).double()
    layer.init_weights(0.02, 0.02)
    with torch.no_grad():
        layer.norm_local.weight.add_(0.3 * torch.randn_like(layer.norm_local.weight))
        layer.norm_global.weight.add_(0.3 * torch.randn_like(layer.norm_global.weight))
    o_l, o_g, p, z, _, _ = problem(13, 2, 16, torch.float64, "some", device="cpu")
    ins = [o_l.requires_grad_(), o_g.requires_grad_(), p.double().requires_grad_()]
    want = layer.fuse(*ins, z)
    got = R.context_fuse_forward(*ins, z, layer.norm_local.weight, layer.norm_global.weight, cfg.norm_eps, weighted)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    grad = torch.randn_like(want)
    params = [layer.norm_local.weight, layer.norm_global.weight]
    dwant = torch.autograd.grad(want, ins + params, grad)
    dgot = R.context_fuse_backward(grad, *ins, z, *params, cfg.norm_eps, weighted)
    for a, b in zip(dgot, dwant):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("use_triton", [False, True])
def test_opcheck(use_triton):
    """Schema, fake (meta) outputs, registered autograd (reference inside; the kernels interpreted on CPU)."""
    o_l, o_g, p, z, w_l, w_g = problem(10, 2, HEAD_DIMS[0], torch.float32, "some")
    for t in (o_l, o_g, p, w_l, w_g):
        t.requires_grad_()
    torch.library.opcheck(ops.context_fuse_fwd, (o_l, o_g, p, z, w_l, w_g, EPS, True, use_triton))


def test_bad_inputs_are_named():
    o_l, o_g, p, z, w_l, w_g = problem(6, 2, 16, torch.float32, "some")
    with pytest.raises(ValueError, match=r"p and z \(N,\)"):
        ops.context_fuse(o_l, o_g, p[:3], z, w_l, w_g, EPS)
    with pytest.raises(ValueError, match=r"\(H, D\) = \(2, 16\)"):
        ops.context_fuse(o_l, o_g, p, z, w_l[0], w_g, EPS)
    with pytest.raises(ValueError, match="z bool"):
        ops.context_fuse(o_l, o_g, p, z.float(), w_l, w_g, EPS)
    with pytest.raises(ValueError, match="head dim"):
        x = torch.zeros(4, 2, 24, device=DEVICE)
        w = torch.ones(2, 24, device=DEVICE)
        ops.context_fuse(x, x, p[:4], z[:4], w, w, EPS, use_triton=True)


def _layer(fused: bool, fusion: str):
    D = HEAD_DIMS[-1]
    torch.manual_seed(0)
    cfg = ModelConfig(dim=2 * D, n_heads=2, n_layers=1, attention=AttentionConfig(
        kind="logo", window=8, backend="triton", gate_init_std=0.5, fusion=fusion)).validate()
    layer = LoGoAttention(cfg).to(DEVICE)
    layer.init_weights(0.5, 0.5)
    with torch.no_grad():  # norm weights away from one, so their gradients and products matter
        for norm in (layer.norm_local, layer.norm_global):
            norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    return layer, cfg


@pytest.mark.parametrize("fusion", ["weighted", "additive"])
def test_logo_layer_fused_equals_unfused(fusion, monkeypatch):
    """The LoGo layer on the Triton backend, float32: output and the gradients of x, the gate, both norm weights
    and W_o, fused against the PyTorch expression (where `dispatch.fuses_context_norm` says no); the fused op runs
    only where it says yes."""
    calls = []
    real, fuses = dispatch.context_fuse, dispatch.fuses_context_norm
    monkeypatch.setattr(dispatch, "context_fuse", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = []
    for fused in (True, False):
        monkeypatch.setattr(dispatch, "fuses_context_norm", fuses if fused else lambda *a, **k: False)
        layer, _ = _layer(fused, fusion)
        out, dx, stats = logo_layer_step(layer)
        assert 0 < stats[0] < 48
        results.append((out, dx, layer.gate.weight.grad, layer.norm_local.weight.grad,
                        layer.norm_global.weight.grad, layer.wo.weight.grad))
        assert len(calls) == 1  # the fused run only
    for name, a, b in zip(("out", "dx", "dgate", "dw_local", "dw_global", "dWo"), *results):
        close(a, b, 2e-5, 1e-6, name)
