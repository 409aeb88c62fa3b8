"""Write a Report into one folder: report.md (everything, readable), per-stage tables as Markdown / CSV / LaTeX,
runs.csv, comparisons.csv, fits.csv, report.json and the PNG plots.

The folder is assembled next to the target and swapped in at the end, so a reader never sees a half-written
report; an existing folder is replaced only if it is an earlier report (it holds report.json and nothing a report
does not write) and holds none of the runs read (`data.outputs`). Files and folders get the permissions of the
user's umask.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import pandas as pd

from data.outputs import OutputError, OutputKind, check_out, folder_swapped_in
from logo.report import plots
from logo.report.checks import check_summary
from logo.report.layouts import full_table, main_table, ratio_table, ruler_task_table, span_keys, span_table
from logo.report.report import FIT_AXES, Report, ReportError
from logo.report.values import fmt, metric

REPORT = OutputKind("a report", ("report.json",),
                    ("report.md", "report.json", "table_*.md", "table_*.csv", "table_*.tex", "*.csv", "*.png"))
HOURS_NOTES = {"gpu_hours": "GPU-hours for runs on GPUs", "cpu_hours": "CPU process-hours for runs on the CPU",
               "process_hours": "process-hours for runs that do not record their device"}


def _md(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, disable_numparse=True) if len(df) else "(none)"  # keep "2.100" as written


def _num(v, digits=4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}g}"


def _interval(iv, digits=4) -> str:
    return f"[{_num(iv[0], digits)}, {_num(iv[1], digits)}]" if iv else "(no interval)"


def comparisons_frame(rep: Report) -> pd.DataFrame:
    rows = []
    for c in rep.comparisons:
        rows.append({"Stage": c.table, "Row": c.row, "Baseline": c.baseline, "Metric": metric(c.metric).label,
                     "Row mean": fmt(c.metric, c.mean), "Baseline mean": fmt(c.metric, c.baseline_mean),
                     "Diff": f"{c.diff:+.4g}", "n": f"{c.n} vs {c.baseline_n}",
                     "Welch p": _num(c.p, 3), "Verdict": c.verdict})
    return pd.DataFrame(rows)


def fits_frame(rep: Report) -> pd.DataFrame:
    rows = []
    axis = dict(FIT_AXES)
    for f in rep.fits:
        row = {"Stage": f.stage, "Model": f.model, "x": axis[f.x_key]}
        if f.fit is None:
            row.update({"E": "–", "A": "–", "alpha": "–", "points": "–", "RMSE": "–", "note": f.error})
        else:
            law = f.fit.law
            row.update({"E": f"{law.E:.4g} {_interval(f.fit.interval('E'))}",
                        "A": f"{law.A:.4g} {_interval(f.fit.interval('A'))}",
                        "alpha": f"{law.alpha:.4g} {_interval(f.fit.interval('alpha'))}",
                        "points": str(len(f.fit.x)), "RMSE": f"{f.fit.rmse:.3g}",
                        "note": _fit_note(f.fit)})
        rows.append(row)
    return pd.DataFrame(rows)


def _fit_note(fit) -> str:
    if not len(fit.boot):
        return "exact fit: no residuals to resample"
    note = f"{len(fit.boot)} bootstrap refits"
    return note if fit.identified else note + "; not identified: the alpha interval reaches its bounds"


def multipliers_frame(rep: Report) -> pd.DataFrame:
    rows = []
    for stage, model, base, m in rep.multipliers:
        rows.append({"Stage": stage, "Model": model, "Baseline": base, "Baseline FLOPs": f"{m.x:.3g}",
                     "Baseline loss (fit)": f"{m.loss:.4f}",
                     "Model FLOPs for that loss": f"{m.x_other:.3g}" if math.isfinite(m.x_other) else "never",
                     "Compute multiplier": f"{_num(m.value, 4)}x {_interval(m.interval, 3)}",
                     "note": "extrapolated" if m.extrapolated else ""})
    return pd.DataFrame(rows)


def ratio_check_frame(rep: Report) -> pd.DataFrame:
    """One row per LoGo layer of every LoGo run: its realized ratio, rho, the difference and the verdict."""
    return pd.DataFrame([{"run_dir": c.run, "row": c.row, "train_seed": c.seed, "layer": c.layer, "ratio": c.ratio,
                          "rho": c.rho, "diff": c.off, "tolerance": c.tolerance, "within": c.within}
                         for c in rep.ratio_checks])


def ratio_check_table(rep: Report) -> pd.DataFrame:
    """Runs x LoGo layers, each layer's ratio marked "(off)" when outside rho +- tolerance."""
    rows: dict[str, dict] = {}
    for c in rep.ratio_checks:
        row = rows.setdefault(c.run, {"Run": c.run, "Seed": str(c.seed), "rho": _num(c.rho, 3)})
        if c.layer is not None:
            row[f"L{c.layer}"] = f"{c.ratio:.3f}" + ("" if c.within else " (off)")
    return pd.DataFrame(list(rows.values())).fillna("–")


