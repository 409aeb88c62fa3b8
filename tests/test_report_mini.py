"""`python -m logo.report --family mini` on fabricated run directories: the four arms in the paper's order with
held-out ppl, synthetic accuracies, RULER and the realized ratio as mean ± std over seeds, Welch's test of each arm
against LoGo (checked against a t distribution integrated here), the realized-ratio check over the last 10% of
each run (a layer off by more than 0.02 is named), the heatmap and the span-allocation plot."""
import json
import math

import pandas as pd
import pytest

from logo.report.__main__ import main
from report_fixtures import make_run

ARMS = (("transformer", "full"), ("inter_layer", "inter_layer"), ("intra_layer", "intra_layer"), ("logo", "logo"))
PPL = {"transformer": (20.0, 20.4, 19.9), "inter_layer": (21.0, 21.6, 21.2), "intra_layer": (20.5, 20.9, 20.6),
       "logo": (20.2, 20.3, 20.0)}
ACC = {"transformer": (0.90, 0.95, 0.85), "inter_layer": (0.30, 0.25, 0.40), "intra_layer": (0.50, 0.55, 0.60),
       "logo": (0.80, 0.85, 0.90)}
RULER = {"transformer": (80.0, 70.0, 75.0), "inter_layer": (10.0, 20.0, 15.0), "intra_layer": (30.0, 35.0, 40.0),
         "logo": (60.0, 65.0, 55.0)}
STEPS, LAYERS = 20, 2
# LoGo per seed and layer: the ratio logged at steps 19 and 20 (the last 10%); earlier steps log 0.9 (not counted)
TAIL = {0: ((0.51, 0.49), (0.50, 0.52)), 1: ((0.50, 0.50), (0.53, 0.536)), 2: ((0.48, 0.49), (0.51, 0.50))}
SPAN_FAR, SPAN_ALL = (0.9, 0.7), (0.5, 0.5)


def _mean_std(xs):
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _welch_p(a, b) -> float:
    """Two-sided p of Welch's t-test: the Student t density with the Welch-Satterthwaite degrees of freedom,
    integrated by Simpson's rule."""
    (ma, sa), (mb, sb) = _mean_std(a), _mean_std(b)
    va, vb = sa ** 2 / len(a), sb ** 2 / len(b)
    t = abs(ma - mb) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def pdf(x):
        return c * (1 + x * x / df) ** (-(df + 1) / 2)
    n = 20000
    h = t / n
    area = pdf(0) + pdf(t) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
    return 1.0 - 2.0 * area * h / 3


def _rewrite_ratios(d, tail):
    """metrics.jsonl with per-layer ratios: 0.9 before the last 10% of the steps, `tail` (per step) in it."""
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        for i in range(LAYERS):
            r[f"logo/ratio/layer_{i}"] = tail[i][r["step"] - STEPS + 1] if r["step"] > STEPS - 2 else 0.9
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _synthetic(d, arm, seed):
    res = {"task": "associative_recall", "label": "associative_recall", "accuracy": ACC[arm][seed] / 2,
           "token_accuracy": ACC[arm][seed]}  # the table reads the token accuracy
    if arm == "logo":
        res["span"] = {"layer_ids": [0, 1], "far": {"layer_ratio": [x - 0.05 * seed for x in SPAN_FAR]},
                       "all": {"layer_ratio": list(SPAN_ALL)}}
    (d / "eval" / "synthetic_associative_recall.json").write_text(json.dumps(
        {"kind": "synthetic", "step": STEPS, "results": res}))


@pytest.fixture(scope="module")
def mini_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mini") / "runs"
    for arm, kind in ARMS:
        for seed in range(3):
            evals = {"perplexity": {"dataset": "/data/corpus", "ppl": PPL[arm][seed], "loss": math.log(PPL[arm][seed])},
                     "ruler": {"scores": {"niah_single_1": {"4096": RULER[arm][seed]}},
                               "average": {"4096": RULER[arm][seed]}}}
            d = make_run(root, f"mini-{arm}-seed{seed}", losses=[3.0] * STEPS, size="mini", n_layers=LAYERS,
                         kind=kind, experiment=f"mini/{arm}", stage="mini", seed=seed, evals=evals,
                         ratios=[0.5] * LAYERS if arm == "logo" else None)
            if arm == "logo":
                _rewrite_ratios(d, TAIL[seed])
            _synthetic(d, arm, seed)
    return root


