"""The FlashAttention-4 implementation of the attention ops (`logo.kernels.flash`) and its dispatch.

CPU (CI): the tile lists that skip the unselected rows' work equal brute-force masks of the reference's key
intervals; the dispatch falls back to Triton / the reference without the package or off Hopper and says why
once (the plan's `attention_kernels`, printed with the plan and written to plan.json).

GPU (Hopper with flash-attn-4 installed; skipped elsewhere): outputs, dq, dk, dv of every kind against the float64
reference with `test_triton_kernels.py`'s bf16 criteria (||diff|| <= 2e-2 ||ref|| + 1e-3 sqrt(n)), every output
buffer poisoned with NaN first; several documents, none / one / all / random rows selected, lengths that are not
multiples of the 128-row tiles, head dims 64 and 128.
"""
import json
import math

import pytest
import torch

from logo.kernels import dispatch, flash, ops
from logo.kernels import reference as ref
from logo.kernels.flash import blocks
from test_triton_kernels import check_all, packed, run_both, select

FLASH = torch.cuda.is_available() and flash.usable(torch.device("cuda"), torch.bfloat16, 128)
needs_flash = pytest.mark.skipif(not FLASH, reason="needs a Hopper GPU with flash-attn-4 installed")


# ---------------------------------------------------------------------------------------------------------------
# CPU: the tile lists
# ---------------------------------------------------------------------------------------------------------------
def brute_force_tiles(first, last, n_keys, tile):
    """(part, whole) from the dense (slots x keys) visibility of the intervals."""
    keys = torch.arange(-(-n_keys // tile) * tile)
    sees = (keys[None, :] >= first[:, None].long()) & (keys[None, :] <= last[:, None].long()) & (keys < n_keys)
    mq, mk = first.shape[0] // tile, keys.shape[0] // tile
    s = sees.view(mq, tile, mk, tile)
    whole = s.all(3).all(1)
    return s.any(3).any(1) & ~whole, whole


@pytest.mark.parametrize("lengths,mode", [([300], "random"), ([37, 500, 5, 200], "random"), ([129, 128, 127], "all"),
                                          ([257, 3], "one"), ([100, 90], "none"), ([700, 40], "skip_a_seq")])
@pytest.mark.parametrize("tile", [16, 128])
def test_tile_lists_cover_exactly_the_visible_tiles(lengths, mode, tile):
    """Every tile some slot sees is listed ('whole' only where every slot of the query tile sees all its keys), no
    tile is listed twice, and the slots' intervals are the reference's key ranges (none past the selection)."""
    rows, q_pos, cu_q = (t.cpu() for t in select(lengths, mode, seed=1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n = rows.shape[0]
    first, last = blocks.slot_intervals(q_pos, rows, cu_q, cu, blocks.padded_slots(n, tile))
    n_sel = int(cu_q[-1])
    idx, lo, hi = ref._slots(torch.empty(n, 1, 1), q_pos, rows, cu_q, cu, None)
    assert torch.equal(first[:n_sel].long(), lo) and torch.equal(last[:n_sel].long(), hi)
    assert (last[n_sel:] < first[n_sel:]).all()
    part, whole = blocks.tile_masks(first, last, n, tile)
    want_part, want_whole = brute_force_tiles(first, last, n, tile)
    assert torch.equal(whole, want_whole)
    assert not (part & whole).any()
    assert (part | ~want_part).all()  # every partly seen tile is listed as part (part may list more)
    assert not (part & ~(want_part | _between(first, last, n, tile))).any()


def _between(first, last, n_keys, tile):
    """Tiles inside a query tile's [lowest first, highest last] span: the bound `part` may list beyond what is seen."""
    mq, mk = first.shape[0] // tile, -(-n_keys // tile)
    f, la = first.view(mq, tile).long(), last.view(mq, tile).long()
    live = la >= f
    lo = torch.where(live, f, 1 << 40).amin(1, keepdim=True)
    hi = torch.where(live, la, -1).amax(1, keepdim=True)
    start = torch.arange(mk)[None] * tile
    return (start <= hi) & (start + tile - 1 >= lo)


def test_ordered_lists_pack_ascending_indices_left():
    m = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    count, idx = blocks.ordered_lists(m)
    assert count.tolist() == [3, 0, 5]
    assert idx[0, :3].tolist() == [1, 3, 4] and idx[2].tolist() == [0, 1, 2, 3, 4]
    assert idx.dtype == torch.int32 and count.dtype == torch.int32


def test_tile_lists_shapes_for_both_directions():
    rows, q_pos, cu_q = (t.cpu() for t in select([300, 45], "random", seed=2))
    cu = torch.tensor([0, 300, 345], dtype=torch.int32)
    first, last = blocks.slot_intervals(q_pos, rows, cu_q, cu, blocks.padded_slots(345))
    pc, pi, wc, wi = blocks.tile_lists(first, last, 345, by_key=False)
    assert pc.shape == wc.shape == (1, 1, 3) and pi.shape == wi.shape == (1, 1, 3, 3)
    bc, bi, _, _ = blocks.tile_lists(first, last, 345, by_key=True)
    assert bc.shape == (1, 1, 3) and bi.shape == (1, 1, 3, 3)
    assert int(pc.sum() + wc.sum()) == int(bc.sum() + blocks.tile_lists(first, last, 345, True)[2].sum())


# ---------------------------------------------------------------------------------------------------------------
# CPU: dispatch and the start-up report
# ---------------------------------------------------------------------------------------------------------------
def test_dispatch_falls_back_without_flash(monkeypatch):
    """Without the package (or off Hopper) "auto" runs the Triton kernels on CUDA and the reference on the CPU, and
    the report says why; backend=flash is refused in one line."""
    monkeypatch.setattr(flash, "unavailable_reason", lambda device: "flash-attn-4 is not installed (pip install "
                                                                    "-e '.[gpu]')")
    cuda = torch.device("cuda")
    assert not flash.usable(cuda, torch.bfloat16, 128)
    assert dispatch._impl_for("auto", cuda, torch.bfloat16, 128) == "triton"
    assert dispatch._impl_for("auto", torch.device("cpu"), torch.bfloat16, 128) == "reference"
    assert dispatch.describe("auto", cuda) == ("triton (FlashAttention-4 not used: flash-attn-4 is not installed "
                                               "(pip install -e '.[gpu]'))")
    assert dispatch.describe("auto", torch.device("cpu")) == "reference (PyTorch)"
    with pytest.raises(ValueError, match="FlashAttention-4 cannot run here: flash-attn-4 is not installed"):
        dispatch.describe("flash", cuda)


def test_dispatch_picks_flash_where_it_runs(monkeypatch):
    monkeypatch.setattr(flash, "unavailable_reason", lambda device: "")
    monkeypatch.setattr(flash, "version", lambda: "4.0.0b36")
    cuda = torch.device("cuda")
    assert dispatch._impl_for("auto", cuda, torch.bfloat16, 128) == "flash"
    assert dispatch._impl_for("auto", cuda, torch.float32, 128) == "triton"  # fp32: FlashAttention-4 is 16-bit
    assert dispatch._impl_for("auto", cuda, torch.bfloat16, 80) == "triton"
    assert dispatch._impl_for("triton", cuda, torch.bfloat16, 128) == "triton"
    assert dispatch.describe("auto", cuda).startswith("flash (FlashAttention-4 4.0.0b36")
    assert "not float32" not in dispatch.describe("auto", cuda, torch.float32, 128)
    assert dispatch.describe("auto", cuda, torch.float32, 128).startswith("triton (FlashAttention-4 not used")


def test_backend_flash_where_it_cannot_run_is_one_line_exit_2(tmp_path):
    """train.py attention.backend=flash on a machine without it: one line naming the field and the reason, exit 2."""
    from conftest import run_train
    p = run_train("model=tiny", "attention.backend=flash", f"run.dir={tmp_path}", check=False, timeout=120,
                  env={"CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: invalid config attention.backend='flash': FlashAttention-4 cannot run here: not a CUDA "
                     "device"], p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_unavailable_reason_on_cpu():
    assert flash.unavailable_reason(torch.device("cpu")) == "not a CUDA device"


def test_plan_reports_the_attention_kernels(tmp_path):
    """The dry run's plan (printed at start-up and written to plan.json) names the kernels the run uses here."""
    from logo.run.config import to_dataclass
    from test_config_compose import compose_cfg
    from logo.train.plan import make_plan
    cfg = to_dataclass(compose_cfg("model=tiny", f"run.dir={tmp_path}"))
    plan = make_plan(cfg, 1, "logo", torch.device("cpu"))
    assert plan.attention_kernels == "reference (PyTorch)"
    assert any(line.split() == ["attention", "kernels", "reference", "(PyTorch)"] for line in plan.table().splitlines())
    plan.write(tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text())["attention_kernels"] == "reference (PyTorch)"


# ---------------------------------------------------------------------------------------------------------------
# GPU: FlashAttention-4 against the reference
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def poison_flash(monkeypatch):
    """The FlashAttention-4 path's output buffers start as NaN: a row the kernels never write fails the check."""
    from logo.kernels.flash import _fa4

    def nan_empty(*shape, like, dtype=None):
        return torch.full(shape, float("nan"), device=like.device, dtype=dtype or like.dtype)
    monkeypatch.setattr(_fa4, "_empty", nan_empty)


LAYOUTS = {"one_seq": [300], "docs": [130, 5, 250, 1], "long_docs": [700, 1100, 245]}


def flash_fns(case, lengths, cu, seed):
    """(flash, reference) functions of q, k, v for a case: "window<w>", "causal", or a selection mode."""
    if case.startswith("window"):
        w = int(case.removeprefix("window"))
        return (lambda a, b, c: ops.sliding_window_attention(a, b, c, cu, w, impl="flash"),
                lambda a, b, c: ref.sliding_window_attention(a, b, c, cu, w))
    if case == "causal":
        return (lambda a, b, c: ops.causal_attention(a, b, c, cu, impl="flash"),
                lambda a, b, c: ref.causal_attention(a, b, c, cu))
    rows, q_pos, cu_q = select(lengths, case, seed=seed)
    return (lambda a, b, c: ops.query_sparse_attention(a, b, c, q_pos, rows, cu_q, cu, impl="flash"),
            lambda a, b, c: ref.query_sparse_attention(a, b, c, q_pos, rows, cu_q, cu))


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", ["none", "one", "all", "random", "skip_a_seq", "causal", "window128", "window7"])
def test_flash_matches_reference(case, layout, D, poison_flash):
    lengths = LAYOUTS[layout]
    (q, k, v), cu = packed(lengths, 4, D, torch.bfloat16, seed=len(lengths) + D)
    fns = flash_fns(case, lengths, cu, seed=5)
    out, grads, want, wgrads = run_both(*fns, [q, k, v], torch.bfloat16, seed=11)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    check_all(out, grads, want, wgrads, torch.bfloat16, f"flash {case} {layout} D={D}")
    if case in ("none", "one", "all", "random", "skip_a_seq"):
        rows, _, cu_q = select(lengths, case, seed=5)
        unselected = rows[int(cu_q[-1]):].long()
        assert not out[unselected].any() and not grads[0][unselected].any()  # exact zeros off the selection
        if case == "none":
            assert not grads[1].any() and not grads[2].any()


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [300, 1024])
def test_flash_causal_over_whole_rows(T, D, poison_flash):
    """Dense causal attention with the whole-rows hint (seqlen = T: no documents; FlashAttention-4's batch kernel)
    equals the reference over the same rows as sequences."""
    lengths = [T] * 3
    (q, k, v), cu = packed(lengths, 4, D, torch.bfloat16, seed=T + D)
    fns = (lambda a, b, c: ops.causal_attention(a, b, c, cu, impl="flash", seqlen=T),
           lambda a, b, c: ref.causal_attention(a, b, c, cu))
    check_all(*run_both(*fns, [q, k, v], torch.bfloat16, seed=3), torch.bfloat16, f"flash causal rows T={T} D={D}")


@pytest.mark.gpu
@needs_flash
def test_flash_query_sparse_at_a_realistic_shape(poison_flash):
    """8k tokens in three documents, 16 heads of 128, half the rows selected: within the bf16 criteria."""
    lengths = [1000, 3096, 4096]
    (q, k, v), cu = packed(lengths, 16, 128, torch.bfloat16, seed=3)
    out, grads, want, wgrads = run_both(*flash_fns("random", lengths, cu, seed=7), [q, k, v], torch.bfloat16, 13)
    check_all(out, grads, want, wgrads, torch.bfloat16, "flash 8k")


@pytest.mark.gpu
@needs_flash
def test_flash_head_major_inputs_and_opcheck():
    """q, k, v as (H, N, D) memory viewed as (N, H, D) (the global branch's transformed inputs) give the same
    outputs as contiguous ones; opcheck of both custom ops with impl='flash'."""
    lengths = LAYOUTS["docs"]
    (q, k, v), cu = packed(lengths, 4, 128, torch.bfloat16, seed=2)
    rows, q_pos, cu_q = select(lengths, "random", seed=3)
    hm = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)]
    args = (q_pos, rows, cu_q, cu, 1 / math.sqrt(128), 0, "flash")
    o, lse = torch.ops.logo.range_attention_fwd(q, k, v, *args)
    o2, lse2 = torch.ops.logo.range_attention_fwd(*hm, *args)
    assert torch.equal(o, o2)
    torch.library.opcheck(torch.ops.logo.range_attention_fwd.default, (*hm, *args))
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.logo.range_attention_bwd.default, (do, *hm, o2, lse2, *args))


def _bf16_logo_block(seed=0):
    from logo.config import AttentionConfig, ModelConfig
    from logo.model.transformer import TransformerBlock
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=512, n_layers=1, n_heads=4, attention=AttentionConfig(kind="logo", window=128,
                                                                              backend="flash")).validate()
    block = TransformerBlock(cfg, 0, "logo").cuda()
    block.init_weights(0.02, 0.02)
    return block, cfg


