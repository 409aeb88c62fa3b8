"""KV-cache decoding equals re-encoding the whole prefix, for every attention kind and LoGo variant.

Reference: greedy decoding where every step runs the full model forward (training kernels) on the prefix,
one prompt at a time. The cached decoder runs a right-padded batch of prompts of different lengths (shorter
and longer than the window). float64: same tokens, logits within 1e-9 (abs and rel); float32: 1e-4.
"""
import pytest
import torch

from logo.config import AttentionConfig, ModelConfig
from logo.eval.decode import CHECK_EVERY, Decoder, choose, generate
from logo.eval.generate import greedy_generate
from logo.model import Transformer

VOCAB = 97
PROMPTS = [[5, 17, 3], [9, 1, 44, 2, 8, 30, 31, 7, 60], [12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 90, 91]]
NEW = 6

KINDS = {
    "full": dict(kind="full"),
    "local": dict(kind="local"),
    "inter_layer": dict(kind="inter_layer", global_fraction=0.5),
    "intra_layer": dict(kind="intra_layer", global_fraction=0.5),
    "logo": dict(kind="logo"),
    "inter_layer_logo": dict(kind="inter_layer", global_fraction=0.5, global_layer="logo"),
    "logo_so": dict(kind="logo", transform="so"),
    "logo_shared": dict(kind="logo", transform="shared"),
    "logo_full_params": dict(kind="logo", transform="full"),
    "logo_additive_no_norm": dict(kind="logo", fusion="additive", context_norm=False),
}


def make_model(attn: dict, dtype=torch.float64, threshold=None, seed=0, dim=32) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(name="t", dim=dim, n_layers=2, n_heads=4, vocab_size=VOCAB, ffn_multiple=16,
                      attention=AttentionConfig(window=4, **attn))
    model = Transformer(cfg)
    model.init_weights()
    with torch.no_grad():
        for layer in model.logo_layers():
            layer.gate.weight.normal_(0, 0.5)  # spread p so that routing is mixed at threshold 0.5
            if layer.attn_cfg.transform in ("lp", "so"):  # non-identity branch transforms
                for prm in layer.transform.parameters():
                    prm.add_(0.05 * torch.randn_like(prm))
            if threshold is not None:
                layer.threshold.fill_(threshold)
    return model.to(dtype).eval()


def reencode(model, prompt, n):
    """Greedy tokens and the logits each was chosen from, re-running the full forward every step."""
    ids, toks, logits = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            lg = model(torch.tensor([ids])).logits[0, -1]
            logits.append(lg)
            toks.append(int(lg[:VOCAB].argmax()))
            ids.append(toks[-1])
    return toks, torch.stack(logits)


def check_equal(model, tol):
    gen = generate(model, PROMPTS, NEW, return_logits=True)
    for b, prompt in enumerate(PROMPTS):
        toks, logits = reencode(model, prompt, NEW)
        assert gen.tokens[b] == toks, (b, gen.tokens[b], toks)
        torch.testing.assert_close(gen.logits[b].to(logits.dtype), logits[:, :VOCAB], atol=tol, rtol=tol)
    return gen


@pytest.mark.parametrize("name", list(KINDS))
def test_cached_decoding_equals_reencoding_fp64(name):
    gen = check_equal(make_model(KINDS[name]), 1e-9)
    if "logo" in name:
        s = gen.stats
        assert 0 < s["selected"] < s["rows"], s  # mixed routing: both paths exercised
        n_logo = 1 if name == "inter_layer_logo" else 2
        assert s["layer_steps"] == (NEW - 1) * n_logo and s["rows"] == len(PROMPTS) * s["layer_steps"]


@pytest.mark.parametrize("threshold,expect", [(2.0, "none"), (-1.0, "all")])
@pytest.mark.parametrize("name", ["logo", "inter_layer_logo"])
def test_routing_forced_none_or_all(name, threshold, expect):
    """Threshold 2: no token (prompt or new) is global and no global call is made; -1: every token is."""
    gen = check_equal(make_model(KINDS[name], threshold=threshold), 1e-9)
    s = gen.stats
    if expect == "none":  # the global kernel did no work at any (layer, step)
        assert s["selected"] == 0 and s["skipped"] == s["layer_steps"] > 0
    else:
        assert s["selected"] == s["rows"] > 0 and s["skipped"] == 0


def test_fp32_logo_within_tolerance():
    check_equal(make_model(KINDS["logo"], dtype=torch.float32), 1e-4)


def test_finished_rows_are_never_routed_and_keep_their_position():
    """A row that is not active is not routed global, does not advance, and its logits are not the ones of an
    appended token; the active rows' next logits equal re-encoding."""
    model = make_model(KINDS["logo"], threshold=-1.0)
    dec = Decoder(model, capacity=32)
    dec.prefill(PROMPTS)
    lg = dec.step(torch.tensor([1, 2, 3]), active=[True, False, True]).clone()
    s = dec.read_stats().as_dict()
    assert s["selected"] == s["rows"] == 2 * len(model.logo_layer_ids)
    assert dec.pos.tolist() == [len(PROMPTS[0]) + 1, len(PROMPTS[1]), len(PROMPTS[2]) + 1]
    for b, t in ((0, 1), (2, 3)):
        with torch.no_grad():
            ref = model(torch.tensor([PROMPTS[b] + [t]])).logits[0, -1]
        torch.testing.assert_close(lg[b], ref, atol=1e-9, rtol=1e-9)


