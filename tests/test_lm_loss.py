"""logo/model/lm_head.py: the chunked (CPU) and liger (GPU) fused linear + cross-entropy equal the plain loss
(materialised logits + F.cross_entropy) in value and gradients, inside the model and over training steps.

Tolerances: fp32 rtol 1e-5 (only the summation order differs; model gradients within 1e-5 of their norm); bf16 autocast: loss rtol 2e-3, gradients
within 2% of their norm (the plain path rounds the whole weight gradient to bf16 once, the chunked path
accumulates per-chunk bf16 products in fp32); training curves: fp32 rtol 1e-4 over 3 steps, bf16 rtol 1e-2.
"""
from contextlib import nullcontext

import pytest
import torch

from data.loader import IGNORE_INDEX, Batch, StepData
from logo.config import AttentionConfig, ConfigError, model_config
from logo.model import BudgetController, Transformer
from logo.model import lm_head
from logo.model.lm_head import linear_cross_entropy_sum, lm_loss_sum, resolve_loss_impl
from logo.train.step import DivergenceMonitor, make_optimizer, optimizer_step, read_back, train_step

CPU = torch.device("cpu")


def operands(n=61, d=24, v=200, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = (0.3 * torch.randn(v, d, generator=g, dtype=dtype)).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = IGNORE_INDEX  # padding / document ends
    return h, w, y


def loss_and_grads(impl, h, w, y, scale=0.37, **kw):
    h.grad = w.grad = None
    loss = linear_cross_entropy_sum(h, w, y, impl) if not kw else lm_head.chunked_loss_sum(h, w, y, **kw)
    (scale * loss).backward()  # a grad_out != 1, as the trainer's 1 / target_tokens scaling
    return loss.detach(), h.grad.clone(), w.grad.clone()


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_ignore_index_is_the_loaders():
    assert lm_head.IGNORE_INDEX == IGNORE_INDEX


@pytest.mark.parametrize("chunk_rows", [7, 61, 1000])  # uneven chunks, exactly one, more rows than tokens
def test_chunked_equals_plain_fp32(chunk_rows):
    h, w, y = operands()
    ref = loss_and_grads("plain", h, w, y)
    got = loss_and_grads("chunked", h, w, y, chunk_rows=chunk_rows)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ref[0].dtype == got[0].dtype == torch.float32


def test_chunked_equals_plain_bf16_autocast():
    h, w, y = operands(n=96, d=64, v=512)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_and_grads("plain", h, w, y)
        got = loss_and_grads("chunked", h, w, y, chunk_rows=20)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-3, atol=0)
    assert got[1].dtype == h.dtype and got[2].dtype == w.dtype  # fp32 parameters get fp32 gradients
    assert rel_err(got[1], ref[1]) < 2e-2 and rel_err(got[2], ref[2]) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_plain_loss_equals_eager(dtype):
    """The plain loss compiled (what the CUDA trainer runs on the logits) equals the eager one in value and in
    the logits' gradient (bf16 logits: within their rounding), ignored targets included."""
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(2, 37, 300, generator=g)).to(dtype).requires_grad_()
    y = torch.randint(0, 300, (2, 37), generator=g)
    y[:, ::4] = IGNORE_INDEX
    out = []
    for fn in (lm_loss_sum, lm_head.fused_lm_loss_sum):
        logits.grad = None
        loss = fn(logits, y)
        (0.37 * loss).backward()
        out.append((loss.detach(), logits.grad.clone()))
    assert out[1][0].dtype == torch.float32 and out[1][1].dtype == dtype
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[1][1].float(), out[0][1].float(), rtol=tol, atol=tol)
    assert float(out[1][1][:, ::4].abs().max()) == 0.0  # no gradient at ignored targets


def test_all_targets_ignored_and_no_grad():
    h, w, y = operands(n=9)
    y[:] = IGNORE_INDEX
    got = loss_and_grads("chunked", h, w, y, chunk_rows=4)
    assert got[0].item() == 0.0 and not got[1].any() and not got[2].any()
    h, w, y = operands()
    with torch.no_grad():  # evaluation: the loss only
        torch.testing.assert_close(linear_cross_entropy_sum(h, w, y, "chunked"),
                                   linear_cross_entropy_sum(h, w, y, "plain"), rtol=1e-5, atol=0)


def tiny_model(kind="logo", seed=0, n_layers=4):
    torch.manual_seed(seed)
    cfg = model_config("tiny", vocab_size=300, n_layers=n_layers,
                       attention=AttentionConfig(kind=kind, window=8, gamma=0.01))
    model = Transformer(cfg)
    model.init_weights()
    return model


