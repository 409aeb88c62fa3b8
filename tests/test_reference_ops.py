"""The pure-PyTorch reference ops against a naive per-row float64 implementation.

Tolerances: float64 vs float64 naive: 1e-10 absolute; float32 inputs: 2e-5; bf16 inputs: 2e-2 (outputs are
rounded to bf16, whose unit roundoff is 4e-3).
"""
import math

import pytest
import torch

from logo.kernels import reference as R


def naive_attention(q, k, v, q_pos, cu_q, cu_k, window=None):
    """Row by row: query i of sequence b attends keys max(0, p-w+1)..p of sequence b."""
    rows = []
    for b in range(len(cu_q) - 1):
        for i in range(int(cu_q[b]), int(cu_q[b + 1])):
            p = int(q_pos[i])
            lo = 0 if window is None else max(0, p - window + 1)
            kk = k[int(cu_k[b]) + lo: int(cu_k[b]) + p + 1]
            vv = v[int(cu_k[b]) + lo: int(cu_k[b]) + p + 1]
            s = torch.einsum("hd,khd->hk", q[i], kk) / math.sqrt(q.shape[-1])
            rows.append(torch.einsum("hk,khd->hd", s.softmax(-1), vv))
    if not rows:
        return q[:0] * 0.0
    return torch.stack(rows)


def make_selection(cu_k, frac, gen):
    """Random selection of rows at fraction frac: returns index (Nq,), rows (N,) int32 (selected first), every
    row's position (N,) int32, cu_q (B+1,) int32."""
    n = int(cu_k[-1])
    if frac == "one":
        sel = torch.zeros(n, dtype=torch.bool)
        sel[int(torch.randint(0, n, (1,), generator=gen))] = True
    else:
        sel = torch.rand(n, generator=gen) < frac
    idx = sel.nonzero().squeeze(1)
    rows = torch.cat([idx, (~sel).nonzero().squeeze(1)]).to(torch.int32)
    pos = R.positions_in_sequence(cu_k, n)
    seq = torch.searchsorted(cu_k[1:].long(), torch.arange(n), right=True)
    cu_q = torch.zeros(len(cu_k), dtype=torch.int32)
    cu_q[1:] = torch.bincount(seq[idx], minlength=len(cu_k) - 1).cumsum(0)
    return idx, rows, pos, cu_q


LAYOUTS = {
    "single": [37],
    "docs": [37, 50, 1, 13],  # several documents/sequences, a 1-token one, none a block multiple
    "long": [300],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("frac", [0.0, "one", 0.3, 1.0])
@pytest.mark.parametrize("small_blocks", [False, True])
def test_query_sparse_matches_naive_float64(layout, frac, small_blocks, monkeypatch):
    if small_blocks:  # force many query chunks and partial key spans
        monkeypatch.setattr(R, "_BLOCK_ELEMS", 200)
    gen = torch.Generator().manual_seed(hash((layout, str(frac), small_blocks)) % 2**31)
    lens = LAYOUTS[layout]
    cu_k = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    n, H, D = int(cu_k[-1]), 3, 16
    qa, k, v = (torch.randn(n, H, D, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    idx, rows, pos, cu_q = make_selection(cu_k, frac, gen)
    o = R.query_sparse_attention(qa, k, v, pos, rows, cu_q, cu_k)
    o_ref = naive_attention(qa[idx], k, v, pos[idx], cu_q, cu_k)
    assert o.shape == (n, H, D)
    torch.testing.assert_close(o[idx], o_ref, atol=1e-10, rtol=0)
    assert not o[rows[len(idx):].long()].any()  # unselected rows: zero
    if len(idx) == 0:
        return
    g = torch.randn(o.shape, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad(o, (qa, k, v), g)
    want = torch.autograd.grad(o_ref, (qa, k, v), g[idx])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    # unselected query rows get exactly zero gradient
    unsel = torch.ones(n, dtype=torch.bool)
    unsel[idx] = False
    assert torch.all(got[0][unsel] == 0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window", [1, 7, 128, 1000])  # 1000 > every sequence
@pytest.mark.parametrize("small_blocks", [False, True])
def test_sliding_window_matches_naive_float64(layout, window, small_blocks, monkeypatch):
    if small_blocks:
        monkeypatch.setattr(R, "_BLOCK_ELEMS", 200)
    gen = torch.Generator().manual_seed(window + 7 * len(layout))
    lens = LAYOUTS[layout]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    n, H, D = int(cu[-1]), 2, 8
    q, k, v = (torch.randn(n, H, D, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    o = R.sliding_window_attention(q, k, v, cu, window)
    pos = R.positions_in_sequence(cu, n)
    o_ref = naive_attention(q, k, v, pos, cu, cu, window)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    g = torch.randn(o.shape, dtype=torch.float64, generator=gen)
    for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(o_ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_inputs(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 70, 160], dtype=torch.int32)
    q, k, v = (torch.randn(160, 4, 32, generator=gen) for _ in range(3))
    pos = R.positions_in_sequence(cu, 160)
    o = R.causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu)
    assert o.dtype == dtype
    o_ref = naive_attention(*(t.to(dtype).double() for t in (q, k, v)), pos, cu, cu)
    err = (o.double() - o_ref).norm() / o_ref.norm()
    assert err < tol


def test_chunk_plan_is_memory_bounded_at_8k():
    """No T x T score tensor per head: every (H, chunk, key-span) tile stays under the element budget."""
    T, H = 8192, 16
    cu = torch.tensor([0, T], dtype=torch.int32)
    pos = R.positions_in_sequence(cu, T)
    lo, hi = R._key_ranges(pos, cu, cu, None)
    tiles = list(R._chunks(lo, hi, H))
    assert max(H * (q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in tiles) <= 2 * R._BLOCK_ELEMS
    assert sum(q1 - q0 for q0, q1, _, _ in tiles) == T
    lo, hi = R._key_ranges(pos, cu, cu, 128)
    tiles = list(R._chunks(lo, hi, H))
    assert max(k1 - k0 for _, _, k0, k1 in tiles) <= 128 + 256  # local: the span stays near the window


def test_bad_inputs_raise_clear_errors():
    q = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    rows = torch.arange(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="q_pos"):
        R.query_sparse_attention(q, q, q, rows[:3], rows, cu, cu)
    with pytest.raises(ValueError, match="permutation"):
        R.query_sparse_attention(q, q, q, rows, torch.zeros(5, dtype=torch.int32), cu, cu)
    with pytest.raises(ValueError, match="window"):
        R.sliding_window_attention(q, q, q, cu, 0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        R.sliding_window_attention(q, q, q, torch.tensor([0, 4], dtype=torch.int32), 3)