def runs_frame(rep: Report) -> pd.DataFrame:
    rows = []
    for c in rep.ordered_cells:
        for run, v in zip(c.runs, c.values):
            rows.append({"run_dir": str(run.path), "stage": c.stage, "size": c.size, "model": c.name,
                         "train_seed": run.seed[0], "data_seed": run.seed[1], "complete": run.complete, **v})
    return pd.DataFrame(rows)


def _header(rep: Report) -> str:
    s = rep.settings
    return "\n".join([
        f"# Sweep report: {rep.layout.title}", "",
        f"- family: {rep.family_note}",
        f"- runs: {len(rep.used)} used in {len(rep.cells)} rows, {len(rep.skipped)} skipped (listed at the end)",
        f"- train loss: mean of the logged training loss over the last {s.last_steps} optimizer steps of each run; "
        f"realized global ratio: {_ratio_note(rep)}",
        "- cells: mean ± sample standard deviation over seeds (`n` = seeds); `–` = no run has the value",
        f"- seed noise: a row's difference from its baseline row is tested with Welch's t-test (two-sided, "
        f"alpha {s.alpha}); it needs >= 2 seeds on both sides",
        *_fit_note_line(rep), *_compute_time_note(rep), ""])


def _fit_note_line(rep: Report) -> list[str]:
    """The header line saying how curves are fitted, for a layout that fits them."""
    s = rep.settings
    return [f"- fits: {s.fit_metric} = E + A * x^-alpha per model (scipy curve_fit), {int(s.level * 100)}% "
            f"percentile intervals from {s.n_boot} residual-bootstrap refits; training FLOPs = the plan's train FLOPs "
            f"per token (6 N + attention) x tokens trained"] if rep.layout.fit else []


def _ratio_note(rep: Report) -> str:
    if rep.layout.ratio_tail is not None:
        return (f"mean of the logged window means (else per-step ratios) over the last {rep.layout.ratio_tail:.0%} "
                f"of each run's steps")
    return "the budget reporting's window mean when logged, else the mean over the same steps"


def _compute_time_note(rep: Report) -> list[str]:
    """The header line saying how compute time is measured, in the units the report's runs have."""
    keys = set().union(*(c.keys() for c in rep.cells))
    units = [note for key, note in HOURS_NOTES.items() if key in keys]
    return [f"- compute time: logged wall time x world size, as {', '.join(units)}"] if units else []


def report_markdown(rep: Report, files: list[str]) -> str:
    parts = [_header(rep)]
    for stage, cells in rep.tables:
        parts += [f"## Stage {stage}", "", f"`table_{stage}.md` / `.csv` (every metric: mean, std, n) / `.tex`", "",
                  _md(main_table(rep.layout, cells)), ""]
        cmp = comparisons_frame(rep)
        cmp = cmp[cmp["Stage"] == stage] if len(cmp) else cmp
        if len(cmp):
            parts += ["### Rows vs their baseline", "", _md(cmp.drop(columns="Stage")), ""]
        ruler = ruler_task_table(cells)
        if len(ruler):
            parts += ["### RULER per task", "", _md(ruler), ""]
    if rep.fits:
        parts += ["## Scaling fits", "", _md(fits_frame(rep)), ""]
    if rep.multipliers:
        parts += ["### Compute multiplier", "",
                  "How many times less training compute the model needs to reach the loss that the baseline's "
                  "fitted curve has at the baseline's compute (> 1: the model needs less).", "",
                  _md(multipliers_frame(rep)), ""]
    ratios = ratio_table(rep.ordered_cells)
    if len(ratios):
        parts += ["## Realized global ratio per layer", "", _md(ratios), ""]
    if rep.layout.ratio_tolerance is not None:
        parts += ["## Realized ratio check", "", check_summary(rep.ratio_checks, rep.layout.ratio_tail or 0.0), "",
                  _md(ratio_check_table(rep)), ""]
    spans = span_table(rep.ordered_cells) if rep.layout.span else pd.DataFrame()
    if len(spans):
        parts += ["## Span allocation on the synthetic tasks", "",
                  "Per LoGo layer, the fraction of tokens routed global at the positions that predict an answer "
                  "token (far-context positions) / at every position of the held-out episodes "
                  "(`python -m logo.eval synthetic`); mean ± std over seeds.", "", _md(spans), ""]
    pngs = [f for f in files if f.endswith(".png")]
    if pngs:
        parts += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in pngs] + [""]
    parts += ["## Runs", "", "```", *rep.used, *rep.skipped, "```", ""]
    return "\n".join(parts)


