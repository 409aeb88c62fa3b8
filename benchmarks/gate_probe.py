"""Watch LoGo's gate learn (or not) which tokens need far context: key retrieval on the CPU, in minutes.

    python benchmarks/gate_probe.py                                   # LoGo rho 0.5, one layer, 600 steps
    python benchmarks/gate_probe.py --layers 2 --steps 1000 --pmask-fraction 0.5
    python benchmarks/gate_probe.py --kind full                       # the same task with full attention
    python benchmarks/gate_probe.py --rho 1.0 --out /tmp/probe.json   # every token global
    python benchmarks/gate_probe.py --task copy --layers 2 --rho 1.0 --steps 400   # copying (an induction head)

The tasks (--task), a 64-token vocabulary:
- key: each sequence of --seq-len tokens starts with a key (one of 16 tokens), then random filler, and every 14
  tokens (jittered by 0-2) a marker token whose next token is the key again. The window (--window, default 8)
  cannot reach the key or the previous marker's answer, so only global attention answers it. The filler is
  unpredictable (its loss cannot fall below log 47).
- copy: a random span of --seq-len / 2 tokens, then the same span again; the "markers" are the second span's
  positions whose next token is a copy (found by looking up the current token's earlier occurrence and reading
  what followed it: an induction head, which needs two layers). The window cannot reach the first span.

Printed every --log-every steps, for the first LoGo layer: the threshold b, the mean gate p over all tokens and at
the markers, and the accuracy at the markers on that step's batch. At the end, on 64 held-out sequences: the
accuracy at the markers and each LoGo layer's share of markers and of all tokens routed global.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from logo.analysis.span_allocation import record_routing  # noqa: E402
from logo.config import AttentionConfig, ConfigError, model_config  # noqa: E402
from logo.model import BudgetController, Transformer  # noqa: E402
from logo.train.step import lm_loss_sum  # noqa: E402

VOCAB, KEYS, MARKER, FILLER_START = 64, 16, 16, 17
MARKER_EVERY = 14


def sequences(gen: torch.Generator, n: int, seq_len: int):
    """inputs (n, T), labels (n, T) and the marker positions (n, M): each marker's label is the row's key."""
    x = torch.randint(FILLER_START, VOCAB, (n, seq_len + 1), generator=gen)
    key = torch.randint(0, KEYS, (n,), generator=gen)
    x[:, 0] = key
    rows, marks = torch.arange(n), []
    for start in range(12, seq_len - 8, MARKER_EVERY):
        pos = start + torch.randint(0, 3, (n,), generator=gen)
        x[rows, pos] = MARKER
        x[rows, pos + 1] = key
        marks.append(pos)
    return x[:, :seq_len], x[:, 1:], torch.stack(marks, 1)


def copy_sequences(gen: torch.Generator, n: int, seq_len: int):
    """inputs (n, T), labels (n, T) and the marker positions (n, M): a span of T / 2 random tokens twice; the markers
    are the second span's positions T/2 .. T-2, each labelled with the token that followed its first occurrence."""
    half = seq_len // 2
    span = torch.randint(0, VOCAB, (n, half), generator=gen)
    x = torch.cat((span, span, torch.randint(0, VOCAB, (n, 1), generator=gen)), 1)  # (n, T + 1)
    marks = torch.arange(half, seq_len - 1).expand(n, -1)
    return x[:, :seq_len], x[:, 1:], marks


TASKS = {"key": sequences, "copy": copy_sequences}


def marker_accuracy(logits: torch.Tensor, labels: torch.Tensor, marks: torch.Tensor) -> float:
    """Share of the markers (B, M) whose label (the key, or the copied token) is the argmax of logits (B, T, V)."""
    rows = torch.arange(marks.shape[0])[:, None]
    return (logits.argmax(-1)[rows, marks] == labels[rows, marks]).float().mean().item()


