"""GPU smoke check of the model: every attention kind, bf16 autocast, forward+backward timings.

Run on a CUDA machine: python benchmarks/model_smoke_gpu.py [--size 200m] [--seq 2048]
"""
import argparse
import time

import torch

from logo.config import AttentionConfig, model_config
from logo.model import BudgetController, Transformer
from logo.model.flops import param_counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="200m")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for kind in ["full", "local", "inter_layer", "intra_layer", "logo"]:
        torch.manual_seed(0)
        cfg = model_config(args.size, attention=AttentionConfig(kind=kind))
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device="cuda")
        model.init_weights()
        ctrl = BudgetController(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device="cuda")
        times = []
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            (loss + out.aux_loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ctrl.accumulate(out.routing)
            ctrl.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        m = ctrl.metrics()
        print(f"{kind:12s} params={param_counts(model)[0]/1e6:.1f}M loss={loss.item():.3f} "
              f"step={sorted(times)[len(times)//2]*1e3:.0f}ms ratio={m.get('logo/ratio_mean', float('nan')):.3f} "
              f"mem={torch.cuda.max_memory_allocated()/2**30:.1f}GiB", flush=True)
        del model, opt, out, loss
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
