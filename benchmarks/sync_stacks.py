"""Where a training step waits for the GPU: train.py's own loop in this process, with CUDA's sync debug mode on for
the steps after --warmup; every synchronising torch call (`.item()`, `.tolist()`, a blocking copy, `torch.equal`
on the device, ...) is counted with its Python stack (the frames of this project and of the attention and loss
libraries). Each such call empties the GPU's queue: the host then waits, and the GPU idles while the host issues
the next kernels. `benchmarks/profile_step.py` counts the syncs per phase; this names them.

    python benchmarks/sync_stacks.py --warmup 2 --steps 3 -- model=mini attention=logo stage=mini_2k train.compile=true

Calls made outside torch (a library's own cudaMemcpy) are not seen; stacks without a frame of ours come from
autograd's backward thread. The run's own reads at logging steps count too: pick a logging interval past the
recorded steps to leave them out. Under torchrun every rank does the same (replicated data parallelism: skip
DDP's first ten iterations, which it times with syncs: --warmup 11). Prints the stacks, most frequent first, and
writes --out as JSON if given (one file per rank under torchrun).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LIBRARIES = ("flash_attn", "liger_kernel")  # besides this repository's own frames, the ones worth naming


def _ours(filename: str) -> bool:
    return (filename.startswith(str(ROOT)) and "site-packages" not in filename) or any(k in filename for k in LIBRARIES)


class SyncStacks:
    """A `warnings.showwarning` that counts the stacks of CUDA's sync debug warnings (other warnings pass on)."""

    def __init__(self, depth: int = 8):
        self.depth = depth
        self.counts: collections.Counter = collections.Counter()
        self._show = warnings.showwarning

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message).lower():
            return self._show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if _ours(f.filename)]
        names = [f"{os.path.relpath(f.filename, ROOT) if str(ROOT) in f.filename else os.path.basename(f.filename)}"
                 f":{f.lineno} {f.name}" for f in frames[-self.depth:]]
        self.counts[" <- ".join(reversed(names)) or "(no frame of ours: the backward's thread)"] += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=2, help="steps before the sync debug mode (compilation)")
    ap.add_argument("--steps", type=int, default=3, help="steps with it on")
    ap.add_argument("--out", help="write the stacks and counts here (JSON)")
    ap.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        ap.error(f"--warmup must be >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    import torch

    from data.format import DataError
    from logo.config import ConfigError
    from logo.run.checkpoint import CheckpointError
    from logo.run.config import compose
    from logo.train.trainer import TrainingDiverged, train

    total = args.warmup + args.steps + 1  # + one last step, whose end (the run's final read) is left out
    try:
        cfg, resolved, attention = compose(["eval.interval=0", f"logging.interval={10 ** 9}", *args.overrides,
                                            f"train.steps={total}", "logging.progress_bar=false",
                                            "checkpoint.enable=false", "checkpoint.resume=false",
                                            f"run.dir={Path(args.out or '/tmp/sync_stacks').with_suffix('')}_run"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or cfg.parallel.device == "cpu":
        print("error: sync_stacks.py needs a CUDA device (the sync debug mode is CUDA's)", file=sys.stderr)
        return 2
    stacks = SyncStacks()
    warnings.showwarning = stacks
    warnings.simplefilter("always")

    def on_step_end(step: int) -> None:
        if step == args.warmup:
            torch.cuda.set_sync_debug_mode("warn")
        if step == total - 1:
            torch.cuda.set_sync_debug_mode("default")
    if args.warmup == 0:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        train(cfg, resolved, attention, on_step_end=on_step_end, save_final=False)
    except (ConfigError, DataError, CheckpointError, TrainingDiverged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows = [{"count": n, "per_step": n / args.steps, "stack": s} for s, n in stacks.counts.most_common()]
    print(f"synchronising torch calls in {args.steps} steps: {sum(r['count'] for r in rows)}")
    for r in rows:
        print(f"{r['per_step']:6.2f}/step  {r['stack']}")
    if args.out:
        out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one file per rank
            out = out.with_name(f"{out.stem}_rank{rank}{out.suffix}")
        out.write_text(json.dumps({"overrides": args.overrides, "rank": rank, "steps": args.steps, "stacks": rows},
                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
