"""Span-allocation analysis of a checkpoint on text files (paper Sec. 4.5, App. D.3), as PNGs + JSON.

For each text: the exact routing of every LoGo layer (`record_routing`) over the text in rows of the trained
context; the layer-wise realized ratio and the distribution of how many layers route each token global (one
row per text in `span_allocation.png`, as the paper's figure), and the word-level view of the first row
(`<name>_words.png`: each word coloured by the number of layers that gave the prediction of its tokens global
span, averaged over its tokens). Numbers in `span_allocation.json`. One figure per output: a text's own
allocation panels are its row of `span_allocation.png`, never a second file. The folder is written aside and
swapped in whole; it replaces only an earlier span folder (`data.outputs`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from data.outputs import OutputError, OutputKind, check_out, folder_swapped_in
from logo.analysis.span_allocation import (allocation_stats, plot_domains, plot_words, record_routing,
                                           word_scores, word_spans)
from logo.eval.load import EvalError
from logo.run.checkpoint import run_dir_of
from logo.run.load import Loaded
from logo.eval.progress import Progress
from data.tokenizer import load_tokenizer

SPAN = OutputKind("a span analysis", ("span_allocation.json",), ("span_allocation.json", "*.png"))


def _name(path: Path, used: set) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.stem) or "text"
    name, i = base, 1
    while name in used:
        i += 1
        name = f"{base}_{i}"
    used.add(name)
    return name


def _rows(ids: list[int], T: int, pad: int):
    """Token ids -> (R, T) rows and their valid mask (the last row padded)."""
    R = -(-len(ids) // T)
    tokens = torch.full((R, T), pad, dtype=torch.long)
    valid = torch.zeros(R, T, dtype=torch.bool)
    for r in range(R):
        chunk = ids[r * T:(r + 1) * T]
        tokens[r, :len(chunk)] = torch.tensor(chunk)
        valid[r, :len(chunk)] = True
    return tokens, valid


@torch.inference_mode()
def span_analysis(loaded: Loaded, texts: list[str], out_dir: Path, max_tokens: Optional[int] = None,
                  max_words: int = 400, progress: Optional[Progress] = None) -> list[Path]:
    """Write the figures and the JSON to out_dir; returns the files written. `progress` counts the tokens."""
    model = loaded.model
    if not model.logo_layer_ids:
        raise EvalError(f"checkpoint {loaded.checkpoint} has no LoGo layers (attention.kind="
                         f"{loaded.cfg.model.attention.kind!r}): span allocation needs a LoGo model")
    tok = load_tokenizer(loaded.cfg.data.tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    T, L = loaded.seq_len, len(model.logo_layer_ids)
    report, used, word_figures = {}, set(), []
    progress = progress or Progress(enabled=False)
    for path in map(Path, texts):
        if not path.is_file():
            raise EvalError(f"text file {path} does not exist")
        ids = tok.encode_ordinary(path.read_text(errors="replace"))[:max_tokens]
        if len(ids) < 2:
            raise EvalError(f"text file {path} holds {len(ids)} tokens; span analysis needs at least 2")
        tokens, valid = _rows(ids, T, tok.eot_token)
        with loaded.autocast():
            z = torch.cat([record_routing(model, tokens[r:r + 1].to(loaded.device), valid=valid[r:r + 1].to(
                loaded.device)) for r in range(tokens.shape[0])], dim=1)  # (L, R, T)
        progress.update(tokens=len(ids))
        stats = {**allocation_stats(z, valid), "layer_ids": model.logo_layer_ids}
        name = _name(path, used)
        n0 = int(valid[0].sum())
        scores = word_scores(z[:, :1])[0, :n0].tolist()
        words = word_spans([tok.decode_single_token_bytes(t) for t in ids[:n0]], scores)[:max_words]
        word_figures.append(out_dir / f"{name}_words.png")
        plot_words(words, float(L), f"{name}: word-level span allocation", str(word_figures[-1]))
        report[name] = {"file": str(path), **stats}
    figure, numbers = out_dir / "span_allocation.png", out_dir / "span_allocation.json"
    plot_domains(report, str(figure))
    numbers.write_text(json.dumps({"checkpoint": str(loaded.checkpoint), "step": loaded.step,
                                   "logo_layers": model.logo_layer_ids, "texts": report}, indent=1))
    return [figure, *word_figures, numbers]


def span_sources(loaded: Loaded, texts: list[str]) -> list[Path]:
    """What the analysis reads: the texts and the checkpoint (with its run's config.yaml)."""
    ckpt = Path(loaded.checkpoint)
    run_config = [] if ckpt == Path(loaded.run_dir) else [run_dir_of(ckpt) / "config.yaml"]
    return [*map(Path, texts), ckpt, *run_config]


def write_span_analysis(loaded: Loaded, texts: list[str], out: Path, max_tokens: Optional[int] = None,
                        max_words: int = 400, progress: Optional[Progress] = None) -> list[Path]:
    """`span_analysis` into the folder `out`, written aside and swapped in (replacing only an earlier span
    folder); EvalError in one line for an `out` that may not be written. Returns the files written."""
    sources = span_sources(loaded, texts)
    try:
        check_out(out, SPAN, sources)
        with folder_swapped_in(out, SPAN, sources) as tmp:
            files = span_analysis(loaded, texts, tmp, max_tokens, max_words, progress)
    except OutputError as e:
        raise EvalError(str(e)) from None
    return [out / f.name for f in files]