@pytest.fixture(scope="module")
def report(mini_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "mini"
    assert main([str(mini_runs), "--family", "mini", "--out", str(out)]) == 0
    return out


def test_table_rows_columns_and_seed_statistics(report):
    md = (report / "table_mini.md").read_text().splitlines()
    header = [h.strip() for h in md[0].strip("|").split("|")]
    assert header[:6] == ["Model", "corpus ppl", "associative_recall token acc.", "RULER 4k", "RULER avg.",
                          "Global ratio"]
    assert [ln.split("|")[1].strip() for ln in md[2:]] == ["Transformer", "inter-layer-H", "intra-layer-H", "LoGo"]
    df = pd.read_csv(report / "table_mini.csv").set_index("model")
    names = dict(zip((a for a, _ in ARMS), ("Transformer", "inter-layer-H", "intra-layer-H", "LoGo")))
    for arm, name in names.items():
        for key, xs in (("ppl/corpus", PPL[arm]), ("synthetic/associative_recall/token_accuracy",
                                                   [100 * x for x in ACC[arm]]), ("ruler/4k", RULER[arm])):
            m, s = _mean_std(xs)
            assert df.loc[name, f"{key}_mean"] == pytest.approx(m, rel=1e-12)
            assert df.loc[name, f"{key}_std"] == pytest.approx(s, rel=1e-9)
    logo_ratio = sum(sum(TAIL[s][i][0] + TAIL[s][i][1] for i in range(LAYERS)) / (2 * LAYERS) for s in TAIL) / 3
    assert df.loc["LoGo", "ratio_mean_mean"] == pytest.approx(logo_ratio, rel=1e-12)
    assert math.isnan(df.loc["Transformer", "ratio_mean_mean"])


def test_welch_tests_against_logo(report):
    rep = json.loads((report / "report.json").read_text())
    cmp = {(c["row"].split(" (")[0], c["metric"]): c for c in rep["comparisons"]}
    assert {c["baseline"].split(" (")[0] for c in rep["comparisons"]} == {"mini LoGo"}
    for arm, name in (("transformer", "Transformer"), ("inter_layer", "inter-layer-H"),
                      ("intra_layer", "intra-layer-H")):
        for key, data in (("ppl/corpus", PPL), ("synthetic/associative_recall/token_accuracy", ACC),
                          ("ruler/4k", RULER), ("ruler_avg", RULER)):
            c = cmp[(f"mini {name}", key)]
            assert c["p"] == pytest.approx(_welch_p(data[arm], data["logo"]), abs=1e-7), (arm, key)
            scale = 100 if key.startswith("synthetic") else 1
            assert c["diff"] == pytest.approx(scale * (sum(data[arm]) - sum(data["logo"])) / 3, rel=1e-9)
    assert cmp[("mini inter-layer-H", "synthetic/associative_recall/token_accuracy")]["verdict"] == \
        "worse, exceeds seed noise"
    assert ("mini Transformer", "ratio_mean") not in cmp  # only LoGo logs a ratio


def test_ratio_check_names_the_layer_off_by_more_than_the_tolerance(report):
    checks = pd.read_csv(report / "ratio_check.csv")
    assert len(checks) == 3 * LAYERS
    off = checks[~checks["within"]]
    assert off[["train_seed", "layer"]].values.tolist() == [[1, 1]]
    assert off["ratio"].iloc[0] == pytest.approx((0.53 + 0.536) / 2, rel=1e-12)
    assert off["diff"].iloc[0] == pytest.approx(0.033, abs=1e-12)
    md = (report / "report.md").read_text()
    assert "## Realized ratio check" in md and "1 of 6 layers (3 runs) are NOT within" in md
    assert "mini-logo-seed1 layer 1: 0.533 vs rho 0.5 (+0.033)" in md


def test_heatmap_span_plot_and_span_table(report):
    for png in ("ratio_heatmap.png", "span_allocation.png"):
        assert (report / png).stat().st_size > 1000
    span = pd.read_csv(report / "span_allocation.csv")
    assert span["Row"].tolist() == ["mini LoGo (budget 0.5), mini"]
    far0 = _mean_std([SPAN_FAR[0] - 0.05 * s for s in range(3)])
    assert span["L0 far / all"].iloc[0] == f"{far0[0]:.3f} ± {far0[1]:.3f} / 0.500 ± 0.000"
    assert "## Span allocation on the synthetic tasks" in (report / "report.md").read_text()


def test_an_unreadable_synthetic_result_is_a_note(mini_runs, tmp_path, capsys):
    bad = mini_runs / "mini-logo-seed0" / "eval" / "synthetic_far_copy.json"
    bad.write_text('{"kind": "synthetic", "results": ')
    try:
        assert main([str(mini_runs), "--family", "mini", "--out", str(tmp_path / "r")]) == 0
    finally:
        bad.unlink()
    out = capsys.readouterr().out
    assert "eval/synthetic_far_copy.json is not valid JSON" in out and "Traceback" not in out


def test_tail_ratio_is_the_mean_of_the_window_means_in_the_last_tenth(tmp_path):
    """With window means logged (the budget reporting's), the tail ratio averages them over the records of the
    last 10% of the steps; without a tail, the last record's window mean is the value, as before."""
    from logo.report.runs import load_run
    from logo.report.values import run_values
    d = make_run(tmp_path, "w", losses=[3.0] * STEPS, kind="logo", ratios=[0.5])
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        r["logo/ratio_window/layer_0"] = {19: 0.46, 20: 0.50}.get(r["step"], 0.9)
        r["logo/ratio/layer_0"] = 0.7  # per-step values: not used when window means are logged
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(d)
    assert run_values(run, 100, ratio_tail=0.1)["ratio/0"] == pytest.approx(0.48, abs=1e-12)
    assert run_values(run, 100)["ratio/0"] == 0.50
