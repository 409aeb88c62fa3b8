"""One rank of the tensor-parallel check on GPUs (`tests/test_multigpu.py`; run under torchrun, 2 processes).

For each case (attention preset, kernel backend, compiled or eager blocks, activation checkpointing) a small model
takes one forward and backward under `parallelize`'s tensor + sequence parallel plan with bf16 autocast (what
train.py runs without FSDP), and the same model on this rank's GPU alone, from the same weights and batch. Rank 0
appends one JSON line per case to --out: the loss of each, the largest relative gradient error over the parameters
(||g_tp - g_one|| / ||g_one||), whether both tp ranks routed the same tokens, and the error's last lines when the case
raised. A case that raises on one rank raises on both (the same code on the same data), so the loop goes on.

    torchrun --standalone --nproc_per_node=2 tests/multigpu_tp_worker.py --out /tmp/tp.jsonl \\
        --attention logo full --backend triton --compile off on --ac off on
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from logo.model import Transformer  # noqa: E402
from logo.parallel import ParallelDims, parallelize  # noqa: E402
from logo.run.config import compose  # noqa: E402

B, T, VOCAB = 2, int(os.environ.get("TP_CHECK_SEQ", 1024)), 4096


def model_config(attention: str, backend: str):
    """The `small` size (head dim 64) cut to 2 layers, the preset's attention, gates spread out so both branches
    carry tokens."""
    cfg, _, _ = compose(["model=small", f"attention={attention}", "model.n_layers=2", f"model.vocab_size={VOCAB}",
                         f"attention.backend={backend}", "attention.window=64", "attention.gate_init_std=0.5"])
    return cfg.model


def build(attention: str, backend: str, device) -> Transformer:
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(model_config(attention, backend))
        model.init_weights()
    return model


def batch(device):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    cu = torch.tensor([0, T // 3, T, T + T // 2, 2 * T], dtype=torch.int32)  # documents in both rows
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device), cu.to(device)


def step(model, inputs, labels, cu):
    """Loss (fp32) and routing stats of one forward + backward under bf16 autocast."""
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16):
        out = model(inputs, cu_seqlens=cu)
    loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten())
    (loss + out.aux_loss).backward()
    return loss.detach(), out.routing


def grads(model) -> dict:
    return {n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""):
            (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
            for n, p in model.named_parameters() if p.grad is not None}


def run_case(attention: str, backend: str, compiled: bool, ac: bool, tp_mesh, device) -> dict:
    inputs, labels, cu = batch(device)
    one = build(attention, backend, device)
    loss_one, routing_one = step(one, inputs, labels, cu)
    g_one = grads(one)
    model = build(attention, backend, device)
    parallelize(model, None, torch.float32, activation_checkpointing=ac, compile_blocks=compiled, tp_mesh=tp_mesh)
    loss_tp, routing = step(model, inputs, labels, cu)
    g_tp = grads(model)
    missing = sorted(set(g_one) - set(g_tp))
    errs = {n: float((g_tp[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in g_one.items() if n in g_tp}
    gates = {n: e for n, e in errs.items() if n.endswith("gate.weight")}
    errs = {n: e for n, e in errs.items() if n not in gates}
    worst = max(errs, key=errs.get)
    same_ranks = True
    if routing is not None:
        gathered = [torch.empty_like(routing) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, routing.contiguous())
        same_ranks = all(torch.equal(gathered[0][:, :2], r[:, :2]) for r in gathered)
    out = {"loss_one": float(loss_one), "loss_tp": float(loss_tp), "grad_err_max": errs[worst], "worst": worst,
           "gate_grad_err_max": max(gates.values(), default=0.0),
           "missing_grads": missing, "routing_same_on_tp_ranks": same_ranks}
    if routing is not None:  # selected tokens per layer, tp against one GPU
        out["selected_tp"] = routing[:, 0].tolist()
        out["selected_one"] = routing_one[:, 0].tolist()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--attention", nargs="+", required=True, help="attention presets (conf/attention)")
    ap.add_argument("--backend", nargs="+", default=["auto"])
    ap.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"])
    ap.add_argument("--ac", nargs="+", default=["off"], choices=["off", "on"])
    args = ap.parse_args()
    cuda = torch.cuda.is_available()  # CPU (gloo): only to try the script itself
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dims = ParallelDims.build(dist.get_world_size(), dist.get_world_size(), 1, device.type)
    for attention, backend, comp, ac in itertools.product(args.attention, args.backend, args.compile, args.ac):
        case = {"attention": attention, "backend": backend, "compile": comp == "on", "ac": ac == "on"}
        try:
            case.update(run_case(attention, backend, comp == "on", ac == "on", dims.submesh("tp"), device))
            case["ok"] = True
        except Exception as e:  # noqa: BLE001 - recorded, and the next case runs
            case.update(ok=False, error=f"{type(e).__name__}: {e}"[:500],
                        where=traceback.format_exc().strip().splitlines()[-6:])
        torch._dynamo.reset()
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(case) + "\n")
            status = "ok" if case["ok"] else f"FAILED {case['error'][:160]}"
            print(f"{attention:24} {backend:8} compile={comp:3} ac={ac:3} {status}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
