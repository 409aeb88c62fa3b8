"""Fabricated run directories for the report tests: the files train.py writes, with chosen values."""
import json
from pathlib import Path

import yaml

ATTENTION = dict(kind="logo", window=128, global_fraction=0.5, layer_pattern="", global_layer="full", rho=0.5,
                 transform="lp", context_norm=True, fusion="weighted", budget_control="threshold", gamma=0.0005,
                 pmask=True, pmask_fraction=0.2, threshold_init=None, backend="auto")


def make_run(root: Path, name: str, *, losses, size="200m", dim=768, n_layers=12, kind="full", experiment="",
             stage="pretrain_8k", seed=0, params=240_000_000, non_emb=85_000_000, flops_per_token=1.5e9,
             batch_tokens=524_288, steps=None, interval=1, ratios=None, evals=None, world_size=8,
             tokens_per_s=1e6, attention=None, budget=None) -> Path:
    """A run directory whose metrics.jsonl logs `losses` every `interval` steps (the last at `steps`, default
    len(losses) * interval); `ratios`: per-layer realized ratio logged with every record; `evals`: {kind: results}."""
    d = Path(root) / name
    d.mkdir(parents=True)
    att = {**ATTENTION, "kind": kind, **(attention or {})}
    cfg = {"model": {"name": size, "dim": dim, "n_layers": n_layers, "n_heads": 12, "vocab_size": 100277},
           "attention": att, "stage": {"name": stage, "seq_len": 8192, "tokens_per_param": 20.0},
           "train": {"steps": 0, "seed": seed}, "data": {"kind": "shards", "path": f"/data/{name}", "seed": seed},
           "checkpoint": {"init_from": ""}, "run": {"name": "", "dir": str(d)}, "experiment": experiment,
           "dry_run": False}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    n = len(losses)
    last = steps if steps is not None else n * interval
    plan = {"run_name": name, "run_dir": str(d), "world_size": world_size, "params_total": params,
            "params_non_embedding": non_emb, "seq_len": 8192, "global_batch_tokens": batch_tokens, "steps": last,
            "attention_budget": budget if budget is not None else (1.0 if kind == "full" else att["rho"]),
            "attention_flops_per_token": 1e8, "train_flops_per_token": flops_per_token}
    (d / "plan.json").write_text(json.dumps(plan))
    lines = []
    for i, loss in enumerate(losses):
        step = last - (n - 1 - i) * interval
        rec = {"step": step, "loss": loss, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": tokens_per_s,
               "tokens": step * batch_tokens}
        for layer, r in enumerate(ratios or []):
            rec[f"logo/ratio/layer_{layer}"] = r
        lines.append(json.dumps(rec))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (d / "final_metrics.json").write_text(json.dumps(json.loads(lines[-1])))
    for kind_, results in (evals or {}).items():
        (d / "eval").mkdir(exist_ok=True)
        (d / "eval" / f"{kind_}.json").write_text(json.dumps(
            {"kind": kind_, "checkpoint": str(d / "checkpoints" / f"step_{last:08d}"), "step": last,
             "created": "2025-01-01T00:00:00", "results": results}))
    return d