def test_prefill_logits_match_the_forward_of_each_prompt():
    model = make_model(KINDS["logo"])
    dec = Decoder(model, capacity=20)
    lg = dec.prefill(PROMPTS)
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(lg[b], ref, atol=1e-9, rtol=1e-9)


def test_cache_memory_and_capacity():
    """Static caches at their final size: full keeps every position, local a ring of the window, LoGo both."""
    full, local, logo = (make_model(KINDS[k]) for k in ("full", "local", "logo"))
    H, D, L, S, W = 4, 8, 2, 40, 4
    for model, per_layer in ((full, 2 * H * S * D * 8), (local, 2 * H * W * D * 8),
                             (logo, 2 * H * S * D * 8 + 2 * H * W * D * 8)):
        dec = Decoder(model, capacity=S)
        dec.prefill([[1, 2, 3], [4, 5]])
        assert dec.cache_bytes == 2 * L * per_layer
    dec = Decoder(full, capacity=4)
    dec.prefill([[1, 2, 3]])
    dec.step(torch.tensor([4]))
    with pytest.raises(ValueError, match="cache is full"):
        dec.step(torch.tensor([5]))
    with pytest.raises(ValueError, match="no room"):
        Decoder(full, capacity=3).prefill([[1, 2, 3]])


def test_stop_ids_and_greedy_generate_paths_agree():
    model = make_model(KINDS["logo"])
    ref = greedy_generate(model, PROMPTS[1], 8, use_cache=False)
    assert greedy_generate(model, PROMPTS[1], 8) == ref
    stop = {ref[3]}
    cut = ref[:ref.index(ref[3])]
    assert greedy_generate(model, PROMPTS[1], 8, stop_ids=stop) == cut
    assert greedy_generate(model, PROMPTS[1], 8, stop_ids=stop, use_cache=False) == cut


def test_sampling_is_reproducible_and_top_p_keeps_the_nucleus():
    model = make_model(KINDS["logo"])
    a = generate(model, PROMPTS, 5, temperature=1.0, top_p=0.9, seed=3).tokens
    assert generate(model, PROMPTS, 5, temperature=1.0, top_p=0.9, seed=3).tokens == a
    greedy = generate(model, PROMPTS, 5).tokens
    assert generate(model, PROMPTS, 5, temperature=1.0, top_p=1e-6, seed=4).tokens == greedy  # nucleus of one
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]] * 400)
    picked = set(choose(logits, 1.0, 0.6, torch.Generator().manual_seed(0)).tolist())
    assert picked == {1, 2}  # 1 alone holds < 0.6 of the mass; 1 and 2 reach it; 0 and 3 are outside


def test_stop_predicate_cuts_where_it_first_holds():
    """Checked every CHECK_EVERY steps, yet a row ends where the predicate first held, as if checked every step."""
    model = make_model(KINDS["logo"])
    full = generate(model, PROMPTS, 2 * CHECK_EVERY + 3).tokens
    want = {0: 3, 1: CHECK_EVERY + 2, 2: 2 * CHECK_EVERY + 3}  # row 2: never holds
    got = generate(model, PROMPTS, 2 * CHECK_EVERY + 3, stop_fn=lambda b, toks: len(toks) >= want[b] and b < 2)
    assert got.tokens == [full[b][:want[b]] for b in range(3)]


def test_decoder_is_reused_and_stale_cache_entries_are_never_read():
    """A second batch of as many prompts reuses the caches (same results as a fresh Decoder)."""
    model = make_model(KINDS["intra_layer"])
    generate(model, [p[::-1] + [50] * 4 for p in PROMPTS], NEW)  # fills the caches with other tokens
    check_equal(model, 1e-9)


def test_bad_stop_ids_and_prompts_are_one_line_errors():
    model = make_model(KINDS["full"])
    with pytest.raises(ValueError, match=r"stop ids \[97, -1\]|stop ids \[-1, 97\]"):
        generate(model, PROMPTS, 2, stop_ids={97, -1})
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1], []], 2)


def test_caches_larger_than_free_memory_are_refused_before_allocating():
    model = make_model(KINDS["logo"])
    with pytest.raises(ValueError, match=r"a batch of 3 rows with room for \d+ tokens needs .* GiB of KV caches"):
        generate(model, PROMPTS, 10**12)


# --- on a GPU: bf16 against the training forward, CUDA graphs, no host synchronisation --------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def gpu_model(attn: dict, threshold=None, dtype=torch.bfloat16):
    model = make_model(attn, dtype=torch.float32, threshold=threshold, dim=64).cuda().to(dtype)  # head dim 16
    for layer in model.logo_layers():  # the threshold stays fp32, as in training
        layer.threshold.data = layer.threshold.data.float()
    return model


