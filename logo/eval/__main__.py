"""Evaluate a checkpoint: `python -m logo.eval <what> RUN_DIR_OR_CHECKPOINT [options]`.

    python -m logo.eval perplexity runs/tiny-logo-smoke                         # held-out split, by position
    python -m logo.eval ruler runs/x --lengths 4096,8192 --samples 50           # the 8 RULER needle tasks
    python -m logo.eval synthetic runs/x --task associative_recall --episodes 256  # long-range synthetic accuracy
    python -m logo.eval lm_eval runs/x --tasks hellaswag,piqa                    # lm-evaluation-harness
    python -m logo.eval span runs/x --text wiki.txt code.py --out figs/          # span-allocation PNGs

Results: <run_dir>/eval/{perplexity,ruler,lm_eval,synthetic_<task>}.json and a record in <run_dir>/metrics.jsonl (plus W&B /
TensorBoard when the run logs there); span writes PNGs + span_allocation.json (default <run_dir>/eval/span).
Progress bars go to stderr when it is a terminal (--progress / --no-progress to choose); every command ends
with one line: tokens, seconds, tokens/s and what it wrote. A bad input (missing checkpoint, unknown task, a
length the model cannot take, an --out that is not an earlier span folder, a write error, ...) ends with one line
`error: ...` and exit code 2; Ctrl-C with one line and exit code 130, nothing written. See docs/evaluation.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional

from data.format import DataError
from data.outputs import INTERRUPTED, interrupt_deferred, one_line
from data.tokenizer import TokenizerError, load_tokenizer
from logo.config import ConfigError
from logo.eval.lm_eval_run import lm_eval_metrics, run_lm_eval
from logo.eval.load import EvalError
from logo.run.load import load_model
from logo.eval.perplexity import perplexity, perplexity_metrics
from logo.eval.progress import Progress
from logo.eval.results import log_metrics, save_results
from logo.eval.ruler import check_request, ruler_metrics, run_ruler
from logo.eval.span import write_span_analysis
from logo.eval.synthetic import resolve_task, synthetic_accuracy, synthetic_metrics
from logo.run.checkpoint import CheckpointError


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m logo.eval", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)

    def command(name, help_):
        p = sub.add_parser(name, help=help_)
        p.add_argument("checkpoint", help="a run directory (its latest checkpoint) or a checkpoints/step_N folder")
        p.add_argument("--device", default="auto", help="auto (cuda if visible) | cpu | cuda[:i]")
        p.add_argument("--dtype", default="auto", help="auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16")
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bars with tokens/s on stderr (default: only when stderr is a terminal)")
        return p

    p = command("perplexity", "perplexity on a held-out split, overall and by context position")
    p.add_argument("--data", default=None, help="a prepared corpus (default: the one the run trained on)")
    p.add_argument("--split", default="val")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the trained context)")
    p.add_argument("--tokens", type=int, default=0, help="evaluate the first ~N tokens (0: the whole split)")
    p.add_argument("--bucket-size", type=int, default=None, help="position bucket width (default seq_len/8)")
    p.add_argument("--batch-size", type=int, default=4)

    p = command("ruler", "the 8 RULER needle tasks at chosen lengths")
    p.add_argument("--lengths", type=_ints, required=True, help="comma-separated prompt lengths in tokens")
    p.add_argument("--tasks", default="", help="comma-separated subset of the 8 tasks (default all)")
    p.add_argument("--samples", type=int, default=50, help="prompts per task and length")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-context", type=int, default=None,
                   help="longest length allowed (default: the trained context, stage.seq_len)")
    p.add_argument("--seed", type=int, default=0)

    p = command("synthetic", "held-out accuracy on a long-range synthetic task (data/synthetic.py)")
    p.add_argument("--task", default=None, help="associative_recall | needle_retrieval | far_copy (its parameters: "
                   "the run's mixture source of that task, else the task's defaults)")
    p.add_argument("--source", default=None, help="a synthetic source of the run's mixture, by name")
    p.add_argument("--episodes", type=int, default=256, help="held-out episodes scored")
    p.add_argument("--batch-size", type=int, default=8, help="episodes per forward")
    p.add_argument("--length", type=int, default=None, help="tokens per episode (default: the source's)")
    p.add_argument("--seed", type=int, default=0, help="the held-out stream (the same episodes for every run)")

    p = command("lm_eval", "lm-evaluation-harness tasks (the model is registered as `logo`)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None, help="a folder of extra task YAMLs")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=None, help="default: the trained context")
    p.add_argument("--max-gen-toks", type=int, default=256)

    p = command("span", "span-allocation PNGs (layer-wise, token-wise, word-level) from text files")
    p.add_argument("--text", nargs="+", required=True, help="text files, one domain each")
    p.add_argument("--out", default=None, help="output folder (default <run_dir>/eval/span)")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of each text")
    p.add_argument("--max-words", type=int, default=400, help="words in the word-level view")
    return ap


def _perplexity(a, loaded, progress) -> dict:
    res = perplexity(loaded, a.data, a.split, a.seq_len, a.tokens, a.bucket_size, a.batch_size, progress)
    return {"results": res, "metrics": perplexity_metrics(res),
            "summary": f"loss {res['loss']:.4f}  ppl {res['ppl']:.3f}  ({res['tokens']:,} tokens of "
                       f"{res['dataset']} [{res['split']}], seq_len {res['seq_len']})"}


def _ruler(a, loaded, progress) -> dict:
    tasks = [t for t in a.tasks.split(",") if t] or None
    check_request(a.lengths, tasks or [], a.max_context or loaded.seq_len)
    if a.samples < 1 or a.batch_size < 1 or a.max_new_tokens < 1:
        raise EvalError(f"--samples, --batch-size and --max-new-tokens must be >= 1 "
                         f"(got {a.samples}, {a.batch_size}, {a.max_new_tokens})")
    res = run_ruler(loaded.model, load_tokenizer(loaded.cfg.data.tokenizer), a.lengths, tasks, a.samples,
                    a.batch_size, a.max_new_tokens, a.seed, loaded.autocast(), progress)
    return {"results": res, "metrics": ruler_metrics(res),
            "summary": "  ".join(f"avg@{n} {v:.1f}" for n, v in res["average"].items())}


def _synthetic(a, loaded, progress) -> dict:
    label, params = resolve_task(loaded.cfg, a.task, a.source, a.length)
    res = synthetic_accuracy(loaded, params, a.episodes, a.batch_size, a.seed, progress, label)
    span = res.get("span")
    routed = (f"  global ratio {span['far']['mean_ratio']:.3f} at far-context positions, {span['all']['mean_ratio']:.3f}"
              f" overall" if span else "")
    return {"results": res, "metrics": synthetic_metrics(res), "name": f"synthetic_{label}",
            "summary": f"{label}: accuracy {res['accuracy']:.4f}  token accuracy {res['token_accuracy']:.4f}  "
                       f"({res['answers']} answers in {res['episodes']} held-out episodes of {params.length} tokens)"
                       + routed}


def _lm_eval(a, loaded, progress) -> dict:
    res = run_lm_eval(loaded, a.tasks.split(","), a.include_path, a.num_fewshot, a.limit, a.batch_size,
                      a.max_length, a.max_gen_toks, progress)
    return {"results": res, "metrics": lm_eval_metrics(res), "summary": json.dumps(res)}


def _span(a, loaded, progress) -> dict:
    out = Path(a.out) if a.out else loaded.run_dir / "eval" / "span"
    files = write_span_analysis(loaded, a.text, out, a.max_tokens, a.max_words, progress)
    return {"wrote": f"{out}/ ({', '.join(f.name for f in files)})"}


def main(argv=None, models: Optional[dict] = None) -> int:
    """One command. `models`: a dict kept by a caller that runs several commands in one process
    (`launch.study_eval`); a model loaded for one command is reused by the next with the same checkpoint argument,
    device and dtype."""
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    out = {}
    try:
        key = (a.checkpoint, a.device, a.dtype)
        loaded = models.get(key) if models is not None else None
        if loaded is None:
            loaded = load_model(a.checkpoint, a.device, a.dtype)
            if models is not None:
                models[key] = loaded
        progress = Progress(a.progress)  # the summary's seconds: the evaluation, the model's loading aside
        command = {"perplexity": _perplexity, "ruler": _ruler, "synthetic": _synthetic, "lm_eval": _lm_eval,
                   "span": _span}[a.what]
        out = command(a, loaded, progress)
        progress.finish()
        if "results" in out:
            with interrupt_deferred():  # a Ctrl-C does not come between the JSON and its metrics record
                out["wrote"] = save_results(loaded, a.what, out["results"], out.get("name"))
                log_metrics(loaded, out["metrics"])
            print(f"{a.what} of {loaded.checkpoint} (step {loaded.step}): {out['summary']}")
        print(progress.summary(a.what, out["wrote"]))
    except (ConfigError, DataError, CheckpointError, TokenizerError, EvalError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {a.what}: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {'wrote ' + str(out['wrote']) if 'wrote' in out else 'nothing was written'}",
              file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
