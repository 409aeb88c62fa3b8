"""Budget fidelity: each controller on synthetic gate streams and on a model whose gate is flat,
the quantile estimate, windowed ratios, the off-budget warning, and the controller's checkpoint state."""
import logging
import math

import pytest
import torch

from logo.config import AttentionConfig, ConfigError, model_config
from logo.model import BudgetController, Transformer
from logo.model.controller import gate_histogram, histogram_quantile
from logo.model.flops import realized_global_fraction
from logo.model.routing import routing_stats
from logo.train.metrics import BudgetWatch

L = 4  # model=tiny


def tiny_model(**attn):
    cfg = model_config("tiny", vocab_size=64, attention=AttentionConfig(kind="logo", window=8, **attn))
    torch.manual_seed(0)
    m = Transformer(cfg)
    m.init_weights()
    return m


def drive(ctrl, gate_stream, steps, n=2048):
    """Run the controller on synthetic gates: gate_stream(step, layer) -> p (n,); routing is p > b, as in the
    model. Returns the per-step realized ratios (steps, L)."""
    ratios = []
    valid = torch.ones(n, dtype=torch.bool)
    for s in range(steps):
        rows = []
        for j, layer in enumerate(ctrl.layers):
            p = gate_stream(s, j)
            z = (p > layer.threshold) & valid
            rows.append(routing_stats(z, p, valid, layer.threshold, ctrl.cfg))
        r = torch.stack(rows)
        ratios.append(r[:, 0] / r[:, 1])
        ctrl.accumulate(r)
        ctrl.step()
    return torch.stack(ratios)


def stationary(s, j, n=2048):
    g = torch.Generator().manual_seed(1000 * s + j)
    return torch.sigmoid(0.2 * j - 0.3 + (0.05 + 0.3 * j) * torch.randn(n, generator=g))


def drifting(s, j, n=2048):
    g = torch.Generator().manual_seed(1000 * s + j)  # mean and spread move every step, as while training
    return torch.sigmoid(-1.0 + s / 100 + (0.02 + 0.002 * s) * (j + 1) * torch.randn(n, generator=g))


def flat(s, j, n=2048):
    return torch.full((n,), 0.5)


@pytest.mark.parametrize("stream", [stationary, drifting, flat])
def test_quantile_controller_holds_rho_on_synthetic_streams(stream):
    rho = 0.25
    ctrl = BudgetController(tiny_model(budget_control="quantile", rho=rho, gamma=0.005, threshold_init=0.5),
                            window=40)
    r = drive(ctrl, stream, 200)
    tail = r[-40:].mean(0)
    assert torch.all((tail - rho).abs() < 0.01), tail
    torch.testing.assert_close(ctrl.window_ratios().float(), tail.float(), rtol=0, atol=1e-6)  # the ring buffer
    if stream is not flat:  # a gate with spread: held every step (up to the batch's sampling noise, 0.01)
        assert float((r[-40:] - rho).pow(2).mean().sqrt()) < 0.02


def test_sign_controller_on_synthetic_streams_is_reported():
    """The paper's controller: converges on a gate with spread, averages 0.5 on a flat gate."""
    rho = 0.25
    out = {}
    for stream in (stationary, flat):
        ctrl = BudgetController(tiny_model(rho=rho, gamma=0.005, threshold_init=0.5), window=40)
        out[stream.__name__] = drive(ctrl, stream, 200)[-40:].mean(0)
    print({k: [round(float(x), 3) for x in v] for k, v in out.items()})
    assert torch.all((out["stationary"] - rho).abs() < 0.05)
    assert torch.all((out["flat"] - 0.5).abs() < 0.01)


@pytest.mark.parametrize("budget_control", ["quantile", "threshold"])
def test_flat_gate_model_windowed_ratio(budget_control):
    """The real model with w_g = 0 (p = 0.5 for every token): the quantile controller's windowed ratio is
    within 0.02 of rho; the sign controller's is reported."""
    rho = 0.25
    model = tiny_model(budget_control=budget_control, rho=rho, gamma=0.01, threshold_init=0.5)
    with torch.no_grad():
        for layer in model.logo_layers():
            layer.gate.weight.zero_()
    ctrl = BudgetController(model, window=24)
    g = torch.Generator().manual_seed(0)
    for _ in range(48):
        with torch.no_grad():
            ctrl.accumulate(model(torch.randint(0, 64, (1, 16), generator=g)).routing)
        ctrl.step()
    m = ctrl.metrics()
    win = [m[f"logo/ratio_window/layer_{i}"] for i in range(L)]
    print(budget_control, "windowed ratios", win)
    assert all(m[f"logo/gate_near_threshold/layer_{i}"] == 1.0 for i in range(L))  # every gate sits at b
    if budget_control == "quantile":
        assert all(abs(w - rho) <= 0.02 for w in win), win
        assert m["logo/global_flops_vs_budget"] == pytest.approx(1.0, abs=0.08)