def teacher_forced_logits(model, prompt, toks):
    """The training forward over prompt + generated tokens: the logits each generated token was chosen from."""
    with torch.no_grad():
        lg = model(torch.tensor([prompt + toks], device="cuda")).logits[0, len(prompt) - 1:-1, :VOCAB]
    return lg.float()


@gpu
@pytest.mark.parametrize("name,threshold", [("full", None), ("local", None), ("intra_layer", None),
                                            ("inter_layer", None), ("logo", 2.0), ("logo", -1.0),
                                            ("inter_layer_logo", -1.0)])
def test_gpu_bf16_logits_match_the_training_forward(name, threshold):
    """bf16 caches and kernels vs the training forward on the generated tokens (teacher forced): relative error of
    each step's logits <= 3e-2. Routing is forced (none / all global) where a bf16 rounding could flip it."""
    model = gpu_model(KINDS[name], threshold)
    gen = generate(model, PROMPTS, 3 * CHECK_EVERY, return_logits=True)
    for b, prompt in enumerate(PROMPTS):
        n = len(gen.tokens[b])
        want = teacher_forced_logits(model, prompt, gen.tokens[b])
        got = gen.logits[b][:n].float().cuda()
        rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert rel.max() <= 3e-2, (b, rel.max().item())


@gpu
def test_gpu_fp32_mixed_routing_matches_reencoding():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = gpu_model(KINDS["logo"], dtype=torch.float32)
    gen = generate(model, PROMPTS, NEW, return_logits=True)
    assert 0 < gen.stats["selected"] < gen.stats["rows"]
    for b, prompt in enumerate(PROMPTS):
        want = teacher_forced_logits(model, prompt, gen.tokens[b])
        torch.testing.assert_close(gen.logits[b][:len(gen.tokens[b])].cuda(), want, atol=1e-3, rtol=1e-3)


@gpu
@pytest.mark.parametrize("name", ["full", "logo", "intra_layer"])
def test_gpu_decode_step_replays_a_graph_without_host_synchronisation(name):
    model = gpu_model(KINDS[name])
    dec = Decoder(model, capacity=64)
    logits = dec.prefill(PROMPTS)
    for _ in range(2):  # eager, then captured
        logits = dec.step(logits[:, :VOCAB].argmax(-1))
    assert dec.graph is not None
    active = torch.tensor([True, False, True], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            logits = dec.step(logits[:, :VOCAB].argmax(-1), active)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert dec.pos.tolist() == [len(PROMPTS[0]) + 5, len(PROMPTS[1]) + 2, len(PROMPTS[2]) + 5]


def test_decode_benchmark_runs_with_its_anchor(tmp_path):
    """benchmarks/decode.py on CPU: a row per kind and shape, LoGo's routing fractions, transformers' anchor."""
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "decode.json"
    assert bench.main(["--model", "tiny", "--device", "cpu", "--contexts", "64", "--batches", "2", "--new-tokens",
                       "3", "--warmup", "2", "--kinds", "full,logo", "--anchor", "transformers",
                       "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["full", "transformers", "logo"]
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert 0 <= rows[2]["global_fraction"] <= 1 and 0 <= rows[2]["skipped_fraction"] <= 1


@pytest.mark.parametrize("name", ["full", "local", "intra_layer", "logo", "logo_so", "logo_full_params",
                                  "logo_additive_no_norm"])
def test_decode_step_compiles_as_one_graph(name):
    """A decoding step through the block's own forward, as torch.compile fuses it on a GPU, traces without a graph
    break (fullgraph) and gives the eager step's outputs, caches and routing counts (traced here with the
    aot_eager backend: no code generation). Dynamo's cache of `block_forward` is reset first: other tests of the
    process (on other devices and dtypes) would count against its recompile limit."""
    from logo.eval.decode import block_forward
    from logo.model.kv_cache import DecodeStep
    from logo.model.layers import rope_cos_sin
    torch._dynamo.reset()
    model = make_model(KINDS[name])
    block = model.layers["0"]
    B, S = 3, 16
    pos = torch.tensor([2, 7, 11])
    cos, sin = rope_cos_sin(S, model.cfg.head_dim, model.cfg.rope_theta, torch.device("cpu"))
    h = torch.randn(B, 1, model.cfg.dim, dtype=torch.float64)
    outs = []
    for fn in (block_forward, torch.compile(block_forward, backend="aot_eager", fullgraph=True)):
        torch.manual_seed(0)
        c = block.attention.new_cache(B, S, torch.float64, torch.device("cpu"))
        for t in (c.dense, c.ring):
            if t is not None:
                t.k.normal_(), t.v.normal_()
        step = DecodeStep(pos, torch.tensor([True, False, True]), torch.zeros(3, dtype=torch.float64))
        with torch.no_grad():
            outs.append((fn(block, h, cos[pos], sin[pos], step, c), c, step.counts))
    (a, ca, na), (b, cb, nb) = outs
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(na, nb, atol=0, rtol=0)
    for x, y in ((ca.dense, cb.dense), (ca.ring, cb.ring)):
        if x is not None:
            torch.testing.assert_close(x.k, y.k, atol=0, rtol=0)
            torch.testing.assert_close(x.v, y.v, atol=0, rtol=0)
