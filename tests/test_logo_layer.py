"""Properties of the LoGo layer (paper Eq. 4-10) on random inputs, in float64 unless stated."""
import math

import pytest
import torch

from logo.config import AttentionConfig, ModelConfig
from logo.kernels import dispatch
from logo.model.layers import PackedSeqs, autocast_input, rope_cos_sin
from logo.model.logo_attention import LoGoAttention
from logo.model.routing import routing_stats

from conftest import close_in_norm, kept_for_backward


def make_layer(seed=0, dim=48, heads=3, window=5, randomize=True, **attn):
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=dim, n_layers=2, n_heads=heads, vocab_size=64,
                      attention=AttentionConfig(kind="logo", window=window, **attn)).validate()
    layer = LoGoAttention(cfg)
    layer.init_weights(0.3, 0.3)
    if randomize:  # move every transform/norm/gate parameter off its identity init so it matters
        with torch.no_grad():
            for name, prm in layer.named_parameters():
                if not name.startswith("w"):
                    prm.add_(0.2 * torch.randn_like(prm))
            layer.gate.weight.normal_(0, 0.5)
    return layer.double()


def inputs(B, T, dim, docs=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, dim, dtype=torch.float64, generator=g)
    cu = torch.tensor(docs, dtype=torch.int32) if docs is not None else None
    seqs = PackedSeqs.build(B, T, "cpu", cu)
    cos, sin = rope_cos_sin(T, dim // 3 if dim == 48 else dim, 10000.0, "cpu", dtype=torch.float64)
    return x, seqs, cos, sin


def rope_complex(u, theta=10000.0):
    """Independent RoPE: rotate consecutive pairs as complex numbers. u (T, H, D) float64."""
    T, H, D = u.shape
    freqs = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    rot = torch.polar(torch.ones(T, D // 2, dtype=torch.float64), torch.outer(torch.arange(T).double(), freqs))
    uc = torch.view_as_complex(u.reshape(T, H, D // 2, 2).contiguous())
    return torch.view_as_real(uc * rot[:, None, :]).reshape(T, H, D)


def dense_logo_reference(layer, x, seqs, threshold):
    """Eq. 4-10 computed densely with explicit T x T masks, one sequence row at a time."""
    a = layer.attn_cfg
    B, T, d = x.shape
    H, D = layer.n_heads, layer.head_dim
    out = torch.empty(B, T, d, dtype=torch.float64)
    seq_id = seqs.seq_id.view(B, T)
    for b in range(B):
        xb = x[b]
        q, k, v = (xb @ w.weight.T for w in (layer.wq, layer.wk, layer.wv))
        q, k, v = (t.view(T, H, D) for t in (q, k, v))
        if a.transform == "lp":
            qg, kg, vg = (torch.stack([u[:, h] @ layer.transform.A[i, h] for h in range(H)], 1)
                          for i, u in enumerate((q, k, v)))
        elif a.transform == "so":
            qg, kg, vg = (u * layer.transform.scale[i] + layer.transform.offset[i] for i, u in enumerate((q, k, v)))
        elif a.transform == "full":
            qg, kg, vg = ((xb @ w.weight.T).view(T, H, D) for w in (layer.wq_g, layer.wk_g, layer.wv_g))
        else:
            qg, kg, vg = q, k, v
        t_idx = torch.arange(T)
        same_doc = seq_id[b][:, None] == seq_id[b][None, :]
        causal = same_doc & (t_idx[None, :] <= t_idx[:, None])
        local = causal & (t_idx[:, None] - t_idx[None, :] < a.window)

        def attn(qq, kk, vv, mask):
            s = torch.einsum("thd,shd->hts", rope_complex(qq), rope_complex(kk)) / math.sqrt(D)
            s = s.masked_fill(~mask[None], float("-inf"))
            return torch.einsum("hts,shd->thd", s.softmax(-1), vv)

        def norm(o, which):
            if not a.context_norm:
                return o
            w = (layer.norm_local if which == "L" else layer.norm_global).weight
            return o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w

        o_l = norm(attn(q, k, v, local), "L")
        o_g = norm(attn(qg, kg, vg, causal), "G")
        p = torch.sigmoid(xb @ layer.gate.weight)[:, None, None]
        z = (p > threshold)
        fused = (1 - p) * o_l + p * o_g if a.fusion == "weighted" else o_l + p * o_g
        o = torch.where(z, fused, o_l)
        out[b] = o.reshape(T, H * D) @ layer.wo.weight.T
    return out


VARIANTS = [
    dict(),
    dict(transform="so"),
    dict(transform="shared"),
    dict(transform="full"),
    dict(context_norm=False),
    dict(transform="so", context_norm=False),
    dict(fusion="additive"),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "lp")
@pytest.mark.parametrize("docs", [None, [0, 9, 20, 22, 23, 40]], ids=["rows", "documents"])
def test_all_selected_matches_dense_eq10(variant, docs):
    """With every row selected (b far below p), the layer equals a dense computation of Eq. 10."""
    layer = make_layer(**variant)
    x, seqs, cos, sin = inputs(2, 20, 48, docs)
    layer.threshold.fill_(-1.0)
    out, _, stats = layer(x, cos, sin, seqs)
    assert stats[0] == 40  # every row selected
    torch.testing.assert_close(out, dense_logo_reference(layer, x, seqs, -1.0), atol=1e-10, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS[:2] + VARIANTS[-1:])
def test_partial_selection_matches_dense(variant):
    layer = make_layer(seed=4, **variant)
    x, seqs, cos, sin = inputs(2, 20, 48, [0, 9, 20, 22, 23, 40], seed=5)
    b = float(layer.gate_probs(x).detach().median())
    layer.threshold.fill_(b)
    out, _, stats = layer(x, cos, sin, seqs)
    assert 0 < stats[0] < 40
    torch.testing.assert_close(out, dense_logo_reference(layer, x, seqs, b), atol=1e-10, rtol=0)


def local_only_output(layer, x, cos, sin, seqs):
    """Norm^L(SWA(q, k, v)) for every row, computed without the global branch."""
    from logo.kernels.reference import sliding_window_attention
    from logo.kernels.rope import apply_rope
    q, k, v = layer.project(x)
    o = sliding_window_attention(apply_rope(q, cos, sin).flatten(0, 1), apply_rope(k, cos, sin).flatten(0, 1),
                                 v.flatten(0, 1), seqs.cu_seqlens, layer.window)
    return layer.norm_local(o)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unselected_rows_equal_local_output_exactly(dtype, seed):
    layer = make_layer(seed=seed).to(dtype)
    x, seqs, cos, sin = inputs(3, 33, 48, seed=seed + 10)
    x = x.to(dtype)
    p = layer.gate_probs(x)
    layer.threshold.fill_(float(p.detach().quantile(0.4)))
    o, _, z, _ = _mix(layer, x, cos, sin, seqs)
    assert 0 < int(z.sum()) < z.numel()
    ref = local_only_output(layer, x, cos, sin, seqs)
    assert torch.equal(o[~z], ref[~z])  # bitwise
    assert not torch.allclose(o[z], ref[z])  # selected rows really mix in the global branch


def test_gate_gradient_flows_only_through_selected_rows():
    layer = make_layer(seed=3)
    x, seqs, cos, sin = inputs(2, 25, 48, seed=8)
    captured = {}
    original = layer.gate_probs

    def spy(xx, x_low=None):
        p = original(xx, x_low)
        p.register_hook(lambda g: captured.setdefault("grad", g))
        return p

    layer.gate_probs = spy
    layer.threshold.fill_(float(original(x).detach().median()))
    o, p, z, _ = _mix(layer, x, cos, sin, seqs)
    (o * torch.randn_like(o)).sum().backward()
    g = captured["grad"]
    assert torch.all(g[~z] == 0)
    assert torch.all(g[z] != 0)


def test_padding_is_never_routed_nor_counted():
    layer = make_layer(seed=6)
    B, T = 2, 16
    x = torch.randn(B, T, 48, dtype=torch.float64)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 10:] = False
    seqs = PackedSeqs.build(B, T, "cpu", torch.tensor([0, 16, 26, 32], dtype=torch.int32), valid)
    cos, sin = rope_cos_sin(T, 16, 10000.0, "cpu", dtype=torch.float64)
    layer.threshold.fill_(-1.0)  # everything valid selected
    out, _, stats = layer(x, cos, sin, seqs)
    _, _, z, _ = _mix(layer, x, cos, sin, seqs)
    assert stats[0] == 26 and stats[1] == 26
    assert not z.view(B, T)[1, 10:].any()


@pytest.mark.parametrize("kind", ["logo", "full", "local", "intra_layer", "inter_layer"])
def test_attention_never_crosses_documents(kind):
    from logo.config import model_config
    from logo.model import Transformer
    torch.manual_seed(0)
    cfg = model_config("tiny", vocab_size=500, attention=AttentionConfig(kind=kind, window=4))
    model = Transformer(cfg)
    model.init_weights()
    model.double()  # float64: other documents may change the packing, hence float32 summation order
    tokens = torch.randint(0, 500, (2, 24))
    cu = torch.tensor([0, 10, 24, 30, 48], dtype=torch.int32)
    base = model(tokens, cu_seqlens=cu).logits
    changed = tokens.clone()
    changed[0, :10] = torch.randint(0, 500, (10,))  # rewrite the first document of row 0
    after = model(changed, cu_seqlens=cu).logits
    torch.testing.assert_close(base[0, 10:], after[0, 10:], atol=1e-12, rtol=0)  # other documents untouched
    torch.testing.assert_close(base[1], after[1], atol=1e-12, rtol=0)
    assert not torch.allclose(base[0, :10], after[0, :10])


@pytest.mark.parametrize("kind", ["logo", "full", "local", "intra_layer", "inter_layer"])
def test_bucketed_document_offsets_change_nothing(kind):
    """A micro-batch's offsets padded to a power-of-two length (`data.loader.bucket_doc_offsets`: empty documents
    at the end, a static shape for CUDA graphs) give every kind the same loss and gradients in float64."""
    from data.loader import bucket_doc_offsets
    from logo.config import model_config
    from logo.model import Transformer
    torch.manual_seed(0)
    cfg = model_config("tiny", vocab_size=500, attention=AttentionConfig(kind=kind, window=4))
    model = Transformer(cfg)
    model.init_weights()
    model.double()
    with torch.no_grad():  # a gate that selects some rows and not others
        for m in model.modules():
            if isinstance(m, LoGoAttention):
                m.gate.weight.normal_(0, 0.5)
    tokens = torch.randint(0, 500, (2, 24))
    labels = torch.randint(0, 500, (2, 24))
    cu = torch.tensor([0, 10, 24, 30, 31, 48], dtype=torch.int32)
    padded = bucket_doc_offsets(cu, rows=2)
    assert padded.shape == (16,) and torch.equal(padded[:6], cu) and (padded[6:] == 48).all()
    results = []
    for offsets in (cu, padded):
        model.zero_grad()
        out = model(tokens, cu_seqlens=offsets, labels=labels, loss_impl="plain")
        out.loss_sum.backward()
        results.append((out.loss_sum.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss, grads), (loss2, grads2) = results
    torch.testing.assert_close(loss2, loss, atol=1e-12, rtol=0)
    assert len(grads) == len(grads2)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)


def test_gate_logit_is_fp32_under_autocast():
    """Routing decisions compare p with the threshold: the gate's product stays fp32 under bf16 autocast."""
    from logo.model.logo_attention import Gate
    torch.manual_seed(0)
    gate = Gate(256)
    torch.nn.init.normal_(gate.weight, std=0.05)  # logits of std ~0.8
    x = torch.randn(2, 64, 256)
    want = gate(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gate(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.unique(want).numel() == want.numel()  # no ties
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = torch.sigmoid(x.flatten(0, 1) @ gate.weight)  # what the gate computed before
    assert torch.unique(bf16).numel() < want.numel()


def _saved_bytes_and_grads(layer, x, seqs, cos, sin):
    """Forward + backward of the layer: (bytes of the distinct storages autograd kept, output, gradients)."""
    xx = x.clone().requires_grad_()
    with kept_for_backward() as storages:
        out, _, _ = layer(xx, cos, sin, seqs)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = [xx.grad] + [p.grad.clone() for _, p in sorted(layer.named_parameters())]
    layer.zero_grad(set_to_none=True)
    return sum(storages.values()), out.detach(), grads


def _mix(layer, x, cos, sin, seqs):
    """The layer's output before W_o (N, H, D), p (N,), z (N,) and its routing stats (K,)."""
    x_low = autocast_input(x)
    o, p, z = layer.branches(x, x_low, *layer.project(x_low), cos, sin, seqs)
    return o, p, z, routing_stats(z, p, seqs.valid, layer.threshold, layer.attn_cfg)


class _Recompute(dispatch.AttentionOps):
    """The plain ops, recomputing the branch inputs in the backward (in eager mode too) or keeping them."""

    def __init__(self, recompute: bool):
        self.recompute = recompute

    def recomputes_branch_inputs(self):
        return self.recompute and torch.is_grad_enabled()


@pytest.mark.parametrize("variant", [dict(), dict(transform="so"), dict(transform="shared"), dict(transform="full")],
                         ids=["lp", "so", "shared", "full"])
def test_recomputing_branch_inputs_changes_nothing_but_the_kept_activations(variant):
    """Branch inputs recomputed (`AttentionOps.recomputes_branch_inputs`, vs kept): the backward recomputes the rotated local q, k and
    the global q, k, v instead of keeping them: the same outputs and gradients to the last bit (float64, the
    recomputation repeats the forward's arithmetic), and fewer (N, H, D) tensors kept: at least four fewer with a transform (the
    pre-RoPE q, k are kept instead of five rotated or transformed tensors), two with the shared one (four rotated
    tensors become q and k)."""
    x, seqs, cos, sin = inputs(2, 20, 48, docs=[0, 7, 20, 33, 40])
    layer = make_layer(seed=3, **variant)
    layer.threshold.fill_(0.5)
    results = {}
    for recompute in (False, True):
        layer.attention_ops = _Recompute(recompute)
        results[recompute] = _saved_bytes_and_grads(layer, x, seqs, cos, sin)
    (kept, out, grads), (kept_r, out_r, grads_r) = results[False], results[True]
    assert torch.equal(out_r, out)
    for a, b in zip(grads_r, grads):
        assert torch.equal(a, b)
    one_nhd = x.numel() * x.element_size()  # N * H * D elements, float64
    assert kept - kept_r >= (2 if variant.get("transform") == "shared" else 4) * one_nhd, (kept, kept_r, one_nhd)


def _kept_copies_of(x, fn):
    """Runs fn() under bf16 autocast, keeping every tensor autograd saves: (#distinct storages holding x's fp32
    values, #distinct storages holding x's bf16 rounding)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fn()
    copies = {torch.float32: set(), torch.bfloat16: set()}
    for t in saved:
        if t.dtype in copies and t.numel() == x.numel() and torch.equal(t.reshape(x.shape), x.to(t.dtype)):
            copies[t.dtype].add(t.untyped_storage().data_ptr())
    return len(copies[torch.float32]), len(copies[torch.bfloat16])


@pytest.mark.parametrize("kind", ["full", "local", "intra_layer", "logo"])
def test_eager_autocast_keeps_one_bf16_copy_of_the_attention_input(kind):
    """Eager bf16 autocast with an fp32 residual stream: the attention layer's backward keeps its input once, in
    bf16 (shared by W_q, W_k, W_v and, for LoGo, the gate's weight gradient), and never in fp32. Autocast would
    cast a non-leaf input once per projection, and the fp32 gate logit kept the fp32 input for w_g's gradient."""
    from logo.model.transformer import ATTENTION_MODULES
    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=64,
                      attention=AttentionConfig(kind=kind, window=8)).validate()
    layer = ATTENTION_MODULES[kind](cfg)
    layer.init_weights(0.2, 0.2)
    x = torch.randn(2, 32, 64, requires_grad=True)
    seqs = PackedSeqs.build(2, 32, "cpu")
    cos, sin = rope_cos_sin(32, 16, 10000.0, "cpu")
    assert _kept_copies_of(x, lambda: layer(x * 1.0, cos, sin, seqs)) == (0, 1)  # non-leaf, as in the model


def test_feed_forward_keeps_one_bf16_copy_of_its_input_under_autocast():
    from logo.model.layers import FeedForward
    torch.manual_seed(0)
    ffn = FeedForward(64, 96)
    ffn.init_weights(0.2, 0.2)
    x = torch.randn(2, 16, 64, requires_grad=True)
    assert _kept_copies_of(x, lambda: ffn(x * 1.0)) == (0, 1)  # a non-leaf input, as in the model


def test_gate_weight_gradient_from_the_bf16_copy():
    """Gate(x, x_low): the same fp32 probabilities as Gate(x); dx exact; dw_g = x_low^T g summed in fp32 (within
    bf16's rounding of x of the fp32 gradient)."""
    from logo.model.logo_attention import Gate
    torch.manual_seed(0)
    gate = Gate(64)
    torch.nn.init.normal_(gate.weight, std=0.1)
    x = torch.randn(3, 40, 64)
    g = torch.randn(120)
    grads = []
    for low in (False, True):
        xx = x.clone().requires_grad_()
        gate.zero_grad(set_to_none=True)
        p = gate(xx, xx.to(torch.bfloat16) if low else None)
        (p * g).sum().backward()
        grads.append((p.detach(), xx.grad, gate.weight.grad))
    (p0, dx0, dw0), (p1, dx1, dw1) = grads
    assert p1.dtype == torch.float32 and torch.equal(p0, p1)
    torch.testing.assert_close(dx1, dx0, rtol=1e-6, atol=1e-7)
    close_in_norm(dw1, dw0, rtol=4e-3, atol=0, what="dw_g")  # bf16 rounds x by <= 2^-9 relative
    assert not torch.equal(dw1, dw0)  # it did read the bf16 copy


def test_compiled_gate_takes_the_plain_fp32_product_under_autocast():
    """Compiled, the gate handed x_low computes the plain fp32 product (`logo.kernels.gate.gate_logit`: Inductor
    fuses its weight gradient into the block's row reductions): its gradients are eager Gate(x)'s, in fp32 under
    the caller's bf16 autocast (a bf16 dw_g would differ by ~1e-2), not the narrow copy's."""
    from logo.model.logo_attention import Gate
    torch.manual_seed(0)
    gate = Gate(64)
    torch.nn.init.normal_(gate.weight, std=0.1)
    x = torch.randn(2, 256, 64)
    weights = torch.linspace(-1, 1, 512)
    grads = []
    compiled = torch.compile(gate, backend="aot_eager", fullgraph=True)
    for fn, low in ((gate, False), (compiled, True), (gate, True)):
        xx = x.clone().requires_grad_()
        gate.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = xx * 1.0
            p = fn(y, y.to(torch.bfloat16) if low else None)
        (p * weights).sum().backward()
        grads.append((gate.weight.grad, xx.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)
    assert not torch.equal(grads[2][0], grads[0][0])  # eagerly, the narrow copy's dw_g


def test_gate_takes_the_narrow_copy_path_only_when_handed_x_low():
    """A bf16 activation (FSDP's mixed precision): Gate(x, x) keeps x itself for w_g's gradient, while Gate(x)
    (what a compiled block calls, so that Inductor fuses the plain product's gradient) keeps the fp32 upcast."""
    from logo.model.logo_attention import Gate
    gate = Gate(64)
    torch.nn.init.normal_(gate.weight, std=0.1)
    x = torch.randn(2, 32, 64).to(torch.bfloat16).requires_grad_()
    for x_low, kept_dtype in ((x, torch.bfloat16), (None, torch.float32)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            gate(x, x_low)
        assert [t.dtype for t in saved if t.numel() == x.numel()] == [kept_dtype]