def test_histogram_quantile_matches_exact_quantile():
    g = torch.Generator().manual_seed(0)
    p = torch.sigmoid(0.01 * torch.randn(50_000, generator=g))  # a freshly initialized gate: tiny spread
    hist = gate_histogram(p, torch.ones_like(p), 1025).double()[None]
    for level in (0.1, 0.5, 0.75, 0.9):
        b = float(histogram_quantile(hist, torch.tensor([level]))[0])
        assert float((p > b).float().mean()) == pytest.approx(1 - level, abs=0.005)
    assert float(histogram_quantile(hist, torch.tensor([1.0]))[0]) >= float(p.max())  # nothing above
    assert float(histogram_quantile(hist, torch.tensor([0.0]))[0]) < float(p.min())  # everything above



def test_gate_histogram_counts_each_valid_token_in_its_bin():
    """histc over bin centres gives exactly the bin of the u-space formula for every valid token (saturated and
    NaN gates included), and counts no padding."""
    from logo.model.controller import LOGIT_MAX, LOGIT_SCALE, U_MAX
    g = torch.Generator().manual_seed(3)
    p = torch.cat([torch.sigmoid(0.02 * torch.randn(4000, generator=g)), torch.rand(3000, generator=g),
                   torch.tensor([0.0, 1.0, float("nan"), 0.5])])
    valid = torch.rand(p.shape[0], generator=g) > 0.2
    bins = 1025
    u = torch.nan_to_num(torch.asinh(torch.logit(p.double()).clamp(-LOGIT_MAX, LOGIT_MAX) / LOGIT_SCALE), nan=0.0)
    expect = torch.zeros(bins, dtype=torch.float64)
    for t in range(p.shape[0]):
        if valid[t]:
            expect[min(max(int(math.floor((float(u[t]) + U_MAX) * bins / (2 * U_MAX))), 0), bins - 1)] += 1
    hist = gate_histogram(p, valid, bins)
    assert hist.dtype == torch.float32 and hist.shape == (bins,)
    assert float(hist.sum()) == int(valid.sum())
    assert (hist.double() - expect).abs().sum() <= 2  # fp32 vs fp64 rounding may move a token to a neighbour bin
    assert torch.equal(hist, gate_histogram(p, valid.float(), bins))


def test_compiled_gate_histogram_equals_histc():
    """Under torch.compile the histogram is a one-hot sum (`logo.kernels.gate.one_hot_counts`); the same counts as
    histc's, bin for bin, on the same bin indices (and through the whole compiled function, aot_eager: eager's
    arithmetic)."""
    from logo.kernels.gate import one_hot_counts
    g = torch.Generator().manual_seed(4)
    p = torch.cat([torch.sigmoid(0.02 * torch.randn(3000, generator=g)), torch.rand(2000, generator=g),
                   torch.tensor([0.0, 1.0, float("nan"), 0.5])])
    valid = torch.rand(p.shape[0], generator=g) > 0.2
    bins = 257
    idx = torch.randint(0, bins, (p.shape[0],), generator=g).float()
    idx[:50] = 7.0  # many tokens in one bin, as a fresh gate has
    want = torch.histc(torch.where(valid, idx + 0.5, -1.0), bins=bins, min=0, max=bins)
    assert torch.equal(one_hot_counts(idx, valid, bins), want)
    assert torch.equal(one_hot_counts(idx, valid.float(), bins), want)
    torch._dynamo.reset()
    compiled = torch.compile(gate_histogram, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(p, valid, bins), gate_histogram(p, valid, bins))


