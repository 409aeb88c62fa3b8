"""python -m logo.export PATH --out DIR [--dtype bf16|fp32] [--force]

PATH: a run directory (its latest complete checkpoint), a checkpoints/step_N folder or an exported folder.
Errors (missing or incomplete checkpoint, non-empty output folder, ...) are one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m logo.export", description=__doc__.splitlines()[0])
    ap.add_argument("path", help="run directory, checkpoints/step_N folder or exported folder")
    ap.add_argument("--out", required=True, help="output folder (written to a temporary folder, renamed at the end)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weight dtype (default bf16)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    a = ap.parse_args(argv)
    from logo.config import ConfigError
    from logo.export import export
    from logo.train.checkpoint import CheckpointError
    try:
        out = export(a.path, a.out, dtype=a.dtype, force=a.force)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {a.path} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
