"""The paper's table layout of each experiment family, and the tables built from cells with it.

A layout names the row-label columns, the paper's metric columns (always shown, "–" when no run has them), which
cell is the baseline of which (same stage and `match` key), the row order, and whether loss-vs-compute curves
are fitted. A column may be a pattern (`synthetic/*/accuracy`: `*` is one path part), one column per value a run
has. Tables are split by stage (8k pretraining, 32k, 128k). Runs of no paper family get an ad-hoc layout
(`adhoc_layout`): one of the paper's shapes, titled as what the runs are, showing only the columns they have.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from logo.report.cells import COMPONENT_ORDER, MODEL_ORDER, Cell
from logo.report.values import fmt, metric, sort_key

STAGE_ORDER = ("smoke", "pretrain_8k", "ctx_32k", "ctx_128k")
# Shown after the paper's columns whenever a run has them.
EXTRA_COLUMNS = ("eval_loss", "eval_ppl", "ratio_mean", "global_flops_fraction", "params_total", "tokens",
                 "train_flops", "gpu_hours", "cpu_hours", "process_hours")
ADHOC = "adhoc"  # the family name of a report on runs of no paper family


def model_rank(c: Cell) -> int:
    return MODEL_ORDER.index(c.model) if c.model in MODEL_ORDER else len(MODEL_ORDER)


def _budget(c: Cell) -> str:
    return fmt("budget", c.budget)


@dataclass(frozen=True)
class Layout:
    family: str
    title: str
    index: tuple[tuple[str, Callable[[Cell], str]], ...]  # row-label columns: (header, cell -> text)
    columns: tuple[str, ...]  # the paper's metric columns
    ruler: bool  # add RULER average per length
    match: Callable[[Cell], tuple]  # a cell's baseline has the same stage and match key
    is_baseline: Callable[[Cell], bool]
    order: Callable[[Cell], tuple]
    fit: bool = False
    accepts: tuple[str, ...] = ()  # presets of other families that belong in this report
    paper: bool = True  # False: an ad-hoc layout, whose paper columns show only when a run has them
    compare_columns: bool = False  # test every seeded column of the table against the baseline (else COMPARED)
    ratio_tail: Optional[float] = None  # realized ratios over this last fraction of each run (else --last-steps)
    ratio_tolerance: Optional[float] = None  # check every LoGo layer's realized ratio within rho +- this
    span: bool = False  # the span-allocation table and plot of the synthetic evaluations

    def baseline_of(self, cell: Cell, cells: list[Cell]):
        if self.is_baseline(cell):
            return None
        same = [b for b in cells if self.is_baseline(b) and b.stage == cell.stage and self.match(b) == self.match(cell)]
        return same[0] if len(same) == 1 else None


def _transformer(c: Cell) -> bool:
    return c.model == "Transformer" and not c.extra


LM_CSR = ("train_loss", "wiki_ppl", "lmb_ppl", "lmb_acc", "piqa", "hella", "wino", "arc_e", "arc_c", "csr_avg")
LAYOUTS = {
    "scaling": Layout(
        "scaling", "Scaling comparison between LoGo and the Transformer (paper Table 2)",
        (("Params", lambda c: c.size), ("Model", lambda c: c.name)),
        ("train_loss", "wiki_ppl", "lmb_ppl", "csr_avg"), ruler=False, match=lambda c: (c.size,),
        is_baseline=_transformer, order=lambda c: (c.params, model_rank(c), c.name), fit=True),
    "controlled_1.5b": Layout(
        "controlled_1.5b", "Controlled comparison with static hybrids (paper Tables 3, 5 and 9)",
        (("Model", lambda c: c.name), ("Attn budget", _budget)), LM_CSR, ruler=True, match=lambda c: (c.size,),
        is_baseline=_transformer, order=lambda c: (model_rank(c), c.name, c.params)),
    "ratio_sweep": Layout(
        "ratio_sweep", "LoGo vs inter-layer hybrids at matched budgets (paper Tables 7 and 8)",
        (("Model", lambda c: c.name), ("Attn budget", _budget)), ("train_loss", "wiki_ppl", "lmb_ppl", "csr_avg"),
        ruler=True, match=lambda c: (c.size, c.budget),
        is_baseline=lambda c: c.model == "inter-layer-H" and not c.extra,
        order=lambda c: (model_rank(c), c.budget or 0, c.name)),
    "ablations": Layout(
        "ablations", "Architecture ablations (paper Table 6)",
        (("Component", lambda c: c.component), ("Variant", lambda c: ", ".join(c.variants) or c.name)),
        ("train_loss", "wiki_ppl", "lmb_ppl", "csr_avg", "ruler_avg", "params_total"), ruler=False,
        match=lambda c: (c.size,), is_baseline=lambda c: c.model == "LoGo" and not c.variants and not c.extra,
        order=lambda c: (COMPONENT_ORDER.index(c.component) if c.component in COMPONENT_ORDER else 99, c.name),
        accepts=("controlled_1.5b/logo",)),
    "hybrid_compat": Layout(
        "hybrid_compat", "Compatibility with memory-saving hybrids (paper Table 9)",
        (("Model", lambda c: c.name), ("Attn budget", _budget)), ("train_loss", "wiki_ppl", "lmb_ppl", "ruler_avg"),
        ruler=True, match=lambda c: (c.size,),
        is_baseline=lambda c: c.model == "inter-layer-H" and c.budget == 0.5 and not c.extra,
        order=lambda c: (model_rank(c), -(c.budget or 0), c.name)),
    "mini": Layout(
        "mini", "The controlled comparison in miniature: text + long-range synthetic tasks (paper Table 3 layout)",
        (("Model", lambda c: c.name),), ("ppl/*", "synthetic/*/token_accuracy", "ruler/*", "ruler_avg", "ratio_mean"),
        ruler=False, match=lambda c: (c.size,), is_baseline=lambda c: c.model == "LoGo" and not c.extra,
        order=lambda c: (model_rank(c), c.name), compare_columns=True, ratio_tail=0.1, ratio_tolerance=0.02,
        span=True),
}


def adhoc_layout(n_sizes: int) -> Layout:
    """The layout of runs without a paper experiment preset: rows by size and model with scaling fits (the
    scaling shape) for several model sizes, else rows by model (the controlled comparison's shape)."""
    shape = LAYOUTS["scaling" if n_sizes > 1 else "controlled_1.5b"]
    sizes = f"{n_sizes} model sizes" if n_sizes > 1 else "one model size"
    return dataclasses.replace(shape, family=ADHOC, title=f"Runs without a paper experiment preset ({sizes})",
                               accepts=(), paper=False)


def stage_rank(stage: str) -> tuple:
    return (STAGE_ORDER.index(stage), "") if stage in STAGE_ORDER else (len(STAGE_ORDER), stage)


def split_by_stage(layout: Layout, cells: list[Cell]) -> list[tuple[str, list[Cell]]]:
    stages = sorted({c.stage for c in cells}, key=stage_rank)
    return [(s, sorted((c for c in cells if c.stage == s), key=layout.order)) for s in stages]


def _ruler_lengths(cells: list[Cell]) -> list[str]:
    keys = {k for c in cells for k in c.keys() if k.startswith("ruler/") and k.count("/") == 1}
    return sorted(keys, key=sort_key)


def _expand(column: str, present: set[str]) -> list[str]:
    """A column, or the values a pattern column matches (`*`: one path part), in report order."""
    if "*" not in column:
        return [column]
    pattern = re.compile("^" + "[^/]+".join(map(re.escape, column.split("*"))) + "$")
    return sorted((k for k in present if pattern.match(k)), key=sort_key)


def paper_columns(layout: Layout, cells: list[Cell]) -> list[str]:
    """The layout's own columns (patterns expanded, RULER per length when the layout has it)."""
    present = set().union(*(c.keys() for c in cells)) if cells else set()
    cols = [k for col in layout.columns for k in _expand(col, present) if layout.paper or k in present]
    if layout.ruler:
        cols += _ruler_lengths(cells) + (["ruler_avg"] if "ruler_avg" in present and "ruler_avg" not in cols else [])
    return cols


def main_columns(layout: Layout, cells: list[Cell]) -> list[str]:
    """The paper's columns, then the extra values any run has."""
    present = set().union(*(c.keys() for c in cells)) if cells else set()
    cols = paper_columns(layout, cells)
    ppl = sorted(k for k in present if k.startswith("ppl/"))
    cols += [k for k in (*EXTRA_COLUMNS[:2], *ppl, *EXTRA_COLUMNS[2:]) if k in present and k not in cols]
    return cols


def cell_text(cell: Cell, key: str, latex: bool = False) -> str:
    s = cell.stat(key)
    if not s.n:
        return "--" if latex else "–"
    pm = r" $\pm$ " if latex else " ± "
    show_std = s.std is not None and metric(key).seeded
    text = fmt(key, s.mean) + (pm + fmt(key, s.std) if show_std else "")
    return text + (f" (n={s.n})" if s.n < cell.n else "")


def main_table(layout: Layout, cells: list[Cell], latex: bool = False) -> pd.DataFrame:
    """The paper-layout table: row labels, the paper's columns, RULER, extras present; mean ± std over seeds."""
    cols = main_columns(layout, cells)
    rows = []
    for c in cells:
        row = {h: (_tex(f(c)) if latex else f(c)) for h, f in layout.index}
        for k in cols:
            row[_tex(metric(k).label) if latex else metric(k).label] = cell_text(c, k, latex)
        row["n"] = str(c.n)
        rows.append(row)
    return pd.DataFrame(rows)


def full_table(layout: Layout, cells: list[Cell]) -> pd.DataFrame:
    """Every metric of every cell as numbers: <metric>_mean, <metric>_std, <metric>_n (for the CSV)."""
    keys = sorted(set().union(*(c.keys() for c in cells)), key=sort_key) if cells else []
    rows = []
    for c in cells:
        row = {h: f(c) for h, f in layout.index}
        row.update(stage=c.stage, size=c.size, model=c.name, runs=c.n)
        for k in keys:
            s = c.stat(k)
            row[f"{k}_mean"], row[f"{k}_std"], row[f"{k}_n"] = s.mean, s.std, s.n
        rows.append(row)
    return pd.DataFrame(rows)


def ratio_table(cells: list[Cell]) -> pd.DataFrame:
    """Realized global ratio per layer (mean over seeds) of every cell that reports one."""
    with_ratio = [c for c in cells if any(k.startswith("ratio/") for k in c.keys())]
    layers = sorted({int(k.split("/")[1]) for c in with_ratio for k in c.keys() if k.startswith("ratio/")})
    rows = []
    for c in with_ratio:
        row = {"Row": c.label, "Target": fmt("budget", c.budget)}
        for i in layers:
            row[f"L{i}"] = fmt(f"ratio/{i}", c.stat(f"ratio/{i}").mean)
        rows.append(row)
    return pd.DataFrame(rows)


def ruler_task_table(cells: list[Cell]) -> pd.DataFrame:
    keys = sorted({k for c in cells for k in c.keys() if k.startswith("ruler/") and k.count("/") == 2}, key=sort_key)
    if not keys:
        return pd.DataFrame()
    rows = []
    for c in cells:
        row = {"Row": c.label}
        row.update({metric(k).label.removeprefix("RULER "): cell_text(c, k) for k in keys})
        rows.append(row)
    return pd.DataFrame(rows)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}", "–": "--", "±": r"$\pm$"}


def _tex(s: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in s)


def span_keys(cells: list[Cell]) -> dict[str, list[int]]:
    """{synthetic label: LoGo layers} of the span-allocation values (span/<label>/<far|all>/<layer>) the cells have."""
    out: dict[str, set] = {}
    for k in {k for c in cells for k in c.keys() if k.startswith("span/")}:
        _, label, _, layer = k.split("/")
        out.setdefault(label, set()).add(int(layer))
    return {label: sorted(out[label]) for label in sorted(out)}


def span_table(cells: list[Cell]) -> pd.DataFrame:
    """Per cell and synthetic task, each LoGo layer's global ratio at the far-context positions and overall
    (mean ± std over seeds), as "far / all"."""
    rows = []
    for label, layers in span_keys(cells).items():
        for c in cells:
            if not any(c.stat(f"span/{label}/far/{i}").n for i in layers):
                continue
            row = {"Row": c.label, "Task": label}
            for i in layers:
                row[f"L{i} far / all"] = f"{cell_text(c, f'span/{label}/far/{i}')} / {cell_text(c, f'span/{label}/all/{i}')}"
            rows.append(row)
    return pd.DataFrame(rows)