def test_quantile_state_is_restored_exactly_and_skipped_steps_change_nothing():
    def make():
        return BudgetController(tiny_model(budget_control="quantile", rho=0.3, gamma=0.005, threshold_init=0.45),
                                window=7)
    a = make()
    drive(a, drifting, 20)
    b = make()
    drive(b, drifting, 10)
    st, th = b.state_dict(), b.thresholds().clone()
    c = make()  # a fresh process: thresholds come from the model checkpoint, the rest from state_dict
    c.load_state_dict(st)
    for layer, v in zip(c.layers, th):
        layer.threshold.fill_(float(v))
    drive(c, lambda s, j: drifting(s + 10, j), 10)
    assert torch.equal(a.thresholds(), c.thresholds())
    for k in ("window", "integral", "engaged", "hist", "last"):
        assert torch.equal(a.state_dict()[k], c.state_dict()[k]), k
    assert a.metrics() == c.metrics()
    # a non-finite step (skip=True) leaves thresholds, integral and histogram as they were
    before = {k: v.clone() for k, v in a.state_dict().items() if isinstance(v, torch.Tensor)}
    th = a.thresholds().clone()
    p = drifting(20, 0)
    a.accumulate(torch.stack([routing_stats(p > 0.5, p, torch.ones_like(p, dtype=torch.bool), layer.threshold,
                                            a.cfg) for layer in a.layers]))
    a.step(skip=torch.tensor(True))
    assert torch.equal(a.thresholds(), th)
    for k in ("integral", "engaged", "hist"):
        assert torch.equal(a.state_dict()[k], before[k]), k


def test_budget_watch_warns_once_per_interval_naming_the_layer(caplog):
    w = BudgetWatch(rho=0.25, tolerance=0.02, pmask_steps=20, window=10, every=50)
    on = {"logo/ratio_window/layer_0": 0.26, "logo/ratio_window/layer_1": 0.49, "logo/ratio_window/layer_2": 0.3}
    with caplog.at_level(logging.WARNING, logger="logo"):
        assert w.check(25, on) is None  # the window still holds P-mask steps
        line = w.check(30, on)
        assert w.check(40, on) is None  # rate-limited
        assert w.check(80, on) is not None
        assert w.check(90, {"logo/ratio_window/layer_1": 0.25}) is None
    assert "layer 1" in line and "0.490" in line and "layer 2: 0.300" in line and "layer 0" not in line
    assert "\n" not in line and len(caplog.records) == 2


def test_realized_global_fraction_counts_static_layers():
    cfg = model_config("tiny", attention=AttentionConfig(kind="inter_layer", global_layer="logo",
                                                         layer_pattern="LG", rho=0.5))
    assert realized_global_fraction(cfg, [0.5, 0.25]) == pytest.approx((0 + 0.5 + 0 + 0.25) / 4)


@pytest.mark.parametrize("field,value", [("quantile_gain", 2.0), ("quantile_bins", 1024),
                                         ("quantile_decay", 1.0), ("budget_control", "pid")])
def test_bad_quantile_options_are_rejected(field, value):
    with pytest.raises(ConfigError, match=f"attention.{field}"):
        AttentionConfig(**{field: value}).validate()


# --- in the training loop (train.py on the embedded corpus, a few tiny steps) -----------------------------

def test_forced_off_budget_run_logs_metrics_and_warns(tmp_path, default_corpus):
    """gamma ~ 0 and no P-mask keep b at 0.5 (p ~ 0.5 +- 0.01, so about half the tokens global) while rho = 0.1:
    the windowed ratios land in metrics.jsonl and the console warns once, naming the layer."""
    from conftest import TINY_RUN, read_metrics, run_train
    p = run_train(*TINY_RUN, "train.steps=4", "checkpoint.interval=100", "eval.interval=0", "attention.pmask=false",
                  "attention.rho=0.1", "attention.gamma=1e-9", "logging.ratio_window=2", f"run.dir={tmp_path}")
    rows = read_metrics(tmp_path)
    for r in rows:
        for i in range(L):
            for k in ("ratio_window", "gate_near_threshold"):
                assert f"logo/{k}/layer_{i}" in r
        assert {"logo/ratio_window_mean", "logo/global_flops_fraction", "logo/global_flops_vs_budget"} <= set(r)
    last = rows[-1]
    win = [last[f"logo/ratio_window/layer_{i}"] for i in range(L)]
    assert last["logo/ratio_window_mean"] == pytest.approx(sum(win) / L)
    assert last["logo/global_flops_fraction"] == pytest.approx(sum(win) / L)  # every layer is LoGo
    warnings = [ln for ln in (p.stdout + p.stderr).splitlines() if "LoGo budget: layer" in ln]
    assert len(warnings) == 1, p.stdout + p.stderr  # rate-limited: once in 4 steps
    assert "rho=0.1" in warnings[0] and "budget_control=quantile" in warnings[0]


