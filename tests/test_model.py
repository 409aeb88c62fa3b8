"""The decoder, the static hybrids' budgets, the budget controller, P-mask, and parameter/FLOP accounting."""
import pytest
import torch

from logo.config import AttentionConfig, ConfigError, ModelConfig, model_config
from logo.model import BudgetController, Transformer
from logo.model.flops import attention_budget, attention_flops_per_token, param_counts


def tiny(kind="logo", seed=0, **attn):
    torch.manual_seed(seed)
    cfg = model_config("tiny", vocab_size=300, attention=AttentionConfig(kind=kind, window=8, **attn))
    model = Transformer(cfg)
    model.init_weights()
    return model


def batch(B=2, T=32, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


@pytest.mark.parametrize("kind", ["full", "local", "inter_layer", "intra_layer", "logo"])
def test_every_kind_trains_one_step(kind):
    model = tiny(kind)
    tokens = batch()
    out = model(tokens[:, :-1])
    assert out.logits.shape == (2, 31, model.cfg.padded_vocab_size)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + out.aux_loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert (out.routing is not None) == (kind == "logo")


def test_vocab_padding_and_ffn_size():
    cfg = model_config("1.5b")
    assert cfg.padded_vocab_size == 100352 and cfg.padded_vocab_size % 128 == 0
    assert cfg.hidden_dim == 5632  # ceil(8*2048/3 = 5461.3 -> multiple of 256)
    assert cfg.head_dim == 128


def test_meta_device_build_then_init():
    cfg = model_config("tiny", vocab_size=300,
                       attention=AttentionConfig(kind="logo", threshold_init=-0.25))
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(float(layer.threshold) == -0.25 for layer in model.logo_layers())
    out = model(batch())
    assert torch.isfinite(out.logits).all()
    A = model.logo_layers()[0].transform.A
    assert torch.equal(A[1, 2], torch.eye(cfg.head_dim))  # LP transforms start as identities


@pytest.mark.parametrize("n_layers,frac,expect", [(12, 0.25, 3), (12, 0.5, 6), (12, 0.75, 9), (24, 0.5, 12)])
def test_inter_layer_hybrid_realizes_its_budget_exactly(n_layers, frac, expect):
    cfg = ModelConfig(dim=64, n_layers=n_layers, n_heads=4, vocab_size=100,
                      attention=AttentionConfig(kind="inter_layer", global_fraction=frac))
    with torch.device("meta"):
        model = Transformer(cfg)
    kinds = [b.attention_kind for b in model.layers.values()]
    assert kinds.count("full") == expect and kinds.count("local") == n_layers - expect
    assert attention_budget(cfg) == frac
    if frac == 0.5:
        assert kinds[:4] == ["local", "full", "local", "full"]  # 1:1 alternating
    if frac == 0.25:
        assert kinds[:4] == ["local", "local", "local", "full"]  # 1:3


def test_inter_layer_pattern_and_logo_global_layers():
    cfg = ModelConfig(dim=64, n_layers=6, n_heads=4, vocab_size=100,
                      attention=AttentionConfig(kind="inter_layer", layer_pattern="LLG", global_layer="logo"))
    with torch.device("meta"):
        model = Transformer(cfg)
    assert [b.attention_kind for b in model.layers.values()] == ["local", "local", "logo"] * 2
    assert model.logo_layer_ids == [2, 5]
    # inter-layer-H (1:1) + LoGo(0.5): budget 0.25 as in the paper's Table 8
    cfg2 = ModelConfig(dim=64, n_layers=4, n_heads=4, vocab_size=100,
                       attention=AttentionConfig(kind="inter_layer", global_layer="logo", rho=0.5))
    assert attention_budget(cfg2) == 0.25


@pytest.mark.parametrize("frac,expect", [(0.25, 3), (0.5, 6), (0.75, 9)])
def test_intra_layer_hybrid_realizes_its_budget_exactly(frac, expect):
    cfg = ModelConfig(dim=96, n_layers=2, n_heads=12, vocab_size=100,
                      attention=AttentionConfig(kind="intra_layer", global_fraction=frac))
    with torch.device("meta"):
        model = Transformer(cfg)
    for block in model.layers.values():
        assert block.attention.n_global == expect
        assert block.attention.n_global / cfg.n_heads == frac
    assert attention_budget(cfg) == frac


def test_intra_layer_global_heads_see_beyond_the_window_local_heads_do_not():
    from logo.model.attention import IntraLayerHybridAttention
    from logo.model.layers import PackedSeqs, rope_cos_sin
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=100,
                      attention=AttentionConfig(kind="intra_layer", global_fraction=0.5, window=4)).validate()
    att = IntraLayerHybridAttention(cfg)
    att.init_weights(0.3, 0.3)
    att.wo.weight.data = torch.eye(32)  # read per-head outputs directly
    x = torch.randn(1, 16, 32)
    seqs = PackedSeqs.build(1, 16, "cpu")
    cos, sin = rope_cos_sin(16, 8, 1e4, "cpu")
    x2 = x.clone()
    x2[0, 0] += 1.0  # perturb the first token, far outside the last token's window
    o1, o2 = att(x, cos, sin, seqs)[0], att(x2, cos, sin, seqs)[0]
    diff = (o1 - o2)[0, -1].view(4, 8).abs().amax(-1)  # per head, at the last position
    assert (diff[:2] > 1e-4).all() and (diff[2:] == 0).all()


