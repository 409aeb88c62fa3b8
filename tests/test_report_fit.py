"""Scaling fits of the sweep report on fabricated run directories whose final losses follow a known saturating
power law plus seed noise: the fit recovers E, A and alpha within its reported intervals, and the compute
multiplier between two curves is the one built into the data."""
import json

import numpy as np
import pytest

from logo.report.__main__ import main
from logo.report.fit import FitError, PowerLaw, _ratio, compute_multiplier, fit_power_law
from report_fixtures import make_run

E, A, ALPHA = 1.7, 1000.0, 0.15  # L = E + A * C^-alpha, C in FLOPs
K = 1.3  # LoGo's curve is the Transformer's at K times the compute: it needs K times less compute for a loss
NOISE = 0.004  # seed noise of the final loss (std)
SIZES = (("200m", 2.0e8), ("470m", 4.7e8), ("900m", 9.0e8), ("1.5b", 1.5e9), ("3.3b", 3.3e9))
BATCH = 524_288
SEEDS = 3
B = 300  # bootstrap refits (the CLI default is 1000)


def true_loss(c, kind):
    return E + A * ((K if kind == "logo" else 1.0) * c) ** -ALPHA


@pytest.fixture(scope="module")
def scaling_runs(tmp_path_factory):
    """5 sizes x {full, logo} x 3 seeds at 20 tokens per parameter; each run's last logged loss is the law's
    value at its training compute plus N(0, NOISE) (the report averages only that step: --last-steps 1)."""
    root = tmp_path_factory.mktemp("scaling")
    rng = np.random.default_rng(6)  # a realization whose truths lie well inside (>= 9% of the width) every interval
    compute = {}
    for size, n in SIZES:
        steps = int(20 * n) // BATCH
        fpt = 6.0 * n
        compute[size] = fpt * steps * BATCH
        for kind in ("full", "logo"):
            for seed in range(SEEDS):
                loss = true_loss(compute[size], kind) + rng.normal(0.0, NOISE)
                make_run(root, f"scaling-{size}_{kind}-pretrain_8k-seed{seed}", losses=[loss + 0.3, loss],
                         size=size, kind=kind, experiment=f"scaling/{size}_{kind}", seed=seed, steps=steps,
                         interval=max(1, steps // 2), params=int(n * 1.2), non_emb=int(n), flops_per_token=fpt,
                         batch_tokens=BATCH)
    out = tmp_path_factory.mktemp("report") / "scaling"
    assert main([str(root), "--out", str(out), "--last-steps", "1", "--bootstrap", str(B)]) == 0
    return root, out, compute


def test_fit_recovers_parameters_within_intervals(scaling_runs):
    _, out, _ = scaling_runs
    rep = json.loads((out / "report.json").read_text())
    fits = {(f["model"], f["x"]): f for f in rep["fits"]}
    for model, a in (("Transformer", A), ("LoGo", A * K ** -ALPHA)):
        f = fits[(model, "train_flops")]
        assert f["points"] == len(SIZES) * SEEDS and f["bootstrap"] >= 0.95 * B
        for name, true in (("E", E), ("A", a), ("alpha", ALPHA)):
            lo, hi = f["intervals"][name]
            assert lo <= true <= hi, (model, name, true, lo, hi)
            assert lo <= f[name] <= hi
        assert f["E"] == pytest.approx(E, abs=0.06) and f["alpha"] == pytest.approx(ALPHA, rel=0.1)
        assert f["rmse"] < 2 * NOISE and f["identified"]
        assert fits[(model, "params_non_embedding")]["points"] == len(SIZES) * SEEDS  # the loss-vs-N curve


def test_compute_multiplier_is_right(scaling_runs):
    _, out, compute = scaling_runs
    rep = json.loads((out / "report.json").read_text())
    ms = [m for m in rep["multipliers"] if m["model"] == "LoGo" and m["baseline"] == "Transformer"]
    assert sorted(round(m["x"]) for m in ms) == sorted(round(c) for c in compute.values())  # one per size
    for m in ms:
        lo, hi = m["interval"]
        assert lo <= K <= hi, m
        assert m["multiplier"] == pytest.approx(K, rel=0.08), m  # 8%: noise 0.004 on losses 2.3-3.3
    md = (out / "report.md").read_text()
    assert "Compute multiplier" in md and "## Scaling fits" in md
    for png in ("loss_vs_compute.png", "loss_vs_params.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multiplier_and_inverse_exact():
    """Noise-free curves: the multiplier is K at every compute, the inverse inverts, unreachable losses say so."""
    c = np.repeat(np.geomspace(1e18, 1e21, 5), 2)
    base = fit_power_law(c, E + A * c ** -ALPHA + np.tile([1e-4, -1e-4], 5), n_boot=50)
    other = fit_power_law(c, E + A * (K * c) ** -ALPHA + np.tile([1e-4, -1e-4], 5), n_boot=50)
    for x in (1e18, 1e20, 1e21):
        m = compute_multiplier(base, other, x)
        assert m.value == pytest.approx(K, rel=1e-2)
        assert m.interval[0] <= m.value <= m.interval[1]
    law = PowerLaw(E, A, ALPHA)
    assert law.inverse(float(law.predict(3e19))) == pytest.approx(3e19, rel=1e-9)
    assert law.inverse(E - 0.1) == float("inf")
    # degenerate fits of noisy points (alpha at its lower bound): the inverse under- or overflows, the multiplier
    # is then inf (reached at no compute) or 0 (never reached), not an error
    assert PowerLaw(1.0, 0.5, 1e-4).inverse(2.0) == 0.0 and _ratio(1e20, 0.0) == float("inf")
    assert PowerLaw(1.0, 2.0, 1e-4).inverse(1.5) == float("inf") and _ratio(1e20, float("inf")) == 0.0


def test_fit_needs_three_sizes_and_exact_fit_has_no_interval():
    with pytest.raises(FitError, match=">= 3 distinct x"):
        fit_power_law([1e18, 1e18, 1e19, 1e19], [3.0, 3.01, 2.8, 2.79])
    f = fit_power_law([1e18, 1e19, 1e20], [3.0, 2.7, 2.5], n_boot=100)
    assert f.interval("E") is None and len(f.boot) == 0 and f.identified
    assert np.allclose(f.law.predict(f.x), f.y, atol=1e-6)


def test_noise_larger_than_the_trend_is_flagged():
    """Seed noise of 1.0 on a 0.3 trend (like 20-step CPU runs): the fit runs but says it is not identified."""
    c = np.repeat([1e11, 2e11, 4e11], 2)
    f = fit_power_law(c, [10.2, 9.0, 9.9, 8.2, 9.5, 7.6], n_boot=200)
    assert not f.identified
