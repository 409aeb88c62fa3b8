"""The evaluations of one run of a study (`python -m launch.study`), in one process: `python -m logo.eval`'s
commands called one after another, so the interpreter, torch and CUDA start and the checkpoint is loaded once per
run, not once per command.

    python -m launch.study_eval RUN_DIR [--size mini|tiny]

What is evaluated follows from the run's config.yaml: held-out perplexity (the mixture's first corpus), the
accuracy on held-out episodes of every synthetic source of its mixture, and the 8 RULER needle tasks at its
context (`stage.seq_len`; mini also at half of it); how much of each follows from --size (EVALS; tiny: 2 RULER
tasks). Each command is printed as `== python -m logo.eval ...` before it runs, so the log names the step that
failed; the first failure ends the process with that command's exit code (2: a bad input, one line
`error: ...`). Ctrl-C: one line, 130. When every command has succeeded, `<run>/study_eval_<size>.json` records the
checkpoint and the commands; a run whose newest checkpoint was already evaluated with the same commands is not
evaluated again (a study that is run again after an interruption picks up where it stopped).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's logo package, as train.py (run from ROOT) uses it


@dataclass(frozen=True)
class EvalSizes:
    ppl_tokens: int  # held-out tokens for perplexity
    ppl_batch: int
    episodes: int  # held-out episodes per synthetic source
    episode_batch: int
    ruler_samples: int  # prompts per RULER task and length
    ruler_batch: int
    ruler_new_tokens: int
    ruler_tasks: str  # "" = all 8
    ruler_fractions: tuple  # RULER lengths as fractions of the trained context


EVALS = {
    "mini": EvalSizes(ppl_tokens=262144, ppl_batch=8, episodes=128, episode_batch=16, ruler_samples=25,
                      ruler_batch=25, ruler_new_tokens=64, ruler_tasks="", ruler_fractions=(0.5, 1.0)),
    # tiny: two RULER tasks (one needle, several keys), one prompt each: the CPU's token-by-token decoding is slow
    "tiny": EvalSizes(ppl_tokens=1024, ppl_batch=4, episodes=4, episode_batch=4, ruler_samples=1, ruler_batch=2,
                      ruler_new_tokens=4, ruler_tasks="s_niah_1,mk_niah_1", ruler_fractions=(1.0,)),
}


def ruler_lengths(seq_len: int, fractions: tuple) -> list[int]:
    """RULER prompt lengths: the given fractions of the trained context."""
    return sorted({int(seq_len * f) for f in fractions})


def eval_commands(run_dir: str, cfg, size: str) -> list[list[str]]:
    """`python -m logo.eval` argument lists for one run (cfg: its validated Config)."""
    e = EVALS[size]
    common = ["--no-progress"]
    cmds = [["perplexity", run_dir, "--tokens", str(e.ppl_tokens), "--batch-size", str(e.ppl_batch), *common]]
    for src in cfg.data.sources if cfg.data.kind == "mix" else []:
        if src.kind == "synthetic":
            cmds.append(["synthetic", run_dir, "--source", src.name, "--episodes", str(e.episodes),
                         "--batch-size", str(e.episode_batch), *common])
    lengths = ",".join(map(str, ruler_lengths(cfg.stage.seq_len, e.ruler_fractions)))
    ruler = ["ruler", run_dir, "--lengths", lengths, "--samples", str(e.ruler_samples), "--batch-size",
             str(e.ruler_batch), "--max-new-tokens", str(e.ruler_new_tokens), *common]
    cmds.append(ruler + (["--tasks", e.ruler_tasks] if e.ruler_tasks else []))
    return cmds


def done_marker(run_dir: Path, size: str) -> Path:
    return run_dir / f"study_eval_{size}.json"


def already_done(marker: Path, checkpoint: Path, cmds: list) -> bool:
    """The marker records this checkpoint and these commands."""
    from data.format import DataError, read_json
    try:
        rec = read_json(marker, "study evaluation record")
    except DataError:
        return False
    return rec.get("checkpoint") == str(checkpoint) and rec.get("commands") == cmds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.study_eval", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--size", choices=sorted(EVALS), default="mini")
    a = ap.parse_args(argv)
    from data.outputs import INTERRUPTED, one_line
    from logo.config import ConfigError
    from logo.eval.__main__ import main as eval_main
    from data.format import atomic_write_json
    from logo.run.checkpoint import CheckpointError, resolve_checkpoint
    from logo.run.load import run_config

    run_dir = Path(a.run_dir)
    try:
        cmds = eval_commands(a.run_dir, run_config(run_dir), a.size)
        checkpoint = resolve_checkpoint(run_dir, verify_files=False)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    marker = done_marker(run_dir, a.size)
    if already_done(marker, checkpoint, cmds):
        print(f"== {checkpoint} was already evaluated ({marker}): nothing to do", flush=True)
        return 0
    models: dict = {}  # the checkpoint is loaded by the first command and reused by the others
    for cmd in cmds:
        print(f"== python -m logo.eval {' '.join(cmd)}", flush=True)
        try:
            rc = eval_main(cmd, models=models)
        except KeyboardInterrupt:
            print(f"interrupted during {cmd[0]}", file=sys.stderr)
            return INTERRUPTED
        sys.stdout.flush()
        if rc != 0:
            print(f"== {cmd[0]} failed (exit code {rc})", flush=True)
            return rc
    # the checkpoint the commands loaded: an older one than `checkpoint` when the newest does not verify
    (loaded,) = models.values()
    atomic_write_json(marker, {"checkpoint": str(loaded.checkpoint), "commands": cmds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
