"""Triton attention kernels against the pure-PyTorch reference (in float64).

On a machine without a GPU these run under the Triton CPU interpreter (TRITON_INTERPRET=1, set in conftest.py)
at small shapes; on a CUDA machine the same tests run compiled, plus full-size cases (`gpu` marker).

Tolerances (||out - ref|| <= rtol * ||ref|| + atol * sqrt(numel), reference in float64):
- float32 inputs: rtol 2e-5 (ieee fp32 dots; only the summation order differs from the reference).
- bfloat16 / float16 inputs: rtol 2e-2. Inputs are rounded to 16 bits for both sides; the kernel also
  rounds the probabilities P and dS to 16 bits before the P@V, dS@K, dS^T@Q products (as FlashAttention
  does), which gives relative errors of about 4e-3 on outputs and 6e-3 to 1e-2 on gradients.
Every output buffer is poisoned with NaN before each run, so an unwritten row fails the comparison. The kernels
go through the custom ops (`logo.kernels.ops`, impl="triton") as the model calls them; the reference is the
plain-autograd `logo.kernels.reference` on the same static-shape contract.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from logo.kernels import ops
from logo.kernels import reference as ref
from logo.kernels.triton import _attn

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HEAD_DIMS = (64, 128) if CUDA else (16, 32)
RTOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}
LENGTHS = {  # packed sequences (documents) per call; none is a multiple of the block sizes
    "one_seq": [53],
    "docs": [37, 5, 50],
    "with_len1": [1, 64, 33, 2],
}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Kernel outputs start as NaN (integer ones as INT_MIN): a row the kernels never write shows up as a mismatch."""
    def nan_empty(*shape, like, dtype=None):
        dtype = dtype or like.dtype
        return torch.full(shape, float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min,
                          device=like.device, dtype=dtype)
    monkeypatch.setattr(_attn, "_empty", nan_empty)


def close(out, want, dtype, what):
    out, want = out.double(), want.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten rows?)"
    err = (out - want).norm().item()
    bound = RTOL[dtype] * want.norm().item() + ATOL[dtype] * math.sqrt(want.numel())
    assert err <= bound, f"{what}: ||diff|| {err:.3e} > {bound:.3e} (||ref|| {want.norm().item():.3e})"


