"""The static-shape routing (partition of all rows, selected count on the device) against the previous routing
(`torch.nonzero` compaction, kept below as `old_compact` / `old_branches`, copied from the implementation it
replaced): the same decisions, outputs and gradients on random inputs with several documents, padding, and
none / one / all rows selected. float64; tolerance 1e-12 (only the summation order of the q transform of a
different number of rows may differ), decisions and unselected rows bitwise."""
import pytest
import torch

from logo.kernels import reference as R
from logo.kernels.rope import apply_rope, apply_rope_rows, upcast
from logo.model.layers import PackedSeqs, rope_cos_sin
from logo.model.logo_attention import route
from logo.model.routing import partition
from test_logo_layer import make_layer


def old_compact(z, seqs):
    """The previous routing: nonzero (host sync) -> index (Nq,), q_pos (Nq,), cu_seqlens_q (S+1,)."""
    index = torch.nonzero(z).squeeze(1)
    counts = torch.bincount(seqs.seq_id[index], minlength=seqs.num_seqs)
    cu_q = torch.zeros(seqs.num_seqs + 1, dtype=torch.int32)
    cu_q[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return index, seqs.pos[index], cu_q


def old_branches(layer, x, q, k, v, cos, sin, seqs):
    """The previous LoGoAttention.branches: compacted global queries and index_copy fusion."""
    a = layer.attn_cfg
    p = layer.gate_probs(x)
    z = route(p, layer.threshold, seqs)
    index, q_pos, cu_q = old_compact(z, seqs)
    x, q, k, v = x.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    H, D = layer.n_heads, layer.head_dim
    if a.transform == "full":
        qg, kg, vg = layer.wq_g(x[index]).view(-1, H, D), layer.wk_g(x).view(-1, H, D), layer.wv_g(x).view(-1, H, D)
    else:
        qg, kg, vg = layer.transform(0, q[index]), layer.transform(1, k), layer.transform(2, v)
    q, k = apply_rope(q, cos, sin, seqs.batch), apply_rope(k, cos, sin, seqs.batch)
    o_local = layer.norm_local(R.sliding_window_attention(q, k, v, seqs.cu_seqlens, layer.window))
    row_pos = index % seqs.seqlen
    qg = apply_rope_rows(qg, cos[row_pos], sin[row_pos])
    kg = apply_rope(kg, cos, sin, seqs.batch)
    if index.numel():  # the previous reference op: compacted queries over their key ranges
        lo, hi = R._key_ranges(q_pos, cu_q, seqs.cu_seqlens, None)
        o_global = R._RangeAttention.apply(qg, kg, vg, lo, hi, D ** -0.5)
    else:
        o_global = qg * 0.0
    o_global = layer.norm_global(o_global)
    p_sel = p[index][:, None, None]
    o_sel = upcast(o_local[index])
    fused = ((1.0 - p_sel) * o_sel if a.fusion == "weighted" else o_sel) + p_sel * upcast(o_global)
    return o_local.index_copy(0, index, fused.to(o_local.dtype)), p, z


def make(transform="lp", fusion="weighted", seed=0):
    return make_layer(seed, dim=32, heads=2, window=4, transform=transform, fusion=fusion, backend="reference")


CASES = {  # (B, T, cu_seqlens or None, padded rows (b, from))
    "rows": (2, 12, None, None),
    "docs": (2, 12, [0, 5, 12, 13, 17, 24], None),
    "docs+padding": (3, 10, [0, 4, 10, 16, 20, 30], (2, 6)),
}


def setup(case, seed):
    B, T, cu, pad = CASES[case]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 32, dtype=torch.float64, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    if pad:
        valid[pad[0], pad[1]:] = False
    seqs = PackedSeqs.build(B, T, "cpu", None if cu is None else torch.tensor(cu, dtype=torch.int32), valid)
    cos, sin = rope_cos_sin(T, 16, 10000.0, "cpu", dtype=torch.float64)
    return x, seqs, cos, sin


def set_selection(layer, x, seqs, how):
    p = layer.gate_probs(x).detach()[seqs.valid]
    b = {"none": 2.0, "all": -1.0, "half": float(p.median()),
         "one": float(p.sort().values[-2]) if p.numel() > 1 else -1.0}[how]
    layer.threshold.fill_(b)


@pytest.mark.parametrize("how", ["none", "one", "half", "all"])
@pytest.mark.parametrize("case", list(CASES))
def test_partition_equals_nonzero_compaction(case, how):
    layer = make()
    x, seqs, _, _ = setup(case, seed=len(case))
    set_selection(layer, x, seqs, how)
    z = route(layer.gate_probs(x), layer.threshold, seqs)
    index, _, cu_old = old_compact(z, seqs)
    sel = partition(z, seqs)
    n = int(sel.cu_seqlens_q[-1])
    assert n == index.numel() == {"none": 0, "one": 1}.get(how, n)
    assert torch.equal(sel.rows[:n].long(), index)  # selected rows first, in packed order
    assert torch.equal(sel.rows.long().sort().values, torch.arange(z.numel()))  # a permutation
    assert torch.equal(sel.rows[n:].long(), torch.nonzero(~z).squeeze(1))  # then the others, in order
    assert torch.equal(sel.cu_seqlens_q, cu_old)


VARIANTS = [("lp", "weighted"), ("so", "weighted"), ("full", "weighted"), ("lp", "additive")]


@pytest.mark.parametrize("how", ["none", "one", "half", "all"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_branches_equal_previous_routing(variant, case, how):
    """Decisions, outputs and every gradient (inputs, parameters, gate) equal the previous implementation."""
    layer = make(*variant, seed=3)
    x0, seqs, cos, sin = setup(case, seed=7)
    set_selection(layer, x0, seqs, how)
    B, T, _ = x0.shape
    g = torch.Generator().manual_seed(1)
    qkv0 = [torch.randn(B, T, 2, 16, dtype=torch.float64, generator=g) for _ in range(3)]
    w = torch.randn(B * T, 2, 16, dtype=torch.float64, generator=g)
    results = []
    for fn in (old_branches, lambda _, x, *a: layer.branches(x, x, *a)):
        layer.zero_grad(set_to_none=True)
        x, q, k, v = (t.clone().requires_grad_() for t in (x0, *qkv0))
        o, p, z = fn(layer, x, q, k, v, cos, sin, seqs)
        (o * w).sum().backward()
        grads = [t.grad for t in (x, q, k, v)] + [prm.grad for _, prm in sorted(layer.named_parameters())]
        results.append((o.detach(), z, grads))
    (o_old, z_old, g_old), (o_new, z_new, g_new) = results
    assert torch.equal(z_old, z_new)
    assert torch.equal(o_old[~z_old], o_new[~z_new])  # unselected rows: bitwise Norm^L(O^L)
    torch.testing.assert_close(o_new, o_old, atol=1e-12, rtol=0)
    for a, b in zip(g_new, g_old):
        if a is None or b is None:
            assert a is None or not a.any()
            assert b is None or not b.any()
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
