"""Build a sweep report: runs -> cells -> the family's tables, seed-noise comparisons, scaling fits, plots.

`build_report` returns a `Report` (everything computed); `write_report` writes it into one folder.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from logo.report.cells import Cell, Comparison, compare, make_cells
from logo.report.checks import RatioCheck, ratio_checks
from logo.report.fit import FitError, Multiplier, PowerLawFit, compute_multiplier, fit_power_law
from logo.report.layouts import LAYOUTS, Layout, adhoc_layout, paper_columns, split_by_stage
from logo.report.runs import Run, Skip, find_run_dirs, load_run
from logo.report.values import metric, run_values

COMPARED = ("train_loss", "eval_loss", "wiki_ppl", "lmb_ppl", "csr_avg", "ruler_avg")  # metrics tested vs baseline
FIT_AXES = (("train_flops", "training FLOPs"), ("params_non_embedding", "non-embedding parameters"))


class ReportError(ValueError):
    """The report cannot be made (no usable runs, families mixed without --family, ...); one line."""


@dataclass
class Settings:
    family: Optional[str] = None
    last_steps: int = 100
    include_incomplete: bool = False
    alpha: float = 0.05  # Welch t-test level
    n_boot: int = 1000
    level: float = 0.95  # bootstrap interval level
    fit_metric: str = "train_loss"
    seed: int = 0


@dataclass
class Fit:
    stage: str
    model: str
    x_key: str
    fit: Optional[PowerLawFit]
    error: str = ""


@dataclass
class Report:
    layout: Layout
    family_note: str
    settings: Settings
    used: list[str]
    skipped: list[str]
    cells: list[Cell]
    tables: list[tuple[str, list[Cell]]]  # (stage, cells in row order)
    comparisons: list[Comparison]
    fits: list[Fit] = field(default_factory=list)
    multipliers: list[tuple[str, str, str, Multiplier]] = field(default_factory=list)  # stage, model, base, m
    ratio_checks: list[RatioCheck] = field(default_factory=list)  # when the layout asks for the check

    @property
    def ordered_cells(self) -> list[Cell]:
        """All cells in table order (stage, then the layout's row order)."""
        return [c for _, cells in self.tables for c in cells]


def load_runs(args: list[str], settings: Settings, say: Callable[[str], None]) -> tuple[list[Run], list[str]]:
    dirs, skipped = find_run_dirs(args)
    runs = []
    for d in dirs:
        try:
            runs.append(load_run(d, settings.include_incomplete))
        except Skip as e:
            skipped.append(f"skipped {d}: {e}")
        except OSError as e:
            skipped.append(f"skipped {d}: cannot be read ({e})")
    for line in skipped:
        say(line)
    return runs, skipped


def choose_family(runs: list[Run], family: Optional[str]) -> tuple[Layout, list[Run], list[str], str]:
    """The layout, the runs that belong to it, skip lines for the others, and how the family was chosen. A run
    belongs to a paper family only through its experiment preset; runs without one are reported as themselves."""
    if family is not None:
        return _asked_family(runs, family)
    present = sorted({r.family for r in runs if r.family in LAYOUTS})
    fits = [f for f in present if all(r.family == f or r.experiment in LAYOUTS[f].accepts for r in runs)]
    if len(fits) == 1:
        return LAYOUTS[fits[0]], runs, [], f"{fits[0]} (from the runs' experiment presets)"
    if present:
        raise ReportError(f"the runs come from several experiment families ({_family_counts(runs)}); pass "
                          f"--family NAME (one of {', '.join(LAYOUTS)}) to report one of them")
    sizes = {(r.config["model"].get("name"), r.config["model"].get("dim"), r.config["model"].get("n_layers"))
             for r in runs}
    shape = f"{len(sizes)} model sizes: rows by size and model" if len(sizes) > 1 else "one model size: rows by model"
    return adhoc_layout(len(sizes)), runs, [], f"none (no run has a paper experiment preset; {shape})"


def _asked_family(runs: list[Run], family: str) -> tuple[Layout, list[Run], list[str], str]:
    """--family: the runs of that family; the others skipped, or one error line when no run is of it."""
    if family not in LAYOUTS:
        raise ReportError(f"unknown --family {family!r}; choose one of {', '.join(LAYOUTS)}")
    layout = LAYOUTS[family]
    keep, skipped = [], []
    for r in runs:
        if r.family == family or r.experiment in layout.accepts:
            keep.append(r)
        elif r.family is None:
            skipped.append(f"skipped {r.path}: no experiment preset, so not a run of family {family}")
        else:
            skipped.append(f"skipped {r.path}: preset {r.experiment} belongs to family {r.family}, not {family}")
    if not keep:
        raise ReportError(f"--family {family}: no run is of that family ({_family_counts(runs)}); leave out "
                          f"--family to report the runs as they are")
    return layout, keep, skipped, f"{family} (--family)"


def _family_counts(runs: list[Run]) -> str:
    """'scaling: 2 runs, no preset: 1 run': the runs per experiment family."""
    n: dict[Optional[str], int] = {}
    for r in runs:
        n[r.family] = n.get(r.family, 0) + 1
    names = sorted(f for f in n if f is not None) + ([None] if None in n else [])
    return ", ".join(f"{f or 'no preset'}: {n[f]} run{'s' if n[f] != 1 else ''}" for f in names)


def build_report(args: list[str], settings: Settings, say: Callable[[str], None] = print) -> Report:
    runs, skipped = load_runs(args, settings, say)
    if not runs:
        raise ReportError(f"no usable runs in {' '.join(args)} ({len(skipped)} skipped, listed above)")
    layout, runs, more, note = choose_family(runs, settings.family)
    runs, values, bad = _values(runs, settings.last_steps, layout.ratio_tail)
    cells, twins = make_cells(runs, values)
    for line in more + bad + twins:
        say(line)
    skipped += more + bad + twins
    if not cells:
        raise ReportError(f"no usable runs for family {layout.family} ({len(skipped)} skipped, listed above)")
    tables = split_by_stage(layout, cells)
    used = _used_lines(tables)
    for line in used:
        say(line)
    comparisons = [cmp for stage, row_cells in tables for c in row_cells
                   if (base := layout.baseline_of(c, row_cells)) is not None
                   for key in compared(layout, row_cells)
                   if (cmp := compare(stage, c, base, key, settings.alpha)) is not None]
    rep = Report(layout, note, settings, used, skipped, cells, tables, comparisons)
    if layout.ratio_tolerance is not None:
        rep.ratio_checks = ratio_checks(rep.ordered_cells, layout.ratio_tolerance)
    if layout.fit:
        _fit(rep, say)
    return rep


def compared(layout: Layout, cells: list[Cell]) -> list[str]:
    """The metrics tested against the baseline: COMPARED, or every seeded column of the layout's table."""
    if not layout.compare_columns:
        return list(COMPARED)
    return [k for k in paper_columns(layout, cells) if metric(k).seeded]


def _values(runs: list[Run], last_steps: int, ratio_tail: Optional[float]) -> tuple[list[Run], list[dict], list[str]]:
    """run_values of every run; a run whose logged values are not numbers is skipped with the reason."""
    kept, values, skipped = [], [], []
    for r in runs:
        try:
            values.append(run_values(r, last_steps, ratio_tail))
            kept.append(r)
        except (TypeError, ValueError, KeyError) as e:
            skipped.append(f"skipped {r.path}: a logged or evaluation value is not a number ({type(e).__name__}: {e})")
    return kept, values, skipped


def _used_lines(tables: list[tuple[str, list[Cell]]]) -> list[str]:
    lines = []
    for _, cells in tables:
        for c in cells:
            for r in c.runs:
                notes = "".join(f"; {n}" for n in r.notes)
                lines.append(f"used    {r.path}: {c.label}, train.seed {r.seed[0]}, data.seed {r.seed[1]} (step "
                             f"{r.last_step} of {r.plan['steps']}){notes}")
    return lines


def _fit(rep: Report, say: Callable[[str], None]) -> None:
    s = rep.settings
    for stage, cells in rep.tables:
        by_model: dict[str, list[Cell]] = {}
        for c in cells:
            by_model.setdefault(c.name, []).append(c)
        compute_fits = {}
        for model, cs in by_model.items():
            for x_key, _ in FIT_AXES:
                pts = [(v[x_key], v[s.fit_metric]) for c in cs for v in c.values if x_key in v and s.fit_metric in v]
                try:
                    f = fit_power_law([p[0] for p in pts], [p[1] for p in pts], s.n_boot, s.level, s.seed)
                    rep.fits.append(Fit(stage, model, x_key, f))
                    if x_key == "train_flops":
                        compute_fits[model] = f
                except FitError as e:
                    rep.fits.append(Fit(stage, model, x_key, None, str(e)))
                    say(f"fit     {stage} {model} {s.fit_metric} vs {x_key}: skipped, {e}")
        bases = {c.name for c in cells if rep.layout.is_baseline(c)}
        for base in sorted(bases & set(compute_fits)):
            xs = sorted({round(c.stat("train_flops").mean) for c in by_model[base] if c.stat("train_flops").n})
            for model, f in compute_fits.items():
                if model == base:
                    continue
                for x in xs:
                    m = compute_multiplier(compute_fits[base], f, float(x))
                    if not math.isnan(m.value):
                        rep.multipliers.append((stage, model, base, m))


def default_out(rep_family: str) -> Path:
    return Path("reports") / rep_family