def packed(lengths, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    qkv = [torch.randn(n, H, D, generator=g).to(device=DEVICE, dtype=dtype) for _ in range(3)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return qkv, cu


def select(lengths, mode, seed):
    """The static-shape selection: rows (N,) int32, selected first (ascending), then the others; every row's
    position q_pos (N,) int32; cu_seqlens_q (S+1,) int32 over the selected slots."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]])
    if mode == "none":
        mask = torch.zeros(n, dtype=torch.bool)
    elif mode == "one":
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n - 2] = True
    elif mode == "all":
        mask = torch.ones(n, dtype=torch.bool)
    elif mode == "random":
        mask = torch.rand(n, generator=g) < 0.4
    elif mode == "skip_a_seq":  # every row of sequence 1 unselected, the others dense
        mask = seq != 1
    else:
        raise ValueError(mode)
    idx = torch.nonzero(mask).squeeze(1)
    rows = torch.cat([idx, torch.nonzero(~mask).squeeze(1)]).to(torch.int32)
    q_pos = (torch.arange(n) - starts[seq]).to(torch.int32)
    cu_q = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_q[1:] = torch.bincount(seq[idx], minlength=len(lengths)).cumsum(0)
    return rows.to(DEVICE), q_pos.to(DEVICE), cu_q.to(DEVICE)


def qsparse(rows, q_pos, cu_q, cu):
    """(kernel, reference) query-sparse functions of q, k, v for one selection."""
    return (lambda a, b, c: ops.query_sparse_attention(a, b, c, q_pos, rows, cu_q, cu, impl="triton"),
            lambda a, b, c: ref.query_sparse_attention(a, b, c, q_pos, rows, cu_q, cu))


def window_fns(cu, window):
    return (lambda a, b, c: ops.sliding_window_attention(a, b, c, cu, window, impl="triton"),
            lambda a, b, c: ref.sliding_window_attention(a, b, c, cu, window))


def causal_fns(cu):
    return (lambda a, b, c: ops.causal_attention(a, b, c, cu, impl="triton"),
            lambda a, b, c: ref.causal_attention(a, b, c, cu))


def case_fns(case, lengths, cu, seed):
    """(kernel, reference) functions for a case name: "window<w>", "causal", or a selection mode of `select`."""
    if case.startswith("window"):
        return window_fns(cu, int(case.removeprefix("window")))
    if case == "causal":
        return causal_fns(cu)
    rows, q_pos, cu_q = select(lengths, case, seed=seed)
    return qsparse(rows, q_pos, cu_q, cu)


def run_both(kernel_fn, ref_fn, inputs, dtype, seed):
    """Forward + backward of the kernel (in `dtype`) and of the reference (float64 copies of the same inputs)."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = kernel_fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7)).to(DEVICE, dtype)
    grads = torch.autograd.grad(out, xs, g) if out.numel() else [torch.zeros_like(x) for x in xs]
    xr = [x.detach().double().requires_grad_() for x in inputs]
    want = ref_fn(*xr)
    wgrads = torch.autograd.grad(want, xr, g.double()) if want.numel() else [torch.zeros_like(x) for x in xr]
    return out, grads, want, wgrads


def check_all(out, grads, want, wgrads, dtype, name):
    close(out, want, dtype, f"{name} output")
    for label, a, b in zip(("dq", "dk", "dv"), grads, wgrads):
        close(a, b, dtype, f"{name} {label}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "one", "all", "random", "skip_a_seq"])
@pytest.mark.parametrize("layout", list(LENGTHS))
def test_query_sparse_matches_reference(layout, mode, dtype):
    lengths = LENGTHS[layout]
    D = HEAD_DIMS[len(lengths) % 2]
    (q, k, v), cu = packed(lengths, 2, D, dtype, seed=len(lengths))
    rows, q_pos, cu_q = select(lengths, mode, seed=3)
    out, grads, want, wgrads = run_both(*qsparse(rows, q_pos, cu_q, cu), [q, k, v], dtype, seed=11)
    assert out.shape == q.shape and out.dtype == dtype
    check_all(out, grads, want, wgrads, dtype, f"query_sparse[{mode}]")
    unselected = rows[int(cu_q[-1]):].long()
    assert not out[unselected].any() and not grads[0][unselected].any()  # exact zeros off the selection
    if mode == "none":  # no selected row: no gradient reaches keys or values
        assert grads[1].abs().max() == 0 and grads[2].abs().max() == 0


@pytest.mark.parametrize("heads_in_l2,want_group", [(0, 1), (2.5, 2), (100, 5)])
@pytest.mark.parametrize("case", ["random", "window7", "causal"])
def test_head_groups_cover_every_block(case, heads_in_l2, want_group, monkeypatch):
    """The programs' schedule (groups of G heads, heaviest blocks first, the last group smaller when G does not
    divide H): with 5 heads and G = 1 (one head after another), 2 (groups 2, 2, 1) and 5 (all at once) every
    (block, head) is computed once: the outputs and gradients equal the reference."""
    lengths = LENGTHS["docs"]
    (q, k, v), cu = packed(lengths, 5, 16, torch.float32, seed=4)
    monkeypatch.setattr(_attn, "L2_GROUP_BYTES", int(heads_in_l2 * 2 * k.shape[0] * 16 * 4))  # keys + values
    assert _attn.head_group(5, k) == want_group
    if case == "random":
        fns = qsparse(*select(lengths, "random", seed=6), cu)
    else:
        fns = window_fns(cu, 7) if case == "window7" else causal_fns(cu)
    out, grads, want, wgrads = run_both(*fns, [q, k, v], torch.float32, seed=13)
    check_all(out, grads, want, wgrads, torch.float32, f"{case} G={want_group}")


WINDOW_CASES = [(w, dt) for w in (1, 7, 16, 100) for dt in (torch.float32, torch.bfloat16)] + [(16, torch.float16)]


@pytest.mark.parametrize("window,dtype", WINDOW_CASES)  # 100: larger than every sequence here
@pytest.mark.parametrize("layout", ["one_seq", "docs", "with_len1"])
def test_sliding_window_matches_reference(layout, window, dtype):
    lengths = LENGTHS[layout]
    D = HEAD_DIMS[window % 2]
    (q, k, v), cu = packed(lengths, 2, D, dtype, seed=window)
    out, grads, want, wgrads = run_both(*window_fns(cu, window), [q, k, v], dtype, seed=5)
    check_all(out, grads, want, wgrads, dtype, f"sliding_window[w={window}]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["one_seq", "docs"])
def test_causal_matches_reference(layout, dtype):
    lengths = LENGTHS[layout]
    (q, k, v), cu = packed(lengths, 2, HEAD_DIMS[0], dtype, seed=2)
    out, grads, want, wgrads = run_both(*causal_fns(cu), [q, k, v], dtype, seed=9)
    check_all(out, grads, want, wgrads, dtype, "causal")


@pytest.mark.parametrize("case", ["random", "window7", "causal"])
def test_trailing_empty_sequences_change_nothing(case):
    """Offsets padded with copies of their last entry (`data.loader.bucket_doc_offsets`, a static length for CUDA
    graphs; `partition` pads cu_seqlens_q the same way) give the kernels and the reference the same outputs and
    gradients, bit for bit, as the offsets without the empty sequences."""
    lengths = LENGTHS["docs"]
    (q, k, v), cu = packed(lengths, 2, 16, torch.float32, seed=4)
    pad = lambda c: torch.cat((c, c[-1:].expand(5)))  # noqa: E731
    if case == "random":
        rows, q_pos, cu_q = select(lengths, case, seed=6)
        plain, padded = qsparse(rows, q_pos, cu_q, cu), qsparse(rows, q_pos, pad(cu_q), pad(cu))
    else:
        fns = (lambda c: window_fns(c, 7)) if case == "window7" else causal_fns
        plain, padded = fns(cu), fns(pad(cu))
    out, grads, want, wgrads = run_both(*plain, [q, k, v], torch.float32, seed=13)
    out2, grads2, want2, wgrads2 = run_both(*padded, [q, k, v], torch.float32, seed=13)
    for a, b in zip((out, *grads, want, *wgrads), (out2, *grads2, want2, *wgrads2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["window7", "window20", "causal", "random", "skip_a_seq"])
def test_one_loop_equals_the_three_region_loops(case):
    """`one_loop` (every key block of a program through the masked loop; the window's default) gives the same bits
    as the masked head | unmasked middle | masked tail loops: a visible element is unchanged by the mask."""
    lengths = LENGTHS["with_len1"]
    (q, k, v), cu = packed(lengths, 2, HEAD_DIMS[1], torch.float32, seed=17)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    fns = case_fns(case, lengths, cu, seed=4)
    one = _grads_with({"one_loop": True}, fns, [q, k, v], g)
    three = _grads_with({"one_loop": False}, fns, [q, k, v], g)
    for what, a, b in zip(("out", "dq", "dk", "dv"), one, three):
        assert torch.equal(a, b), what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_window_runs_one_loop_by_default(dtype):
    for dev in ("cpu", "cuda"):
        for D in (64, 128):
            window = _attn._default_cfg(D, dtype, "window", torch.device(dev))
            glob = _attn._default_cfg(D, dtype, "global", torch.device(dev))
            assert window["one_loop"] and not glob["one_loop"], (dev, D)


def _with_cfg(override, kinds=("global", "window")):
    """A `_cfg` that puts `override` over the default launch parameters of the given kernel kinds."""
    real = _attn._cfg

    def cfg(D, dtype, window, device):
        c = real(D, dtype, window, device)
        return {**c, **override} if ("window" if window > 0 else "global") in kinds else c
    return cfg


def _grads_with(override, fns, inputs, g):
    real = _attn._cfg
    _attn._cfg = _with_cfg(override)
    try:
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        out = fns[0](*xs)
        return [out, *torch.autograd.grad(out, xs, g)]
    finally:
        _attn._cfg = real


@pytest.mark.parametrize("smem,stages", [(232448, 4), (166912, 3), (0, 3)])
def test_four_stage_backward_only_where_shared_memory_allows(smem, stages, monkeypatch):
    """The global kernels' backward runs 4 pipeline stages on GPUs with Hopper's 227 KB of shared memory per
    program and keeps 3 where there is less (an A100's 163 KB; the 4-stage configs were measured on an H200 only),
    at head dim 128 in 16 bits only; the window kernels and the forward are unchanged."""
    monkeypatch.setattr(_attn, "INTERPRET", False)
    monkeypatch.setattr(_attn, "_shared_memory", lambda device: smem)
    monkeypatch.setattr(_attn, "_has_tma", lambda device: smem > 0)
    cuda = torch.device("cuda")
    cfg = _attn._default_cfg.__wrapped__  # not the per-device cache
    glob = cfg(128, torch.bfloat16, "global", cuda)
    assert glob["dq"][3] == glob["dkdv"][3] == stages and glob["fwd"] == (128, 128, 8, 3)
    for other in (cfg(64, torch.bfloat16, "global", cuda), cfg(128, torch.bfloat16, "window", cuda),
                  cfg(128, torch.float32, "global", cuda), cfg(256, torch.bfloat16, "global", cuda)):
        assert other["dq"][3] != 4 and other["dkdv"][3] != 4


@pytest.mark.parametrize("case", ["none", "one", "all", "random", "skip_a_seq", "window7", "causal"])
def test_tma_loads_equal_pointer_loads(case, monkeypatch):
    """`desc` (TMA tiles of K/V in the forward, of q/dO in dK/dV; sparse queries through slot-ordered copies that
    the backward's first pass writes) gives the pointer path's outputs and gradients, with a strided dO: bit for
    bit on a GPU; under the CPU interpreter to fp32 rounding, since its dots are numpy matmuls whose summation
    order depends on the CPU's BLAS kernels and the operands' layout (a descriptor tile is a transposed copy)."""
    lengths = LENGTHS["with_len1"]
    (q, k, v), cu = packed(lengths, 2, HEAD_DIMS[1], torch.float32, seed=5)
    fns = case_fns(case, lengths, cu, seed=6)
    g = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2], device=DEVICE)[..., ::2]  # dO with stride 2 in D
    made = []
    real = _attn._row_desc
    monkeypatch.setattr(_attn, "_row_desc", lambda x, b: made.append(real(x, b)) or made[-1])
    plain = _grads_with({"desc": False}, fns, [q, k, v], g)
    assert not made
    tma = _grads_with({"desc": True}, fns, [q, k, v], g)
    assert len(made) == 4 and all(d is not None for d in made)  # k, v (forward); q, dO (dK/dV)
    for name, a, b in zip(("o", "dq", "dk", "dv"), tma, plain):
        assert torch.isfinite(a).all(), f"{name}: non-finite values on the TMA path"
        if CUDA:
            assert torch.equal(a, b), f"{name}: TMA path differs from the pointer path"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: TMA vs pointer path: {m}")


def test_tma_needs_a_row_major_layout():
    """Tensors whose heads are not adjacent rows of D get no descriptor: the kernels fall back to pointer loads."""
    x = torch.randn(8, 2, 64)
    assert _attn._row_desc(x[..., :32], 16) is None  # stride(1) != D
    assert _attn._row_desc(x.transpose(0, 1).contiguous().transpose(0, 1), 16) is None
    assert _attn._row_desc(x[..., 32:].contiguous(), 16) is not None
    assert _attn._descs({"desc": True}, 16, x, x[..., :32]) == (None, None)  # one without: none for the pair
    assert _attn._descs({"desc": False}, 16, x) == (None,)


class _SplitSpy:
    """Stands in for `_attn._split_kernel`: launches the real kernel and keeps copies of its KIDX and SPLIT."""

    def __init__(self, real):
        self.real, self.seen = real, []

    def __getitem__(self, grid):
        def launch(kidx, split, *args, **kw):
            self.real[grid](kidx, split, *args, **kw)
            self.seen.append((kidx.clone(), split.clone(), kw["BN"]))
        return launch


@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("mode", ["none", "one", "all", "random", "skip_a_seq"])
@pytest.mark.parametrize("lengths", [[53], [37, 5, 50], [0, 64, 0, 33, 2, 0]], ids=["one_seq", "docs", "empty_seqs"])
def test_key_rows_and_split_equal_the_reference(lengths, mode, block_n, monkeypatch):
    """The backward's per-slot key rows (written with delta by the dQ kernel's prologue) and per-KV-block first slots (binary search in `_split_kernel`) equal the PyTorch reference
    `key_rows_and_split` (a searchsorted), also with empty sequences."""
    (q, k, v), cu = packed(lengths, 2, HEAD_DIMS[0], torch.float32, seed=9)
    rows, q_pos, cu_q = select(lengths, mode, seed=9)
    spy = _SplitSpy(_attn._split_kernel)
    monkeypatch.setattr(_attn, "_split_kernel", spy)
    monkeypatch.setattr(_attn, "_cfg", _with_cfg({"dkdv": (16, block_n, 4, 1)}, kinds=("global",)))
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    ops.query_sparse_attention(*xs, q_pos, rows, cu_q, cu, impl="triton").sum().backward()
    (kidx, split, bn), = spy.seen
    want_kidx, want_split = _attn.key_rows_and_split(q_pos, rows, cu_q, cu, k.shape[0], block_n)
    assert bn == block_n
    assert torch.equal(kidx, want_kidx), f"key rows {kidx.tolist()} != {want_kidx.tolist()}"
    assert torch.equal(split, want_split), f"split {split.tolist()} != {want_split.tolist()}"


@pytest.mark.parametrize("window", [0, 7])
def test_log_sum_exp_matches_dense(window):
    """The forward's base-2 log-sum-exp (kept for the backward) equals a dense float64 logsumexp."""
    lengths = LENGTHS["docs"]
    (q, k, v), cu = packed(lengths, 2, HEAD_DIMS[0], torch.float32, seed=4)
    rows, q_pos, cu_q = select(lengths, "random", seed=4)
    scale = 1 / math.sqrt(q.shape[-1])
    if window:
        rows, cu_q = None, cu
        _, lse2 = _attn.attn_forward(q, k, v, None, None, cu, cu, scale, window)
        q_pos, idx = ref.positions_in_sequence(cu, q.shape[0]), torch.arange(q.shape[0], device=DEVICE)
    else:
        _, lse2 = _attn.attn_forward(q, k, v, q_pos, rows, cu_q, cu, scale, window)
        idx = rows[:int(cu_q[-1])].long()
        assert not lse2[:, idx.numel():].any()  # dead slots: zero
    seq = torch.searchsorted(cu_q[1:].long(), torch.arange(idx.numel(), device=DEVICE), right=True)
    for i in range(idx.numel()):
        k0, p = int(cu[seq[i]]), int(q_pos[idx[i]])
        lo = max(0, p - window + 1) if window else 0
        keys = k[k0 + lo:k0 + p + 1].double()  # (n, H, D)
        s = torch.einsum("hd,nhd->hn", q[idx[i]].double(), keys) * scale
        torch.testing.assert_close(lse2[:, i].double() * math.log(2), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
    (q, k, v), cu = packed([8], 1, HEAD_DIMS[0], torch.float32, seed=0)
    with pytest.raises(ValueError, match="head dims"):
        ops.sliding_window_attention(q[..., :12], k[..., :12], v[..., :12], cu, 4, impl="triton")
    with pytest.raises(ValueError, match="window"):
        ops.sliding_window_attention(q, k, v, cu, 0, impl="triton")
    with pytest.raises(ValueError, match="share one of"):
        ops.sliding_window_attention(q.double(), k.double(), v.double(), cu, 4, impl="triton")
    rows = torch.arange(8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="q_pos"):
        ops.query_sparse_attention(q, k, v, rows[:3], rows, cu, cu, impl="triton")
    with pytest.raises(ValueError, match="rows"):
        ops.query_sparse_attention(q, k, v, rows, rows[:5], cu, cu, impl="triton")


def test_logo_layer_triton_equals_reference():
    """The model's LoGo layer (routing, both branches, fusion) gives the same output and gradients with the
    Triton kernels as with the reference ops, across packed documents."""
    from logo.config import AttentionConfig, ModelConfig
    from logo.model.layers import PackedSeqs, rope_cos_sin
    from logo.model.logo_attention import LoGoAttention
    D = HEAD_DIMS[0]
    outs = {}
    for backend in ("triton", "reference"):
        torch.manual_seed(0)
        cfg = ModelConfig(dim=2 * D, n_heads=2, n_layers=1,
                          attention=AttentionConfig(kind="logo", window=8, backend=backend, gate_init_std=0.5))
        layer = LoGoAttention(cfg).to(DEVICE)
        layer.init_weights(0.5, 0.5)
        B, T = 2, 40
        x = torch.randn(B, T, cfg.dim, device=DEVICE, requires_grad=True)
        seqs = PackedSeqs.build(B, T, DEVICE, torch.tensor([0, 13, 40, 52, 80], dtype=torch.int32, device=DEVICE))
        cos, sin = rope_cos_sin(T, D, 10000.0, DEVICE)
        out, _, stats = layer(x, cos, sin, seqs)
        assert 0 < stats[0] < B * T  # some rows routed global, some not
        out.square().sum().backward()
        outs[backend] = (out.detach(), x.grad, layer.gate.weight.grad, layer.transform.A.grad)
    for a, b in zip(outs["triton"], outs["reference"]):
        close(a, b, torch.float32, "LoGo layer")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="full-size shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128])
def test_full_size_on_gpu(dtype, D):
    lengths = [3001, 5191]  # 8k tokens in two documents
    (q, k, v), cu = packed(lengths, 4, D, dtype, seed=D)
    for mode in ("random", "skip_a_seq", "one", "none"):
        rows, q_pos, cu_q = select(lengths, mode, seed=D)
        res = run_both(*qsparse(rows, q_pos, cu_q, cu), [q, k, v], dtype, 1)
        check_all(*res, dtype, f"query_sparse 8k [{mode}]")
    res = run_both(*window_fns(cu, 128), [q, k, v], dtype, 2)
    check_all(*res, dtype, "sliding_window 8k")


def _flash_usable() -> bool:
    from logo.kernels import flash
    return CUDA and flash.usable(torch.device("cuda"), torch.bfloat16, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="training with the kernels needs a GPU")
@pytest.mark.parametrize("backend", ["triton", pytest.param("flash", marks=pytest.mark.skipif(
    not _flash_usable(), reason="needs a Hopper GPU with flash-attn-4 installed"))])
def test_training_loss_curve_equals_reference(backend):
    """A small LoGo model (head dim 128, packed documents, bf16 autocast) trained for a few steps on the Triton
    kernels (on FlashAttention-4's) and on the reference ops: the same per-step losses within bf16 tolerance (2%)
    and thresholds at most two updates apart."""
    from logo.config import AttentionConfig, ModelConfig
    from logo.model import BudgetController, Transformer
    steps, B, T = 8, 4, 1024
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 500, (B, 64), generator=g)
    tokens = base.repeat(1, T // 64 + 1)[:, :T + 1].cuda()  # repeats beyond the window: global span pays
    cu = torch.tensor([0, 300, 1024, 1500, 2048, 3072, 3500, 4096], dtype=torch.int32, device="cuda")
    curves = {}
    for name in (backend, "reference"):
        torch.manual_seed(0)
        attn = AttentionConfig(kind="logo", window=128, backend=name, gamma=0.01, threshold_init=0.48)
        model = Transformer(ModelConfig(dim=512, n_layers=4, n_heads=4, vocab_size=512, attention=attn)).cuda()
        model.init_weights()
        ctrl = BudgetController(model)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses = []
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(tokens[:, :-1], cu_seqlens=cu)
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ctrl.accumulate(out.routing)
            ctrl.step()
            losses.append(loss.item())
        curves[name] = (losses, ctrl.thresholds().cpu())
    (a, ta), (b, tb) = curves[backend], curves["reference"]
    assert a[-1] < a[0] - 1.0  # it learns
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 0.02 * abs(y), (i, a, b)
    assert torch.allclose(ta, tb, atol=2 * 0.01 + 1e-6), (ta, tb)  # thresholds at most two updates apart
