"""python -m logo.export PATH --out DIR [--dtype bf16|fp32] [--force] [--progress|--no-progress]

PATH: a run directory (its latest complete checkpoint), a checkpoints/step_N folder or an exported folder.
Errors (missing or incomplete checkpoint, an output folder that is not an earlier export, a write error, ...)
are one line on stderr, exit code 2; Ctrl-C is one line, exit code 130, and leaves the output folder as it was.
A bar on stderr counts the weights written (by default when stderr is a terminal); one summary line on stdout
ends the export.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from data.outputs import INTERRUPTED, one_line
from logo.config import ConfigError
from logo.export import export
from logo.run.checkpoint import CheckpointError


def size_text(n: int) -> str:
    """Bytes as 812 B, 51.1 MiB, 2.98 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def summary(source: str, out: Path, dtype: str, seconds: float) -> str:
    """One line: what was exported where, the folder's files and size, the weights' share, the time taken."""
    files = sorted(p for p in out.iterdir() if p.is_file())
    weights = [p for p in files if p.suffix == ".safetensors"]
    total = sum(p.stat().st_size for p in files)
    weight_bytes = sum(p.stat().st_size for p in weights)
    shards = weights[0].name if len(weights) == 1 else f"{len(weights)} shards"
    return (f"exported {source} -> {out}: {len(files)} files, {size_text(total)} (weights {shards}, {dtype}, "
            f"{size_text(weight_bytes)}) in {seconds:.1f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m logo.export", description=__doc__.splitlines()[0])
    ap.add_argument("path", help="run directory, checkpoints/step_N folder or exported folder")
    ap.add_argument("--out", required=True, help="output folder (written to a temporary folder, renamed at the end)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weight dtype (default bf16)")
    ap.add_argument("--force", action="store_true",
                    help="replace an earlier export (never a folder holding anything else)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="a bar on stderr while the weights are written (default: only when stderr is a terminal)")
    a = ap.parse_args(argv)
    start = time.perf_counter()
    try:
        out = export(a.path, a.out, dtype=a.dtype, force=a.force, progress=a.progress)
    except (ConfigError, CheckpointError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: nothing was exported ({a.out} is as it was)", file=sys.stderr)
        return INTERRUPTED
    print(summary(a.path, out, a.dtype, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