def build(args):
    attn = AttentionConfig(kind=args.kind, rho=args.rho, window=args.window, gamma=args.gamma,
                           budget_control=args.control)
    attn.threshold_init = attn.pmask_threshold_init(int(args.pmask_fraction * args.steps))
    cfg = model_config("tiny", vocab_size=VOCAB, n_layers=args.layers, dim=64, n_heads=2, attention=attn)
    model = Transformer(cfg)
    model.init_weights()
    return model


def first_layer_gate(model, x) -> torch.Tensor:
    """The first LoGo layer's gate p (B, T) for inputs x (first layer only: its input is the embedding)."""
    block = model.layers[str(model.logo_layer_ids[0])]
    return block.attention.gate_probs(block.attention_norm(model.tok_embeddings(x))).view(x.shape)


def train(args) -> dict:
    torch.manual_seed(args.seed)
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ctrl = BudgetController(model)
    logo = bool(model.logo_layer_ids)
    gen, log, t0 = torch.Generator().manual_seed(args.seed), [], time.time()
    for step in range(args.steps):
        x, y, marks = TASKS[args.task](gen, args.batch, args.seq_len)
        out = model(x)
        if logo and step % args.log_every == 0:
            with torch.no_grad():
                p, rows = first_layer_gate(model, x), torch.arange(x.shape[0])[:, None]
                rec = {"step": step, "threshold": model.layers[str(model.logo_layer_ids[0])].attention.threshold.item(),
                       "p_all": p.mean().item(), "p_marker": p[rows, marks].mean().item(),
                       "acc_marker": marker_accuracy(out.logits, y, marks)}
            log.append(rec)
            print(f"step {step:5d} | b {rec['threshold']:+.3f} | p all {rec['p_all']:.3f} | p at markers "
                  f"{rec['p_marker']:.3f} | accuracy at markers {rec['acc_marker']:.2f}", flush=True)
        loss = lm_loss_sum(out.logits, y) / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if logo:
            ctrl.accumulate(out.routing.detach())
            ctrl.step()
    return {"args": vars(args), "log": log, "final_loss": loss.item(), "seconds": time.time() - t0,
            **held_out(model, args.task, args.seq_len)}


@torch.no_grad()
def held_out(model, task: str, seq_len: int) -> dict:
    x, y, marks = TASKS[task](torch.Generator().manual_seed(1234), 64, seq_len)
    rows = torch.arange(64)[:, None]
    res = {"accuracy_at_markers": marker_accuracy(model(x).logits, y, marks)}
    if model.logo_layer_ids:
        z = record_routing(model, x).float()  # (L_logo, B, T)
        res["global_at_markers"] = z[:, rows, marks].mean((1, 2)).tolist()
        res["global_overall"] = z.mean((1, 2)).tolist()
    return res


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    ap = _Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="key", choices=sorted(TASKS), help="key retrieval or copying (see above)")
    ap.add_argument("--kind", default="logo", help="attention.kind (logo, full, intra_layer, ...)")
    ap.add_argument("--rho", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--pmask-fraction", type=float, default=0.2)
    ap.add_argument("--control", default="quantile", help="attention.budget_control")
    ap.add_argument("--gamma", type=float, default=0.01, help="the P-mask ramp's rate (and the sign rule's step)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the log and the held-out figures as JSON")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.seq_len < 40 or args.log_every < 1 or not 0 <= args.pmask_fraction < 1:
        ap.error("--steps and --log-every must be >= 1, --seq-len >= 40, --pmask-fraction in [0, 1)")
    if args.task == "copy" and (args.seq_len % 2 or args.window >= args.seq_len // 2):
        ap.error(f"--task copy: --seq-len {args.seq_len} must be even and --window {args.window} below half of it")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        build(args)  # the config's own one-line checks
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = train(args)
    summary = {k: res[k] for k in ("accuracy_at_markers", "global_at_markers", "global_overall") if k in res}
    print("held out:", json.dumps({k: [round(v, 3) for v in x] if isinstance(x, list) else round(x, 3)
                                   for k, x in summary.items()}))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
