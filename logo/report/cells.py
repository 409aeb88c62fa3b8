"""Runs grouped into cells (one table row: runs whose configs agree on everything but the seed and bookkeeping),
their labels in the paper's words, seed statistics, and LoGo-vs-baseline comparisons against the seed noise."""
from __future__ import annotations

import json
import math
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Optional

from logo.report.runs import Run
from logo.report.values import metric
from logo.train.rundir import flatten

# Config keys that do not change what a run measures: seeds (the axis the cell aggregates over), where and how
# it ran, and where files live (a context-extension stage's init_from names its seed's own pretraining run).
IGNORED = ("run", "logging", "checkpoint", "parallel", "dry_run", "experiment", "train.seed", "data.seed",
           "data.path", "train.micro_batch", "train.compile", "train.activation_checkpointing", "train.loss",
           "attention.backend",
           "model.attention")
MODEL_NAMES = {"full": "Transformer", "local": "SWA", "inter_layer": "inter-layer-H", "intra_layer": "intra-layer-H",
               "logo": "LoGo"}
MODEL_ORDER = ("Transformer", "inter-layer-H", "intra-layer-H", "SWA", "inter-layer-H + LoGo", "LoGo")
# LoGo variants of the paper's architecture ablations (Table 6): (attention field, value, label, component).
VARIANTS = (
    ("transform", "shared", "shared params", "Branch param."),
    ("transform", "full", "full params", "Branch param."),
    ("transform", "so", "SO transform", "Branch param."),
    ("context_norm", False, "w/o ContextNorm", "Normalization"),
    ("fusion", "additive", "additive fusion", "Output fusion"),
    ("budget_control", "aux_loss", "auxiliary loss", "Budget control"),
    ("pmask", False, "w/o P-mask", "Training schedule"),
)
COMPONENT_ORDER = ("–", "Branch param.", "Normalization", "Output fusion", "Budget control", "Training schedule")


def _ignored(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in IGNORED)


def group_key(config: dict) -> str:
    return json.dumps({k: v for k, v in flatten(config).items() if not _ignored(k)}, sort_keys=True, default=str)


def describe_attention(att: dict) -> tuple[str, list[str], str]:
    """(model name as the paper writes it, LoGo variant labels, ablation component) of an attention config."""
    kind = att.get("kind")
    logo_layers = kind == "logo" or (kind == "inter_layer" and att.get("global_layer") == "logo")
    name = "inter-layer-H + LoGo" if kind == "inter_layer" and logo_layers else MODEL_NAMES.get(kind, str(kind))
    hits = [(label, comp) for f, val, label, comp in VARIANTS if logo_layers and att.get(f) == val]
    comps = [c for _, c in hits]
    component = "Normalization" if "Normalization" in comps else (comps[0] if comps else "–")
    return name, [label for label, _ in hits], component


def size_label(model: dict) -> str:
    name = str(model.get("name", "?"))
    return name.upper() if name[:1].isdigit() else name


@dataclass
class Stat:
    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> Optional[float]:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> Optional[float]:
        return statistics.stdev(self.values) if self.n >= 2 else None


@dataclass
class Cell:
    key: str
    runs: list[Run]
    values: list[dict]  # per run, run_values()
    size: str
    model: str  # Transformer | LoGo | inter-layer-H | ...
    variants: list[str]
    component: str
    stage: str
    budget: Optional[float]
    kind: str
    family: Optional[str]
    extra: str = ""  # config keys that tell this cell from another with the same labels

    @property
    def name(self) -> str:
        """The model column: the paper's model name plus LoGo variants and disambiguating config keys."""
        s = self.model + (f" ({', '.join(self.variants)})" if self.variants else "")
        return s + (f" [{self.extra}]" if self.extra else "")

    @property
    def row(self) -> str:
        """Size, model and budget: tells the cell from the others of its stage."""
        b = f" (budget {self.budget:g})" if self.budget is not None else ""
        return f"{self.size} {self.name}{b}"

    @property
    def label(self) -> str:
        return f"{self.row}, {self.stage}"

    @property
    def params(self) -> float:
        return self.stat("params_total").mean or 0.0

    @property
    def n(self) -> int:
        return len(self.runs)

    def stat(self, key: str) -> Stat:
        return Stat([v[key] for v in self.values if key in v])

    def keys(self) -> set[str]:
        return {k for v in self.values for k in v}


