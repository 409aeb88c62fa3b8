"""python -m logo.report RUN_DIR_OR_GLOB... [--family F] [--out DIR]: the sweep report of a set of runs."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.outputs import INTERRUPTED, one_line
from logo.report.layouts import LAYOUTS
from logo.report.report import ReportError, Settings, build_report, default_out
from logo.report.write import check_report_out, write_report
from logo.report.wandb_log import log_report


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m logo.report", description=(
        "Turn run directories (or a sweep folder, or globs) into the family's paper tables (Markdown, CSV, LaTeX), "
        "seed statistics, LoGo-vs-baseline tests, scaling fits and PNG plots, in one folder."))
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR_OR_GLOB",
                    help="run directories, folders holding run directories (searched below), or glob patterns")
    ap.add_argument("--family", choices=sorted(LAYOUTS), default=None,
                    help="the table layout; default: from the runs' experiment presets")
    ap.add_argument("--out", default=None, help="output folder (default reports/<family>); replaced as a whole")
    ap.add_argument("--last-steps", type=int, default=100, metavar="N",
                    help="final train loss = mean logged loss over the last N optimizer steps (default 100)")
    ap.add_argument("--include-incomplete", action="store_true",
                    help="use runs that have not reached their planned steps (still running, stopped, failed)")
    ap.add_argument("--alpha", type=float, default=0.05, help="Welch t-test level for 'exceeds seed noise'")
    ap.add_argument("--bootstrap", type=int, default=1000, metavar="B", help="bootstrap refits per fitted curve")
    ap.add_argument("--fit-metric", default="train_loss", help="the value the scaling curves fit (e.g. eval_loss)")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap random seed")
    ap.add_argument("--wandb", action="store_true", help="also log the tables and plots to a W&B run")
    ap.add_argument("--wandb-project", default="logo")
    a = ap.parse_args(argv)
    for name, ok, need in (("--last-steps", a.last_steps >= 1, ">= 1"), ("--bootstrap", a.bootstrap >= 0, ">= 0"),
                           ("--alpha", 0 < a.alpha < 1, "in (0, 1)")):
        if not ok:
            ap.error(f"{name} {getattr(a, name[2:].replace('-', '_'))}: must be {need}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    settings = Settings(family=a.family, last_steps=a.last_steps, include_incomplete=a.include_incomplete,
                        alpha=a.alpha, n_boot=a.bootstrap, fit_metric=a.fit_metric, seed=a.seed)
    files = []
    try:
        if a.out:
            check_report_out(Path(a.out))  # before the runs are read: a bad --out fails at once
        rep = build_report(a.runs, settings)
        out = Path(a.out) if a.out else default_out(rep.layout.family)
        files = write_report(rep, out)
        print(f"wrote {out}/: {', '.join(p.name for p in files)}")
        if a.wandb:
            print(log_report(rep, files, a.wandb_project))
    except (ReportError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        done = f"the report is in {files[0].parent}, not logged to W&B" if files else "no report was written"
        print(f"interrupted: {done}", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
