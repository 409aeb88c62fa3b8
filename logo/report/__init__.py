"""Sweep reports: run directories -> the paper's tables, seed noise, fitted scaling curves and plots.

    python -m logo.report runs/scaling-* --family scaling --out reports/scaling

See docs/report.md. `build_report` collects and computes, `write_report` writes the folder.
"""
from logo.report.report import Report, ReportError, Settings, build_report
from logo.report.write import write_report

__all__ = ["Report", "ReportError", "Settings", "build_report", "write_report"]
