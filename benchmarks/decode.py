"""Decode speed and KV-cache memory per attention kind at long contexts, with transformers' generate as the anchor.

    python benchmarks/decode.py                                   # 1.5b, full vs logo, 8k and 32k, batch 1 and 8
    python benchmarks/decode.py --model tiny --device cpu --contexts 256 --new-tokens 8 --batches 1   # smoke

For each attention kind, context length C and batch size B: a random-weight model (bf16 on GPU; LoGo thresholds
fp32), B random prompts of C tokens, prefill with the training kernels, `--warmup` decode steps (the first runs
eagerly, the second records the CUDA graph), then `--new-tokens` timed greedy steps through
`logo.eval.decode.Decoder` (argmax on the device: no host synchronisation between steps). Reported: prefill
seconds, warm-up seconds (compiling and recording the step), ms per step and tokens/s (B x steps / time), cache
GiB (dense caches + ring buffers), peak GPU memory, and for LoGo the realized global fraction of decode rows and
the fraction of (layer, step) pairs where no row was routed global (the global kernel did no work). Kinds
`logo_all_local` / `logo_all_global` force the threshold and bracket what routing can change. Random weights
route about half the tokens (p ~ 0.5 around b = 0.5); pass `--checkpoint` for a trained model's routing.

The anchor (`--anchor transformers`, on by default on GPU): the full-attention model's weights mapped to
`LlamaForCausalLM` by the exporter's converter (`logo.run.hf_layout.to_hf`), the same prompts, greedy
`generate` with its default cache; ms per step = (time for 1 + N new tokens - time for 1) / N, each the
fastest of 3 runs.

`--ruler N`: also a RULER run per kind and context (`logo.eval.ruler.run_ruler`: every task, N samples each, the
largest of `--batches` prompts at a time, up to 64 new tokens), its wall time from the first prompt to the last
score (random weights rarely stop early, so every kind generates the same number of tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logo.config import AttentionConfig, model_config  # noqa: E402
from logo.eval.decode import Decoder  # noqa: E402
from logo.model import Transformer  # noqa: E402

KINDS = {
    "full": dict(kind="full"),
    "logo": dict(kind="logo"),
    "logo_all_local": dict(kind="logo"),
    "logo_all_global": dict(kind="logo"),
    "local": dict(kind="local"),
    "inter_layer": dict(kind="inter_layer", global_fraction=0.5),
    "intra_layer": dict(kind="intra_layer", global_fraction=0.5),
    "inter_layer_logo": dict(kind="inter_layer", global_fraction=0.5, global_layer="logo"),
}
FORCED = {"logo_all_local": 2.0, "logo_all_global": -1.0}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(args, kind: str, device: torch.device) -> Transformer:
    if args.checkpoint:
        from logo.run.load import load_model
        model = load_model(args.checkpoint, str(device), "fp32").model
    else:
        torch.manual_seed(0)
        cfg = model_config(args.model, attention=AttentionConfig(window=args.window, **KINDS[kind]))
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device=device)
        model.init_weights()
    model.to(DTYPES[args.dtype]).eval()
    for layer in model.logo_layers():  # the threshold stays fp32, as in training
        layer.threshold.data = layer.threshold.data.float()
        if kind in FORCED:
            layer.threshold.fill_(FORCED[kind])
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_memory(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@torch.no_grad()
def measure(model, device, prompts: list, new_tokens: int, warmup: int) -> dict:
    vocab = model.cfg.vocab_size
    reset_memory(device)
    dec = Decoder(model, len(prompts[0]) + warmup + new_tokens + 1)
    sync(device)
    t0 = time.perf_counter()
    logits = dec.prefill(prompts)
    sync(device)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(warmup):
        logits = dec.step(logits[:, :vocab].argmax(-1))
    sync(device)
    warmup_s = time.perf_counter() - t0
    before = dec.read_stats().as_dict()
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        logits = dec.step(logits[:, :vocab].argmax(-1))
    sync(device)
    dt = time.perf_counter() - t0
    after = dec.read_stats().as_dict()
    s = {k: after[k] - before[k] for k in ("rows", "selected", "layer_steps", "skipped")}
    out = {"prefill_s": prefill_s, "warmup_s": warmup_s, "ms_per_step": 1e3 * dt / new_tokens,
           "tokens_per_s": len(prompts) * new_tokens / dt, "cache_gib": dec.cache_bytes / 2**30,
           "cuda_graph": dec.graph is not None}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if s["layer_steps"]:
        out["global_fraction"] = s["selected"] / max(s["rows"], 1)
        out["skipped_fraction"] = s["skipped"] / s["layer_steps"]
    return out


def llama_of(model):
    """The full-attention model as transformers' LlamaForCausalLM (the exporter's weight mapping)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from logo.run.hf_layout import to_hf
    cfg = model.cfg
    hf = LlamaConfig(vocab_size=cfg.padded_vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
                     head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                     max_position_embeddings=1 << 20, tie_word_embeddings=False, hidden_act="silu",
                     attention_bias=False, mlp_bias=False)
    weight = model.tok_embeddings.weight
    with torch.device(weight.device):
        llama = LlamaForCausalLM(hf).to(weight.dtype)
    llama.load_state_dict(to_hf(dict(model.state_dict()), cfg.head_dim))
    return llama.eval()