def _block_step(fn, x0, cos, sin, seqs):
    x = x0.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _, stats = fn(x, cos, sin, seqs)
    out.float().square().mean().backward()
    return out.float().detach(), stats, x.grad


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_flash_logo_block_compiled_equals_eager(mode):
    """A bf16 LoGo block on the FlashAttention-4 ops, compiled fullgraph (and replayed as CUDA graphs with
    mode=reduce-overhead, the threshold changing between replays) equals eager within bf16 tolerance (2e-2 relative
    norm), routing the same rows but for gates within rounding of the threshold."""
    from logo.model.layers import PackedSeqs, rope_cos_sin
    block, cfg = _bf16_logo_block()
    B, T = 2, 2048
    seqs = PackedSeqs.build(B, T, "cuda", torch.tensor([0, 700, 2048, 2100, 4096], dtype=torch.int32, device="cuda"))
    cos, sin = rope_cos_sin(T, cfg.head_dim, 10000.0, "cuda")
    torch._dynamo.reset()
    compiled = torch.compile(block, mode=mode, fullgraph=True)
    g = torch.Generator("cuda").manual_seed(0)
    for b in (0.5, 0.5, 0.499, 0.501):
        block.attention.threshold.fill_(b)
        x0 = torch.randn(B, T, cfg.dim, device="cuda", generator=g)
        want, wstats, wgrad = _block_step(block, x0, cos, sin, seqs)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        got, stats, grad = _block_step(compiled, x0, cos, sin, seqs)
        assert 0 < float(wstats[0]) < B * T
        assert (stats[0] - wstats[0]).abs() <= 8, (stats[0], wstats[0])
        for a, e in ((got, want), (grad, wgrad)):
            assert torch.isfinite(a).all() and (a - e).norm() <= 2e-2 * e.norm()


