"""Decode throughput and KV-cache memory: LoGo (global skip) vs full attention, at long contexts (GPU).

    python benchmarks/decode.py                                   # 1.5b, full vs logo, 8k and 32k, batch 1 and 8
    python benchmarks/decode.py --model tiny --device cpu --contexts 256 --new-tokens 8 --batches 1   # smoke

For each attention kind, context length C and batch size B: random-weight model (bf16 weights on GPU, LoGo
thresholds kept fp32), B random prompts of C tokens, prefill with the training kernels, `--warmup` decode
steps, then `--new-tokens` timed greedy steps through `logo.eval.decode.Decoder`. Reported: prefill seconds,
decode tokens/s (B x steps / time) and ms per step, cache GiB (the K/V tensors: dense caches + ring
buffers), peak GPU memory, and for LoGo the realized global fraction of decode rows and the fraction of
(layer, step) pairs whose global call was skipped. Kinds `logo_all_local` / `logo_all_global` force the
threshold (every token local / global) and bracket what routing can save. With random weights the LoGo gate
routes about half the tokens (p ~ 0.5 around b = 0.5); pass `--checkpoint` for a trained model's routing.
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
    "inter_layer_logo": dict(kind="inter_layer", global_fraction=0.5, global_layer="logo"),
}
FORCED = {"logo_all_local": 2.0, "logo_all_global": -1.0}


def build(args, kind: str, device: torch.device) -> Transformer:
    if args.checkpoint:
        from logo.eval.load import load_model
        model = load_model(args.checkpoint, str(device), "fp32").model
    else:
        torch.manual_seed(0)
        cfg = model_config(args.model, attention=AttentionConfig(window=args.window, **KINDS[kind]))
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device=device)
        model.init_weights()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model.to(dtype).eval()
    for layer in model.logo_layers():  # the threshold stays fp32, as in training
        layer.threshold.data = layer.threshold.data.float()
        if kind in FORCED:
            layer.threshold.fill_(FORCED[kind])
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def measure(model, device, context: int, batch: int, new_tokens: int, warmup: int) -> dict:
    vocab = model.cfg.vocab_size
    prompts = torch.randint(0, vocab, (batch, context)).tolist()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dec = Decoder(model, context + warmup + new_tokens + 1)
    sync(device)
    t0 = time.perf_counter()
    logits = dec.prefill(prompts)
    sync(device)
    prefill_s = time.perf_counter() - t0
    for _ in range(warmup):
        logits = dec.step(logits[:, :vocab].argmax(-1))
    sync(device)
    before = dec.stats.as_dict()
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        logits = dec.step(logits[:, :vocab].argmax(-1))
    sync(device)
    dt = time.perf_counter() - t0
    s = {k: dec.stats.as_dict()[k] - before[k] for k in ("rows", "selected", "layer_steps", "skipped")}
    out = {"context": context, "batch": batch, "new_tokens": new_tokens, "prefill_s": prefill_s,
           "decode_tokens_per_s": batch * new_tokens / dt, "ms_per_step": 1e3 * dt / new_tokens,
           "cache_gib": dec.cache_bytes / 2**30}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if s["layer_steps"]:
        out["global_fraction"] = s["selected"] / max(s["rows"], 1)
        out["skipped_fraction"] = s["skipped"] / s["layer_steps"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.5b", help="a named size (tiny, small, 200m, ..., 1.5b, 3.3b)")
    ap.add_argument("--checkpoint", default=None, help="a trained run/checkpoint instead of random weights "
                                                       "(its own attention kind; --kinds is ignored)")
    ap.add_argument("--kinds", default="full,logo,logo_all_local,logo_all_global")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--window", type=int, default=512, help="local window (the paper's LoGo/hybrid runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bf16 (GPU default) | fp32 (CPU default)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    kinds = ["checkpoint"] if args.checkpoint else args.kinds.split(",")
    rows = []
    for kind in kinds:
        if kind != "checkpoint" and kind not in KINDS:
            print(f"error: unknown kind {kind!r}; choose from {list(KINDS)}", file=sys.stderr)
            return 2
        model = build(args, kind, device)
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                try:
                    r = {"kind": kind, **measure(model, device, context, batch, args.new_tokens, args.warmup)}
                except torch.cuda.OutOfMemoryError:
                    rows.append({"kind": kind, "context": context, "batch": batch, "oom": True})
                    print(f"{kind:>16} ctx {context:>6} B {batch:>2}: out of memory", flush=True)
                    torch.cuda.empty_cache()
                    continue
                rows.append(r)
                extra = (f"  global {r['global_fraction']:.2f} skipped {r['skipped_fraction']:.2f}"
                         if "global_fraction" in r else "")
                print(f"{kind:>16} ctx {context:>6} B {batch:>2}: prefill {r['prefill_s']:7.2f}s  decode "
                      f"{r['decode_tokens_per_s']:8.1f} tok/s ({r['ms_per_step']:6.2f} ms/step)  cache "
                      f"{r['cache_gib']:7.3f} GiB{extra}", flush=True)
        del model
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "model": args.checkpoint or args.model, "dtype": args.dtype, "window": args.window, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