@torch.no_grad()
def measure_transformers(llama, device, prompts: list, new_tokens: int) -> dict:
    ids = torch.tensor(prompts, device=device)

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    reset_memory(device)
    run(2)  # warm-up
    # the fastest of 3 alternating runs of each length: a difference of two single timings can come out negative
    # on a busy host
    t1, tn = (min(ts) for ts in zip(*((run(1), run(1 + new_tokens)) for _ in range(3))))
    dt = tn - t1
    out = {"prefill_s": t1, "ms_per_step": 1e3 * dt / new_tokens, "tokens_per_s": len(prompts) * new_tokens / dt}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def measure_ruler(model, context: int, samples: int, batch: int, device) -> dict:
    from data.tokenizer import load_tokenizer
    from logo.eval.ruler import TASKS, run_ruler
    sync(device)
    t0 = time.perf_counter()
    run_ruler(model, load_tokenizer("cl100k_base"), [context], list(TASKS), samples, batch)
    sync(device)
    return {"ruler_s": time.perf_counter() - t0, "prompts": samples * len(TASKS)}


def report(kind: str, context: int, batch: int, r: dict) -> None:
    extra = (f"  global {r['global_fraction']:.2f} skipped {r['skipped_fraction']:.2f}"
             if "global_fraction" in r else "")
    cache = f"  cache {r['cache_gib']:7.3f} GiB" if "cache_gib" in r else ""
    print(f"{kind:>16} ctx {context:>6} B {batch:>2}: prefill {r['prefill_s']:7.2f}s  {r['ms_per_step']:7.2f} "
          f"ms/step  {r['tokens_per_s']:8.1f} tok/s{cache}{extra}", flush=True)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.5b", help="a named size (tiny, small, 200m, ..., 1.5b, 3.3b)")
    ap.add_argument("--checkpoint", default=None, help="a trained run/checkpoint instead of random weights "
                                                       "(its own attention kind; --kinds is ignored)")
    ap.add_argument("--kinds", default="full,logo,logo_all_local,logo_all_global")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--window", type=int, default=512, help="local window (the paper's LoGo/hybrid runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="bf16 (GPU default) | fp32 (CPU default)")
    ap.add_argument("--anchor", default=None, choices=["transformers", "none"],
                    help="transformers' generate on the full model (default on GPU when full is measured)")
    ap.add_argument("--ruler", type=int, default=0, metavar="N", help="also time a RULER run of N samples per task")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.anchor = args.anchor or ("transformers" if args.device.startswith("cuda") else "none")
    kinds = ["checkpoint"] if args.checkpoint else args.kinds.split(",")
    bad = [k for k in kinds if k != "checkpoint" and k not in KINDS]
    if bad:
        ap.error(f"unknown kind {bad[0]!r}; choose from {', '.join(KINDS)}")
    return args, kinds


def measure_kind(args, kind: str, device, shapes: list) -> list:
    """Rows for one attention kind: every (context, batch), the anchor beside full attention, RULER's wall time."""
    model = build(args, kind, device)
    vocab, rows = model.cfg.vocab_size, []
    anchor = llama_of(model) if kind == "full" and args.anchor == "transformers" else None
    for context, batch in shapes:
        prompts = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0)).tolist()
        for name in [kind] + (["transformers"] if anchor is not None else []):
            r = {"kind": name, "context": context, "batch": batch}
            try:
                if name == "transformers":
                    r.update(measure_transformers(anchor, device, prompts, args.new_tokens))
                else:
                    r.update(measure(model, device, prompts, args.new_tokens, args.warmup))
            except torch.cuda.OutOfMemoryError:
                r["oom"] = True
                print(f"{name:>16} ctx {context:>6} B {batch:>2}: out of memory", flush=True)
                torch.cuda.empty_cache()
            else:
                report(name, context, batch, r)
            rows.append(r)
    batch = max(b for _, b in shapes)
    for context in sorted({c for c, _ in shapes}) if args.ruler else ():
        r = {"kind": kind, "context": context, "batch": batch,
             **measure_ruler(model, context, args.ruler, batch, device)}
        print(f"{kind:>16} ctx {context:>6}: RULER {r['prompts']} prompts in {r['ruler_s']:.1f}s", flush=True)
        rows.append(r)
    return rows


def main(argv=None) -> int:
    args, kinds = parse(argv)
    device = torch.device(args.device)
    shapes = [(c, b) for c in map(int, args.contexts.split(",")) for b in map(int, args.batches.split(","))]
    rows = [r for kind in kinds for r in measure_kind(args, kind, device, shapes)]
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "model": args.checkpoint or args.model, "dtype": args.dtype, "window": args.window,
            "new_tokens": args.new_tokens, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