def test_param_overhead_of_branch_transforms_at_1_5b():
    def total(**attn):
        with torch.device("meta"):
            return param_counts(Transformer(model_config("1.5b", attention=AttentionConfig(**attn))))[0]
    base = total(kind="full")
    lp = total(kind="logo", transform="lp") / base - 1
    full = total(kind="logo", transform="full") / base - 1
    so = total(kind="logo", transform="so") / base - 1
    assert 0.008 < lp < 0.015, lp  # "roughly 1%"
    assert 0.15 < full < 0.25, full  # "about 20%"
    assert so < 0.001


def test_param_counts_match_the_formula():
    cfg = model_config("200m", attention=AttentionConfig(kind="full"))
    with torch.device("meta"):
        total, non_emb = param_counts(Transformer(cfg))
    d, L, hidden, V = 768, 12, cfg.hidden_dim, cfg.padded_vocab_size
    per_layer = 4 * d * d + 3 * d * hidden + 2 * d
    assert non_emb == L * per_layer + d
    assert total == non_emb + 2 * V * d


def test_attention_flops_ordering_and_values():
    T = 8192
    f = {k: attention_flops_per_token(model_config("1.5b", attention=AttentionConfig(kind=k)), T)
         for k in ["full", "local", "inter_layer", "intra_layer", "logo"]}
    H_D, L = 2048, 24
    assert f["full"] == pytest.approx(L * 4 * H_D * (T + 1) / 2)
    assert f["inter_layer"] == pytest.approx(f["intra_layer"])
    assert f["local"] < f["inter_layer"] < f["full"]
    assert f["logo"] == pytest.approx(f["local"] + 0.5 * f["full"])  # local for all + rho global


# --- budget controller -----------------------------------------------------------------------------

def fake_stats(layers, selected, valid):
    return torch.tensor([[selected, valid, 0.5 * valid, 0.25 * valid, 0.0]] * layers, dtype=torch.float32)


@pytest.mark.parametrize("selected,expected_sign", [(60, 1), (40, -1), (50, 0)])
def test_controller_moves_threshold_by_exactly_gamma(selected, expected_sign):
    model = tiny("logo", gamma=0.01, rho=0.5)
    ctrl = BudgetController(model)
    before = ctrl.thresholds().clone()
    ctrl.accumulate(fake_stats(4, selected / 2, 50))  # two micro-batches: counts are summed first
    ctrl.accumulate(fake_stats(4, selected / 2, 50))
    ctrl.step()
    delta = ctrl.thresholds() - before
    torch.testing.assert_close(delta, torch.full((4,), expected_sign * 0.01), atol=1e-7, rtol=0)
    m = ctrl.metrics()
    assert m["logo/ratio/layer_0"] == pytest.approx(selected / 100)
    assert set(f"logo/{k}/layer_{i}" for k in ("ratio", "threshold", "gate_mean", "gate_std")
               for i in range(4)) <= set(m)


def test_controller_sums_micro_batches_before_the_sign():
    """Micro-batch 1 is above rho, micro-batch 2 below; only their sum decides the direction."""
    model = tiny("logo", gamma=0.01, rho=0.5)
    ctrl = BudgetController(model)
    before = ctrl.thresholds().clone()
    ctrl.accumulate(fake_stats(4, 30, 40))  # 0.75
    ctrl.accumulate(fake_stats(4, 10, 60))  # 0.17 -> total 40/100 = 0.4 < 0.5
    ctrl.step()
    torch.testing.assert_close(ctrl.thresholds() - before, torch.full((4,), -0.01), atol=1e-7, rtol=0)