def make_cells(runs: list[Run], values: list[dict]) -> tuple[list[Cell], list[str]]:
    """Group runs into cells. A run with the same config and seed as one already grouped is skipped (its
    directory is a copy or a re-run); returns (cells, skip messages)."""
    groups: dict[str, list[int]] = {}
    skipped = []
    for i, run in enumerate(runs):
        members = groups.setdefault(group_key(run.config), [])
        twin = next((j for j in members if runs[j].seed == run.seed), None)
        if twin is not None:
            skipped.append(f"skipped {run.path}: same config and seed (train.seed={run.seed[0]}, "
                           f"data.seed={run.seed[1]}) as {runs[twin].path}")
            continue
        members.append(i)
    cells = []
    for key, members in groups.items():
        cfg = runs[members[0]].config
        model, variants, component = describe_attention(cfg["attention"])
        budgets = {values[i].get("budget") for i in members}
        cells.append(Cell(key=key, runs=[runs[i] for i in members], values=[values[i] for i in members],
                          size=size_label(cfg["model"]), model=model, variants=variants, component=component,
                          stage=str(cfg["stage"].get("name", "?")), budget=budgets.pop() if len(budgets) == 1 else None,
                          kind=str(cfg["attention"].get("kind")), family=runs[members[0]].family))
    _disambiguate(cells)
    return cells, skipped


def _disambiguate(cells: list[Cell]) -> None:
    """Cells with equal labels (e.g. the same preset with another learning rate) get the config keys that differ."""
    by_label: dict[str, list[Cell]] = {}
    for c in cells:
        by_label.setdefault(c.label, []).append(c)
    for same in by_label.values():
        if len(same) < 2:
            continue
        flats = [json.loads(c.key) for c in same]
        differ = sorted(k for k in set().union(*flats) if len({json.dumps(f.get(k)) for f in flats}) > 1)
        for c, f in zip(same, flats):
            c.extra = ", ".join(f"{k}={f.get(k)}" for k in differ[:3]) + (", ..." if len(differ) > 3 else "")


@dataclass
class Comparison:
    table: str
    row: str
    baseline: str
    metric: str
    mean: float
    baseline_mean: float
    diff: float
    n: int
    baseline_n: int
    t: Optional[float]
    p: Optional[float]
    verdict: str
    extras: dict = field(default_factory=dict)


def compare(table: str, cell: Cell, base: Cell, key: str, alpha: float) -> Optional[Comparison]:
    """cell - baseline on one metric, and whether the difference exceeds the seed noise: Welch's t-test
    (scipy.stats.ttest_ind, equal_var=False) over the seeds of both cells, two-sided, at level alpha."""
    from scipy.stats import ttest_ind

    a, b = cell.stat(key), base.stat(key)
    if not a.n or not b.n:
        return None
    diff = a.mean - b.mean
    t = p = None
    better = metric(key).better
    direction = ""
    if better and diff != 0:
        direction = "better" if (diff < 0) == (better == "lower") else "worse"
    if a.n >= 2 and b.n >= 2:
        with warnings.catch_warnings():  # nearly equal values: scipy warns about precision, p is still returned
            warnings.simplefilter("ignore", RuntimeWarning)
            res = ttest_ind(a.values, b.values, equal_var=False)
        t, p = float(res.statistic), float(res.pvalue)
        if math.isnan(p) or (a.std == 0 and b.std == 0):  # both cells without any seed variance
            t = p = None
            verdict = "no difference" if diff == 0 else "n/a: no seed variance"
        elif p < alpha:
            verdict = f"{direction or 'different'}, exceeds seed noise"
        else:
            verdict = "within seed noise"
    else:
        verdict = f"{direction + ', ' if direction else ''}n/a: needs >= 2 seeds on both sides"
    return Comparison(table, cell.row, base.row, key, a.mean, b.mean, diff, a.n, b.n, t, p, verdict)
