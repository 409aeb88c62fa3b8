"""KV-cache decoding equals re-encoding the whole prefix, for every attention kind and LoGo variant.

Reference: greedy decoding where every step runs the full model forward (training kernels) on the prefix,
one prompt at a time. The cached decoder runs a right-padded batch of prompts of different lengths (shorter
and longer than the window). float64: same tokens, logits within 1e-9 (abs and rel); float32: 1e-4.
"""
import pytest
import torch

from logo.config import AttentionConfig, ModelConfig
from logo.eval.decode import Decoder, generate
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


def make_model(attn: dict, dtype=torch.float64, threshold=None, seed=0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(name="t", dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, ffn_multiple=16,
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
        torch.testing.assert_close(gen.logits[b].to(logits.dtype), logits, atol=tol, rtol=tol)
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
    if expect == "none":
        assert s["selected"] == 0 and s["global_calls"] == 0 and s["skipped"] == s["layer_steps"] > 0
    else:
        assert s["selected"] == s["rows"] > 0 and s["skipped"] == 0
        assert s["global_calls"] == s["layer_steps"]  # all rows selected: one contiguous run, one call


def test_fp32_logo_within_tolerance():
    check_equal(make_model(KINDS["logo"], dtype=torch.float32), 1e-4)


def test_selected_rows_only_and_finished_rows_never_routed():
    """Only some rows selected -> one global call per layer (over rows first..last selected); a finished row is
    not routed global."""
    model = make_model(KINDS["logo"], threshold=-1.0)
    dec = Decoder(model, capacity=32)
    dec.prefill(PROMPTS)
    dec.step(torch.tensor([1, 2, 3]), active=[True, False, True])  # rows 0 and 2: one call over rows 0..2
    s = dec.stats.as_dict()
    assert s["selected"] == s["rows"] == 2 * len(model.logo_layer_ids)
    assert s["global_calls"] == len(model.logo_layer_ids)


def test_prefill_logits_match_the_forward_of_each_prompt():
    model = make_model(KINDS["logo"])
    dec = Decoder(model, capacity=20)
    lg = dec.prefill(PROMPTS)
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(lg[b], ref, atol=1e-9, rtol=1e-9)


def test_cache_memory_and_capacity():
    full, local, logo = (make_model(KINDS[k]) for k in ("full", "local", "logo"))
    H, D, L, S, W = 4, 8, 2, 40, 4
    for model, per_layer in ((full, 2 * H * S * D * 8), (local, 2 * H * W * D * 8 + W * 8),
                             (logo, 2 * H * S * D * 8 + 2 * H * W * D * 8 + W * 8)):
        dec = Decoder(model, capacity=S)
        dec.prefill([[1, 2, 3]])
        assert dec.cache_bytes == L * per_layer
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