def test_pmask_ramp_reaches_half_after_S_steps():
    assert AttentionConfig().pmask_threshold_init(5000) == pytest.approx(-2.0)  # the paper's 100B-token run
    assert AttentionConfig(pmask=False).pmask_threshold_init(5000) == 0.5
    gamma, S = 0.05, 20  # b0 = -0.5: below every p, as in the paper's b0 = -2 (a short ramp keeps the test fast)
    cfg_attn = dict(gamma=gamma, rho=0.5)
    b0 = AttentionConfig(**cfg_attn).pmask_threshold_init(S)
    model = tiny("logo", threshold_init=b0, **cfg_attn)
    ctrl = BudgetController(model)
    tokens = batch()
    for _ in range(S):
        with torch.no_grad():
            out = model(tokens)
        assert torch.all(out.routing[:, 0] == out.routing[:, 1])  # P-mask phase: every token is global
        ctrl.accumulate(out.routing)
        ctrl.step()
    torch.testing.assert_close(ctrl.thresholds(), torch.full((4,), 0.5), atol=1e-6, rtol=0)


def test_controller_drives_realized_ratio_to_rho():
    model = tiny("logo", gamma=0.01, rho=0.3, threshold_init=0.5)
    with torch.no_grad():
        for layer in model.logo_layers():
            layer.gate.weight.normal_(0, 0.3)  # a gate with spread, as after training
    ctrl = BudgetController(model)
    ratios = []
    for step in range(120):
        with torch.no_grad():
            out = model(batch(B=4, T=64, seed=step))
        ctrl.accumulate(out.routing)
        ctrl.step()
        ratios.append(ctrl.metrics()["logo/ratio_mean"])
    assert abs(sum(ratios[-40:]) / 40 - 0.3) < 0.05


def test_aux_loss_variant_has_gradient_and_ramps_threshold():
    model = tiny("logo", budget_control="aux_loss", aux_loss_coef=1.0, threshold_init=0.48, gamma=0.01, rho=0.2)
    out = model(batch())
    assert out.aux_loss > 0
    out.aux_loss.backward()
    assert model.logo_layers()[0].gate.weight.grad.abs().sum() > 0
    ctrl = BudgetController(model)
    for _ in range(5):
        ctrl.accumulate(out.routing.detach())
        ctrl.step()
    torch.testing.assert_close(ctrl.thresholds(), torch.full((4,), 0.5), atol=1e-6, rtol=0)


@pytest.mark.parametrize("field,value,cfg", [
    ("attention.rho", 0.0, dict(attention=AttentionConfig(rho=0.0))),
    ("attention.rho", 1.5, dict(attention=AttentionConfig(rho=1.5))),
    ("attention.window", 0, dict(attention=AttentionConfig(window=0))),
    ("attention.kind", "sparse", dict(attention=AttentionConfig(kind="sparse"))),
    ("model.n_heads", 5, dict(n_heads=5)),
    ("attention.global_fraction", 0.3, dict(attention=AttentionConfig(kind="inter_layer", global_fraction=0.3))),
])
def test_bad_configs_name_the_field(field, value, cfg):
    with pytest.raises(ConfigError, match=f"{field}={value!r}".replace(".", r"\.")):
        Transformer(ModelConfig(**cfg))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rope_eager_and_compiled_formulas_agree(dtype):
    """Eager RoPE (a complex multiply) equals the pairwise real formula (what compiled code runs) forward and
    backward within rounding (the complex kernel may fuse the multiply-adds: 1 ulp in fp32, 1 bf16 ulp after
    the cast); the compiled function is the real formula itself. Each pair (x0, x1) is rotated by its angle."""
    from logo.kernels.rope import _rotate, upcast

    def pairwise(x, cos, sin):
        xf = upcast(x).unflatten(-1, (-1, 2))
        x0, x1, c, s = xf[..., 0], xf[..., 1], cos.to(xf.dtype), sin.to(xf.dtype)
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)

    torch.manual_seed(0)
    x = torch.randn(2, 16, 3, 8, dtype=dtype, requires_grad=True)
    ang = torch.rand(16, 4) * 6.3
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    got, want = _rotate(x, cos, sin), pairwise(x, cos, sin)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    g = torch.randn_like(got)
    torch.testing.assert_close(*(torch.autograd.grad(f(x, cos, sin), x, g)[0] for f in (_rotate, pairwise)),
                               rtol=tol, atol=tol)
    compiled = torch.compile(_rotate, fullgraph=True, backend="aot_eager")(x, cos, sin)
    assert torch.equal(compiled, want)
    # a pair at angle pi/2: (1, 0) -> (0, 1)
    one = torch.tensor([1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(_rotate(one, torch.tensor([0.0]).double(), torch.tensor([1.0]).double()),
                               torch.tensor([0.0, 1.0], dtype=torch.float64))