def test_resume_keeps_the_quantile_controller_state_exactly(tmp_path, default_corpus):
    import shutil
    from conftest import TINY_RUN, read_metrics, run_train
    args = (*TINY_RUN, "train.steps=6", "checkpoint.interval=3", "checkpoint.keep=10", "eval.interval=0",
            "attention.budget_control=quantile", "attention.rho=0.3", "logging.ratio_window=4")
    a, b = tmp_path / "straight", tmp_path / "resumed"
    run_train(*args, f"run.dir={a}")
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_00000003", b / "checkpoints" / "step_00000003")
    run_train(*args, f"run.dir={b}")
    ra = {r["step"]: r for r in read_metrics(a)}
    rb = {r["step"]: r for r in read_metrics(b)}
    assert sorted(rb) == [4, 5, 6]
    for s in rb:
        for k in ra[s]:
            if k.startswith("logo/"):
                assert ra[s][k] == rb[s][k], (s, k)  # windowed ratios span the restart; integrals; thresholds
    sa = torch.load(a / "checkpoints" / "step_00000006" / "train_state.pt", weights_only=False)["controller"]
    sb = torch.load(b / "checkpoints" / "step_00000006" / "train_state.pt", weights_only=False)["controller"]
    assert sa["steps"] == sb["steps"] == 6
    for k in ("window", "integral", "engaged", "hist", "last"):
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantile_controller_on_gpu_bf16_matches_cpu_histogram():
    """On CUDA under bf16 autocast (Triton kernels): the histogram counts are exact (integer sums in fp32), the
    controller holds rho on a flat gate, and a spread gate's realized ratio lands at rho in one step."""
    rho = 0.25
    model = tiny_model(budget_control="quantile", rho=rho, gamma=0.01, threshold_init=0.5).cuda()
    with torch.no_grad():
        for layer in model.logo_layers():
            layer.gate.weight.normal_(0, 0.3)
    ctrl = BudgetController(model, window=8)
    g = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(16):
        tokens = torch.randint(0, 64, (8, 512), generator=g).cuda()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(tokens)
        ratios.append(out.routing[:, 0] / out.routing[:, 1])
        hist = out.routing[:, 5:]
        assert torch.equal(hist.sum(1), out.routing[:, 1])  # every valid token counted once
        ctrl.accumulate(out.routing)
        ctrl.step()
    tail = torch.stack(ratios[-8:]).mean(0)
    assert torch.all((tail - rho).abs() < 0.02), tail


@pytest.mark.slow
@pytest.mark.skipif(__import__("os").environ.get("LOGO_TEST_LONG") != "1",
                    reason="the whole default CPU run (minutes): set LOGO_TEST_LONG=1")
def test_default_cpu_run_is_quiet_and_holds_rho_per_layer(tmp_path, default_corpus):
    """README's first command, `python train.py` (100 steps; the smoke stage's quantile controller): no warning,
    every layer's realized ratio over the budget window (logging.ratio_window) within logging.budget_tolerance of
    rho at every logged step the budget watch judges."""
    import json
    from omegaconf import OmegaConf
    from conftest import read_metrics, run_train
    p = run_train(f"run.dir={tmp_path}", timeout=1500)
    assert "warning" not in (p.stdout + p.stderr).lower(), p.stderr[-3000:]
    cfg = OmegaConf.load(tmp_path / "config.yaml")
    rho, tol, window = cfg.attention.rho, cfg.logging.budget_tolerance, cfg.logging.ratio_window
    start = json.loads((tmp_path / "plan.json").read_text())["pmask_steps"] + window
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    judged = [r for r in rows if r["step"] >= start]
    assert judged and rows[-1]["step"] == 100
    for r in judged:
        for i in range(L):
            assert abs(r[f"logo/ratio_window/layer_{i}"] - rho) <= tol, (r["step"], i)
