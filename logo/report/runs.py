"""Find run directories and read what each one holds: config.yaml, plan.json, metrics.jsonl, eval/*.json.

Every directory that cannot be used becomes one `Skip` line naming the directory and the reason; nothing here
raises past `load_run`.
"""
from __future__ import annotations

import glob
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

RUN_FILES = ("config.yaml", "plan.json", "metrics.jsonl")
NOT_RUNS = {"checkpoints", "wandb", "tensorboard", "plots", "eval", "__pycache__"}  # never searched for runs
STILL_RUNNING_S = 30 * 60  # an incomplete run whose metrics.jsonl changed more recently is called "still running"
EVAL_KINDS = ("perplexity", "ruler", "lm_eval", "synthetic")


class Skip(Exception):
    """This directory is not used; the message says why (one line)."""


@dataclass
class Run:
    path: Path
    config: dict  # the resolved config.yaml
    plan: dict  # plan.json
    records: list[dict]  # metrics.jsonl, superseded (pre-resume) records removed
    evals: dict[str, dict] = field(default_factory=dict)  # eval/<name>.json by name (perplexity, synthetic_<label>)
    notes: list[str] = field(default_factory=list)  # remarks for the run's "used" line
    complete: bool = True

    @property
    def train_records(self) -> list[dict]:
        return [r for r in self.records if "loss" in r]

    @property
    def last_step(self) -> int:
        return self.train_records[-1]["step"]

    @property
    def experiment(self) -> str:
        return self.config.get("experiment") or ""

    @property
    def family(self) -> Optional[str]:
        return self.experiment.split("/")[0] if self.experiment else None

    @property
    def device(self) -> Optional[str]:
        """Where the run trained, "cuda" or "cpu", from its config, plan and metrics; None when they do not say."""
        asked = (self.config.get("parallel") or {}).get("device")
        if asked in ("cpu", "cuda"):
            return asked
        if any("mfu" in r for r in self.train_records):  # the trainer logs MFU on GPUs only
            return "cuda"
        kernels = str(self.plan.get("attention_kernels") or "")
        backend = (self.config.get("attention") or {}).get("backend", "auto")
        if kernels.startswith("flash"):  # FlashAttention-4 runs on CUDA only
            return "cuda"
        if kernels and backend == "auto":  # auto picks the PyTorch reference exactly when not on CUDA
            return "cpu" if kernels.startswith("reference") else "cuda"
        return None

    @property
    def seed(self) -> tuple:
        return (self.config.get("train", {}).get("seed"), self.config.get("data", {}).get("seed"))


def find_run_dirs(args: list[str]) -> tuple[list[Path], list[str]]:
    """Expand the command-line arguments (directories or globs) into candidate run directories.

    A directory holding any of config.yaml / plan.json / metrics.jsonl is a candidate; any other directory is
    searched below for candidates (a sweep root such as runs/). Returns (candidates, skip messages)."""
    found: list[Path] = []
    skipped: list[str] = []
    for arg in args:
        paths = sorted(glob.glob(arg)) if any(c in arg for c in "*?[") else [arg]
        if not paths:
            skipped.append(f"skipped {arg}: the pattern matches nothing")
        for p in map(Path, paths):
            if not p.exists():
                skipped.append(f"skipped {p}: no such file or directory")
            elif not p.is_dir():
                skipped.append(f"skipped {p}: not a run directory (a file; pass the directory that holds it)")
            elif _is_candidate(p):
                found.append(p)
            else:
                below = _search(p)
                if not below:
                    skipped.append(f"skipped {p}: not a run directory (no config.yaml, plan.json or metrics.jsonl "
                                   f"in it or below it)")
                found.extend(below)
    unique, seen = [], set()
    for p in found:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique, skipped


def _is_candidate(d: Path) -> bool:
    return any((d / f).is_file() for f in RUN_FILES)


