"""Evaluation results (`<run_dir>/eval/<kind>.json`, written by the evaluation command) as flat report values.

    perplexity: results {"dataset", "split", "seq_len", "tokens", "loss", "ppl", "buckets"} (or a list of them)
                -> ppl/<dataset>, loss/<dataset> (<dataset>: the corpus folder's name)
    ruler:      results {"scores": {task: {length: score}}, "average": {length: score}}
                -> ruler/<length> (average over tasks), ruler/<task>/<length>, ruler_avg (mean over lengths)
    lm_eval:    results {task: {metric: value}} (lm-eval's "metric,filter" keys accepted)
                -> the paper's columns through LM_EVAL_COLUMNS, everything else as lm_eval/<task>/<metric>
    synthetic:  results {"label", "accuracy", "token_accuracy", "span"?} (one file per task)
                -> synthetic/<label>/accuracy, synthetic/<label>/token_accuracy (x100, as RULER's scores);
                span/<label>/far/<layer>, span/<label>/all/<layer> (global ratio of a LoGo layer at the positions
                predicting an answer token / at every position)
"""
from __future__ import annotations

import math
from pathlib import PurePath
from typing import Optional

# The paper's Table 2/3 columns from lm-eval-harness task/metric names: (column, task, metric, scale).
# Accuracies are fractions in lm-eval and percentages in the paper (x100). HellaSwag and ARC-Challenge use the
# length-normalized accuracy, the others plain accuracy (the paper does not say; this is the common choice).
LM_EVAL_COLUMNS = (
    ("wiki_ppl", "wikitext", "word_perplexity", 1.0),
    ("lmb_ppl", "lambada_openai", "perplexity", 1.0),
    ("lmb_acc", "lambada_openai", "acc", 100.0),
    ("piqa", "piqa", "acc", 100.0),
    ("hella", "hellaswag", "acc_norm", 100.0),
    ("wino", "winogrande", "acc", 100.0),
    ("arc_e", "arc_easy", "acc", 100.0),
    ("arc_c", "arc_challenge", "acc_norm", 100.0),
)
CSR_COLUMNS = ("lmb_acc", "piqa", "hella", "wino", "arc_e", "arc_c")  # the paper's commonsense average


def _num(v) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def length_label(length) -> str:
    """RULER length keys ("8192", 8192, "8k") as the paper writes them: 8k, 16k, 128k."""
    try:
        n = int(length)
    except (TypeError, ValueError):
        return str(length)
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def length_order(label: str) -> float:
    try:
        return float(label[:-1]) * 1024 if label.endswith("k") else float(label)
    except ValueError:
        return math.inf


def dataset_name(dataset) -> str:
    """A perplexity result's dataset (a corpus folder) as a column name: the folder's name, "default_corpus" for
    the embedded corpus (its folder is named by a hash)."""
    path = PurePath(str(dataset or "eval"))
    if path.parent.name == "default_corpus":
        return "default_corpus"
    return path.name or str(dataset)


def perplexity_values(results) -> dict[str, float]:
    out = {}
    for r in results if isinstance(results, list) else [results]:
        if not isinstance(r, dict):
            continue
        name = dataset_name(r.get("dataset"))
        for k in ("ppl", "loss"):
            v = _num(r.get(k))
            if v is not None:
                out[f"{k}/{name}"] = v
    return out


def ruler_values(results: dict) -> dict[str, float]:
    out = {}
    scores = results.get("scores") if isinstance(results, dict) else None
    for task, by_len in (scores or {}).items():
        for length, s in (by_len.items() if isinstance(by_len, dict) else ()):
            v = _num(s)
            if v is not None:
                out[f"ruler/{task}/{length_label(length)}"] = v
    avg = results.get("average") if isinstance(results, dict) else None
    per_len = {length_label(k): _num(v) for k, v in (avg or {}).items()}
    per_len = {k: v for k, v in per_len.items() if v is not None}
    for k, v in per_len.items():
        out[f"ruler/{k}"] = v
    if per_len:
        out["ruler_avg"] = sum(per_len.values()) / len(per_len)
    return out


def lm_eval_values(results: dict) -> dict[str, float]:
    flat: dict[tuple[str, str], float] = {}
    for task, metrics in (results.items() if isinstance(results, dict) else ()):
        for name, value in (metrics.items() if isinstance(metrics, dict) else ()):
            metric, _, filt = str(name).partition(",")
            v = _num(value)
            if v is None or metric.endswith("_stderr") or filt not in ("", "none"):
                continue
            flat[(task, metric)] = v
    out = {}
    for column, task, metric, scale in LM_EVAL_COLUMNS:
        if (task, metric) in flat:
            out[column] = scale * flat.pop((task, metric))
    if all(c in out for c in CSR_COLUMNS):
        out["csr_avg"] = sum(out[c] for c in CSR_COLUMNS) / len(CSR_COLUMNS)
    for (task, metric), v in flat.items():
        out[f"lm_eval/{task}/{metric}"] = v
    return out


def synthetic_values(results: dict) -> dict[str, float]:
    if not isinstance(results, dict) or not isinstance(results.get("label"), str) or "/" in results["label"]:
        return {}  # a label is a task or source name: never a path
    key, out = results["label"], {}
    for name in ("accuracy", "token_accuracy"):
        v = _num(results.get(name))
        if v is not None:
            out[f"synthetic/{key}/{name}"] = 100.0 * v
    span = results.get("span") if isinstance(results.get("span"), dict) else {}
    layers = span.get("layer_ids") if isinstance(span.get("layer_ids"), list) else []
    for where in ("far", "all"):
        ratios = (span.get(where) or {}).get("layer_ratio") if isinstance(span.get(where), dict) else None
        for layer, r in zip(layers, ratios if isinstance(ratios, list) else []):
            v = _num(r)
            if v is not None and isinstance(layer, int):
                out[f"span/{key}/{where}/{layer}"] = v
    return out


def eval_values(evals: dict[str, dict]) -> dict[str, float]:
    """All report values of one run's eval/*.json files (`read_evals`: each with its "kind")."""
    out = {}
    readers = {"perplexity": perplexity_values, "ruler": ruler_values, "lm_eval": lm_eval_values,
               "synthetic": synthetic_values}
    for data in evals.values():
        out.update(readers[data["kind"]](data["results"]))
    return out
