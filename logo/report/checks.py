"""The realized-ratio check of a family whose layout asks for one: every LoGo layer of every LoGo run within
rho +- tolerance, its ratio averaged over the last fraction of the run (`Layout.ratio_tail`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from logo.report.cells import Cell

LOGO_MODELS = ("LoGo", "inter-layer-H + LoGo")  # the cells whose runs have token-routed (LoGo) layers


@dataclass
class RatioCheck:
    run: str  # the run directory
    row: str  # its cell's label
    seed: object  # train.seed
    layer: Optional[int]  # None: the run logged no per-layer ratio
    ratio: Optional[float]
    rho: Optional[float]
    tolerance: float

    @property
    def off(self) -> Optional[float]:
        return None if self.ratio is None or self.rho is None else self.ratio - self.rho

    @property
    def within(self) -> bool:
        return self.off is not None and abs(self.off) <= self.tolerance


def ratio_checks(cells: list[Cell], tolerance: float) -> list[RatioCheck]:
    """One check per LoGo layer of every run of a LoGo cell (one check with layer None when none is logged)."""
    out = []
    for c in cells:
        if c.model not in LOGO_MODELS:
            continue
        for run, v in zip(c.runs, c.values):
            rho = run.config["attention"].get("rho")
            rho = float(rho) if isinstance(rho, (int, float)) and not isinstance(rho, bool) else None
            layers = sorted(int(k.split("/")[1]) for k in v if k.startswith("ratio/"))
            base = dict(run=str(run.path), row=c.label, seed=run.seed[0], rho=rho, tolerance=tolerance)
            out += [RatioCheck(layer=i, ratio=v[f"ratio/{i}"], **base) for i in layers] or [
                RatioCheck(layer=None, ratio=None, **base)]
    return out


def check_summary(checks: list[RatioCheck], tail: float) -> str:
    """One sentence: how many LoGo layers are within rho +- tolerance, naming every one that is not."""
    if not checks:
        return "No LoGo run: no realized ratio to check."
    tol = checks[0].tolerance
    runs = len({c.run for c in checks})
    head = (f"Realized global ratio of every LoGo layer, mean over the last {tail:.0%} of each run's steps, against "
            f"rho ± {tol:g}:")
    bad = [c for c in checks if not c.within]
    if not bad:
        return f"{head} all {len(checks)} layers of {runs} runs are within."
    named = "; ".join(f"{c.run} layer {c.layer}: {c.ratio:.3f} vs rho {c.rho:g} ({c.off:+.3f})" if c.off is not None
                      else f"{c.run}: {'no rho in its config' if c.rho is None else 'no per-layer ratio logged'}"
                      for c in bad)
    return f"{head} {len(bad)} of {len(checks)} layers ({runs} runs) are NOT within: {named}."