def packed_batch(seed, rows=2, T=32, V=300):
    """Two rows with documents (cu_seqlens) and padding at the end of the second row."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (rows, T + 1), generator=g)
    valid = torch.ones(rows, T, dtype=torch.bool)
    valid[1, T - 5:] = False
    labels = t[:, 1:].clone()
    labels[~valid] = IGNORE_INDEX
    labels[0, 12] = IGNORE_INDEX  # a document end
    cu = torch.tensor([0, 13, T, 2 * T - 5, 2 * T], dtype=torch.int32)
    return Batch(t[:, :-1], labels, cu, valid)


@pytest.mark.parametrize("kind", ["full", "logo"])
def test_model_forward_with_labels_equals_logits_loss(kind):
    """model(..., labels=) gives the loss of model(...).logits and the same gradient for every parameter."""
    b = packed_batch(3)
    grads = {}
    for impl in ("plain-logits", "chunked"):
        model = tiny_model(kind)
        if impl == "chunked":
            out = model(b.inputs, cu_seqlens=b.cu_seqlens, valid=b.valid, labels=b.labels, loss_impl="chunked")
            assert out.logits is None
            loss = out.loss_sum
        else:
            loss = lm_loss_sum(model(b.inputs, cu_seqlens=b.cu_seqlens, valid=b.valid).logits, b.labels)
        loss.backward()
        grads[impl] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (l0, g0), (l1, g1) = grads.values()
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=0)
    assert g0.keys() == g1.keys() and "output.weight" in g0
    worst = max(rel_err(g1[n], g0[n]) for n in g0)  # each gradient within 1e-5 of its norm (fp32)
    assert worst < 1e-5, worst


def curve(impl, bf16, steps=3):
    model = tiny_model("logo", seed=1, n_layers=2)
    opt = make_optimizer(model, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ctrl, monitor = BudgetController(model), DivergenceMonitor(CPU)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    losses = []
    for step in range(1, steps + 1):
        micro = [packed_batch(10), packed_batch(11)]  # the same batch each step: the loss must fall
        n = sum(int((m.labels != IGNORE_INDEX).sum()) for m in micro)
        out = train_step(model, StepData(micro, n), device=CPU, autocast=autocast, ctrl=ctrl, grad_clip=1.0,
                         world=1, data_parallel=False, loss_impl=impl)
        optimizer_step(opt, sched, ctrl, out, monitor, step)
        losses.append(read_back(out, monitor)[0])
    return torch.tensor(losses)


@pytest.mark.parametrize("bf16,rtol", [(False, 1e-4), (True, 1e-2)])
def test_training_curve_chunked_equals_plain(bf16, rtol):
    plain, chunked = curve("plain", bf16), curve("chunked", bf16)
    assert plain[-1] < plain[0]  # it trains
    torch.testing.assert_close(chunked, plain, rtol=rtol, atol=0)


def test_resolve_and_config_errors():
    assert resolve_loss_impl("auto", "cpu") == "chunked"
    assert resolve_loss_impl("plain", "cpu") == "plain"
    # auto on CUDA: plain (faster under compile) below 4 GiB of fp32 logits per micro-batch, liger from there
    from logo.model.lm_head import liger_available
    assert resolve_loss_impl("auto", "cuda", 8192 * 100352) == "plain"  # 1.5B at 8k: 3.1 GiB
    assert resolve_loss_impl("auto", "cuda", 32768 * 100352) == ("liger" if liger_available() else "plain")
    with pytest.raises(ValueError, match=r"^invalid config train.loss='liger': liger-kernel needs a CUDA device"):
        resolve_loss_impl("liger", "cpu")
    from logo.run.config import compose
    with pytest.raises(ConfigError, match=r"^invalid config train.loss='fused': choose one of"):
        compose(["train.loss=fused"])


_LIGER_INTERPRETED = """
import torch
from logo.model import lm_head
from logo.model.lm_head import lm_loss_sum
from tests.test_lm_loss import operands, rel_err
h, w, y = operands(n=48, d=32, v=200)
res = []
for loss_fn in (lambda: lm_head.liger_loss_sum(h, w, y), lambda: lm_loss_sum(h @ w.t(), y)):
    h.grad = w.grad = None
    loss = loss_fn()
    (0.37 * loss).backward()
    res.append((loss.detach(), h.grad.clone(), w.grad.clone()))
(l1, dh1, dw1), (l2, dh2, dw2) = res
assert l1.dtype == torch.float32 and dh1.dtype == h.dtype and dw1.dtype == w.dtype
torch.testing.assert_close(l1, l2, rtol=1e-5, atol=0)
assert rel_err(dh1, dh2) < 1e-5 and rel_err(dw1, dw2) < 1e-5, (rel_err(dh1, dh2), rel_err(dw1, dw2))
print("ok")
"""


def test_liger_function_under_the_triton_interpreter():
    """Our autograd function around liger-kernel's fused forward, its Triton kernels run by the interpreter on
    CPU (fp32): loss and gradients equal the plain loss's, with a grad_out != 1 scaled in our backward."""
    pytest.importorskip("liger_kernel")
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _LIGER_INTERPRETED], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fsdp_like", [False, True])
def test_liger_equals_plain_gpu(fsdp_like):
    """liger-kernel vs plain on a GPU, 1.5B head shape: bf16 autocast with fp32 weights (one GPU), or bf16
    weights and activations without autocast (FSDP's mixed precision). Loss rtol 1e-3, gradients within 2%."""
    pytest.importorskip("liger_kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 4096, 2048, 100352
    dt = torch.bfloat16 if fsdp_like else torch.float32
    h = torch.randn(n, d, device="cuda", generator=g).to(dt).requires_grad_()
    w = (d ** -0.5 * torch.randn(v, d, device="cuda", generator=g)).to(dt).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[::7] = IGNORE_INDEX
    ctx = nullcontext() if fsdp_like else torch.autocast("cuda", dtype=torch.bfloat16)
    res = {}
    for impl in ("plain", "liger", "chunked"):
        with ctx:
            res[impl] = loss_and_grads(impl, h, w, y)
    for impl in ("liger", "chunked"):
        torch.testing.assert_close(res[impl][0], res["plain"][0], rtol=1e-3, atol=0)
        assert res[impl][1].dtype == h.dtype and res[impl][2].dtype == w.dtype
        assert rel_err(res[impl][1], res["plain"][1]) < 2e-2 and rel_err(res[impl][2], res["plain"][2]) < 2e-2
    # our backward scales liger's stored gradients on the device: nothing in it waits for the GPU
    h.grad = w.grad = None
    with ctx:
        loss = linear_cross_entropy_sum(h, w, y, "liger")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (0.37 * loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