@pytest.mark.gpu
@needs_flash
def test_flash_logo_block_makes_no_host_sync():
    """Forward and backward of a bf16 LoGo block on the FlashAttention-4 ops under CUDA's sync debug mode (after a
    warm-up step that compiles the kernels)."""
    from logo.model.layers import PackedSeqs, rope_cos_sin
    block, cfg = _bf16_logo_block(seed=1)
    B, T = 2, 2048
    seqs = PackedSeqs.build(B, T, "cuda", torch.tensor([0, 700, 2048, 4096], dtype=torch.int32, device="cuda"))
    cos, sin = rope_cos_sin(T, cfg.head_dim, 10000.0, "cuda")
    x0 = torch.randn(B, T, cfg.dim, device="cuda")
    _block_step(block, x0, cos, sin, seqs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, stats, grad = _block_step(block, x0, cos, sin, seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(grad).all()


def assert_same_lists(lists, want):
    """The (part, whole) tile lists equal: the same counts and, within each count, the same indices (entries past
    a count are not read)."""
    for (cnt, idx), (wcnt, widx) in zip((lists[:2], lists[2:]), (want[:2], want[2:])):
        assert torch.equal(cnt, wcnt)
        for r in range(cnt.shape[-1]):
            c = int(cnt[0, 0, r])
            assert torch.equal(idx[0, 0, r, :c], widx[0, 0, r, :c]), r


@pytest.mark.parametrize("lengths,mode", [([300], "random"), ([37, 500, 5, 200], "random"), ([129, 128, 127], "all"),
                                          ([257, 3], "one"), ([100, 90], "none"), ([700, 40], "skip_a_seq")])
@pytest.mark.parametrize("by_key", [False, True], ids=["by_query", "by_key"])
def test_triton_tile_plan_equals_the_reference(lengths, mode, by_key):
    """`_tiles.tile_plan` (two Triton launches; the CPU interpreter here) gives the slots' intervals and the lists
    of `blocks.slot_intervals` / `blocks.tile_lists` (the same counts and, within each count, the same indices),
    and each row's slot."""
    from logo.kernels.flash import _tiles
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows, q_pos, cu_q = (t.to(dev) for t in select(lengths, mode, seed=1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    n = rows.shape[0]
    first, last, slot, slot_rows, lists = _tiles.tile_plan(q_pos, rows, cu_q, cu, n, by_key)
    assert slot_rows is rows
    want_first, want_last = blocks.slot_intervals(q_pos, rows, cu_q, cu, blocks.padded_slots(n))
    assert torch.equal(first, want_first) and torch.equal(last, want_last)
    assert torch.equal(rows[slot.long()], torch.arange(n, device=dev, dtype=rows.dtype))  # slot inverts rows
    want = blocks.tile_lists(want_first, want_last, n, by_key)
    assert_same_lists(lists, want)


@pytest.mark.parametrize("lengths,mode", [([384], "random"), ([37, 500, 5, 226], "random"), ([129, 127], "all"),
                                          ([700, 68], "skip_a_seq"), ([200, 56], "none")])
@pytest.mark.parametrize("by_key", [False, True], ids=["by_query", "by_key"])
def test_triton_tile_plan_longest_first_reverses_the_query_tiles(lengths, mode, by_key):
    """With longest_first the plan's slots are the selection's query tiles in reverse order: intervals, each slot's
    row and the lists equal the reference's on the reversed slots, and each row's slot inverts the slots' rows."""
    from logo.kernels.flash import _tiles
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows, q_pos, cu_q = (t.to(dev) for t in select(lengths, mode, seed=2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    n = rows.shape[0]
    first, last, slot, slot_rows, lists = _tiles.tile_plan(q_pos, rows, cu_q, cu, n, by_key, longest_first=True)
    want_first, want_last = (blocks.longest_first(t) for t in blocks.slot_intervals(q_pos, rows, cu_q, cu, n))
    assert torch.equal(first, want_first) and torch.equal(last, want_last)
    assert torch.equal(slot_rows, blocks.longest_first(rows))
    assert torch.equal(slot_rows[slot.long()], torch.arange(n, device=dev, dtype=rows.dtype))
    want = blocks.tile_lists(want_first, want_last, n, by_key)
    assert_same_lists(lists, want)


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("mode", ["random", "all", "none"])
def test_flash_query_sparse_with_fewer_queries_than_keys(mode, poison_flash):
    """Context parallelism's layout: a rank's query rows (here the last two of three documents' rows) over every
    rank's keys and values, each query at its true position in its true document (cu_q over the local slots, cu_k
    over all keys)."""
    key_lengths = [400, 700, 300]
    (_, k, v), cu_k = packed(key_lengths, 4, 128, torch.bfloat16, seed=8)
    local = [300, 200]  # rows 100.. of document 1 and 100.. of document 2 live on this rank
    q = torch.randn(sum(local), 4, 128, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    rows, _, cu_local = select(local, mode, seed=4)
    q_pos = torch.cat([torch.arange(100, 400), torch.arange(100, 300)]).to("cuda", torch.int32)  # true positions
    cu_q = torch.cat([cu_local[:1], cu_local]).contiguous()  # no local row in document 0
    fns = (lambda a, b, c: ops.query_sparse_attention(a, b, c, q_pos, rows, cu_q, cu_k, impl="flash"),
           lambda a, b, c: ref.query_sparse_attention(a, b, c, q_pos, rows, cu_q, cu_k))
    out, grads, want, wgrads = run_both(*fns, [q, k, v], torch.bfloat16, seed=2)
    check_all(out, grads, want, wgrads, torch.bfloat16, f"flash, fewer queries than keys [{mode}]")