def _search(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, _ in os.walk(root):
        d = Path(dirpath)
        if d != root and _is_candidate(d):
            out.append(d)
            dirnames[:] = []  # a run's own subfolders hold no runs
            continue
        dirnames[:] = sorted(n for n in dirnames if n not in NOT_RUNS and not n.startswith("."))
    return out


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise Skip(f"{what} cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise Skip(f"{what} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise Skip(f"{what} is not a JSON object")
    return data


def read_config(d: Path) -> dict:
    path = d / "config.yaml"
    if not path.is_file():
        raise Skip("no config.yaml (not a directory written by train.py)")
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise Skip(f"config.yaml cannot be read ({e})") from None
    except yaml.YAMLError as e:
        raise Skip(f"config.yaml is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict) or not all(isinstance(cfg.get(k), dict) for k in ("model", "attention", "stage")):
        raise Skip("config.yaml has no model / attention / stage sections (not a train.py run config)")
    return cfg


def read_records(path: Path) -> tuple[list[dict], list[str]]:
    """metrics.jsonl records in step order; a torn last line (a run writing it right now) is dropped, and records
    superseded by a resume (a later record with a smaller step) are removed. Returns (records, notes)."""
    notes = []
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as e:
        raise Skip(f"metrics.jsonl cannot be read ({e})") from None
    records: list[dict] = []
    superseded = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                notes.append("the last line of metrics.jsonl is incomplete and was ignored")
                continue
            raise Skip(f"metrics.jsonl line {n} is not valid JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise Skip(f"metrics.jsonl line {n} has no integer 'step'")
        if records and rec["step"] < records[-1]["step"]:
            keep = [r for r in records if r["step"] < rec["step"]]
            superseded += len(records) - len(keep)
            records = keep
        records.append(rec)
    if superseded:
        notes.append(f"resumed: {superseded} records logged after the checkpoint it resumed from were dropped")
    return records, notes


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def load_run(d: Path, include_incomplete: bool = False, now: Optional[float] = None) -> Run:
    """Read one run directory; raises Skip with the reason when it cannot be used."""
    cfg = read_config(d)
    if not (d / "plan.json").is_file():
        raise Skip("no plan.json (train.py writes it before the first step)")
    plan = _read_json(d / "plan.json", "plan.json")
    if not isinstance(plan.get("steps"), int):
        raise Skip("plan.json has no integer 'steps'")
    metrics = d / "metrics.jsonl"
    if not metrics.is_file():
        if cfg.get("dry_run"):
            raise Skip("a dry run (dry_run=true): no metrics")
        raise Skip("no metrics.jsonl: the run has not logged a step (not started, or failed at start-up)")
    records, notes = read_records(metrics)
    run = Run(path=d, config=cfg, plan=plan, records=records, notes=notes)
    train = run.train_records
    if not train:
        raise Skip("metrics.jsonl has no training records yet")
    for r in train:
        if isinstance(r["loss"], bool) or not isinstance(r["loss"], (int, float)):
            raise Skip(f"metrics.jsonl step {r['step']} has a non-numeric loss {r['loss']!r}")
        if not math.isfinite(r["loss"]):
            raise Skip(f"diverged: loss {r['loss']} at step {r['step']}")
    last, steps = run.last_step, plan["steps"]
    if last < steps:
        run.complete = False
        reason = _incomplete_reason(d, last, steps, now)
        if not include_incomplete:
            raise Skip(f"{reason}; --include-incomplete uses it")
        run.notes.append(reason)
    run.evals = read_evals(d, run)
    return run


def _incomplete_reason(d: Path, last: int, steps: int, now: Optional[float]) -> str:
    final = d / "final_metrics.json"
    if final.is_file():
        try:
            if json.loads(final.read_text()).get("step") == last:
                return (f"stopped at step {last} of {steps} (a stop signal or preemption; re-running its command "
                        f"resumes it)")
        except (OSError, ValueError, AttributeError):  # unreadable, not UTF-8, not JSON: the age decides
            pass
    age = (now if now is not None else time.time()) - (d / "metrics.jsonl").stat().st_mtime
    state = "still running" if age < STILL_RUNNING_S else "stopped or failed"
    return f"incomplete: step {last} of {steps}, metrics.jsonl last written {_age(age)} ago ({state})"


def read_evals(d: Path, run: Run) -> dict[str, dict]:
    """eval/<name>.json files by name, each with its "kind" (perplexity, ruler, lm_eval: one file each, named
    as the kind; synthetic: synthetic_<label>.json per task); unreadable or unknown ones become notes."""
    out: dict[str, dict] = {}
    ev = d / "eval"
    if not ev.is_dir():
        return out
    for path in sorted(ev.glob("*.json")):
        try:
            data = _read_json(path, f"eval/{path.name}")
        except Skip as e:
            run.notes.append(f"{e}: ignored")
            continue
        kind = data.get("kind", path.stem)
        if kind not in EVAL_KINDS or not isinstance(data.get("results"), (dict, list)):
            run.notes.append(f"eval/{path.name}: unknown kind {kind!r} or no 'results': ignored")
            continue
        step = data.get("step")
        if isinstance(step, int) and step != run.last_step:
            run.notes.append(f"eval/{path.name} is of step {step}, the run's last step is {run.last_step}")
        out[path.stem if kind == "synthetic" else kind] = {**data, "kind": kind}
    return out