def report_json(rep: Report) -> dict:
    return {
        "family": rep.layout.family, "family_note": rep.family_note, "settings": asdict(rep.settings),
        "used": rep.used, "skipped": rep.skipped,
        "tables": {stage: full_table(rep.layout, cells).to_dict(orient="records") for stage, cells in rep.tables},
        "comparisons": [asdict(c) for c in rep.comparisons],
        "fits": [{"stage": f.stage, "model": f.model, "x": f.x_key, "error": f.error or None,
                  **({"E": f.fit.law.E, "A": f.fit.law.A, "alpha": f.fit.law.alpha, "points": len(f.fit.x),
                      "rmse": f.fit.rmse, "bootstrap": len(f.fit.boot), "identified": f.fit.identified,
                      "intervals": {k: f.fit.interval(k) for k in ("E", "A", "alpha")}} if f.fit else {})}
                 for f in rep.fits],
        "multipliers": [{"stage": s, "model": m, "baseline": b, "x": mu.x, "loss": mu.loss,
                         "x_model": mu.x_other if math.isfinite(mu.x_other) else None, "multiplier": mu.value,
                         "interval": mu.interval, "extrapolated": mu.extrapolated}
                        for s, m, b, mu in rep.multipliers],
        **({"ratio_check": ratio_check_frame(rep).to_dict(orient="records")}
           if rep.layout.ratio_tolerance is not None else {}),
    }


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def _clean(o):
    """NaN/inf -> None, so report.json is strict JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def _plots(rep: Report, out: Path) -> list[str]:
    fits = {(f.stage, f.model, f.x_key): f.fit for f in rep.fits if f.fit is not None}
    names = []
    multi = len(rep.tables) > 1
    for stage, cells in rep.tables:
        suffix = f"_{stage}" if multi else ""
        for x_key, xlabel in FIT_AXES:
            stem = "loss_vs_compute" if x_key == "train_flops" else "loss_vs_params"
            f = {m: fits[(stage, m, x_key)] for (s, m, k) in fits if s == stage and k == x_key}
            p = plots.loss_vs(cells, x_key, rep.settings.fit_metric, f, out / f"{stem}{suffix}.png", xlabel)
            names += [p.name] if p else []
    for p in (plots.ratio_per_layer(rep.ordered_cells, out / "ratio_per_layer.png"),
              plots.loss_curves(rep.ordered_cells, out / "loss_curves.png")):
        names += [p.name] if p else []
    if rep.layout.ratio_tolerance is not None:
        p = plots.ratio_heatmap(rep.ratio_checks, out / "ratio_heatmap.png")
        names += [p.name] if p else []
    if rep.layout.span:
        p = plots.span_allocation(rep.ordered_cells, span_keys(rep.ordered_cells), out / "span_allocation.png")
        names += [p.name] if p else []
    return names


def check_report_out(out: Path, rep: Optional[Report] = None) -> None:
    """ReportError in one line unless `out` is new, empty or an earlier report holding none of the report's runs."""
    try:
        check_out(out, REPORT, _run_paths(rep) if rep else ())
    except OutputError as e:
        raise ReportError(str(e)) from None


def _run_paths(rep: Report) -> list[Path]:
    return [run.path for c in rep.cells for run in c.runs]


def write_report(rep: Report, out: Path) -> list[Path]:
    """Write every file of the report into `out` (replaced as a whole); returns the written paths."""
    out = Path(out)
    check_report_out(out, rep)
    try:
        with folder_swapped_in(out, REPORT, _run_paths(rep)) as tmp:
            files = _write_files(rep, tmp)
    except OutputError as e:
        raise ReportError(str(e)) from None
    return [out / f for f in files]


def _write_files(rep: Report, tmp: Path) -> list[str]:
    files = _plots(rep, tmp)
    for stage, cells in rep.tables:
        (tmp / f"table_{stage}.md").write_text(_md(main_table(rep.layout, cells)) + "\n")
        full_table(rep.layout, cells).to_csv(tmp / f"table_{stage}.csv", index=False)
        main_table(rep.layout, cells, latex=True).to_latex(tmp / f"table_{stage}.tex", index=False, escape=False,
                                                           caption=f"{rep.layout.title}; stage {stage}")
        files += [f"table_{stage}.md", f"table_{stage}.csv", f"table_{stage}.tex"]
    for name, df in (("runs.csv", runs_frame(rep)), ("comparisons.csv", comparisons_frame(rep)),
                     ("fits.csv", fits_frame(rep)), ("multipliers.csv", multipliers_frame(rep)),
                     ("ratio_check.csv", ratio_check_frame(rep)),
                     ("span_allocation.csv", span_table(rep.ordered_cells) if rep.layout.span else pd.DataFrame())):
        if len(df):
            df.to_csv(tmp / name, index=False)
            files.append(name)
    (tmp / "report.json").write_text(json.dumps(_clean(report_json(rep)), indent=1, default=_json_default))
    files.append("report.json")
    (tmp / "report.md").write_text(report_markdown(rep, files))
    return ["report.md", *files]
