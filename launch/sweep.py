"""Submit a family of experiment presets (or one preset) to SLURM as array jobs; run through launch/sweep.sh.

Every preset is composed with Hydra exactly as train.py composes it, which gives its run name, run directory,
`checkpoint.init_from` and SLURM resources (its `launch:` block). Presets whose init_from is the run directory
of another preset of the sweep are chained stages (context extension). The tasks are grouped into one
`sbatch --array` per stage and resource set; a chained stage's tasks reuse the task ids of their parents and
wait for them with `--dependency=aftercorr:<parent array>`, so each starts as soon as its own parent task has
succeeded. Each array's tasks read their train.py arguments from a task list written next to the logs.
A bad input or a write error is one line and exit code 2, Ctrl-C one line and exit code 130 (naming the arrays
already submitted, if any); the sweep's folder is new, nothing is replaced.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's logo package, as train.py (run from ROOT) uses it

from data.outputs import INTERRUPTED  # noqa: E402

EXPERIMENTS = ROOT / "conf" / "experiment"
SBATCH_SCRIPT = "launch/slurm_train.sbatch"


class SweepError(Exception):
    pass


@dataclass(frozen=True)
class Resources:
    nodes: int
    gpus_per_node: int
    procs_per_node: int  # resolved: > 0
    cpus_per_node: int
    time: str


@dataclass
class Preset:
    name: str  # <family>/<file stem>
    run_name: str
    default_dir: Path  # absolute: where train.py puts the run without the sweep's relocation
    init_from: Optional[Path]  # absolute, or None
    stage: str
    resources: Resources


@dataclass
class Task:
    preset: Preset
    seed: Optional[int]
    run_name: str
    run_dir: Path
    args: list
    parent: Optional[Task] = None
    array: Optional[Array] = None
    index: int = -1

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    @property
    def id(self) -> str:
        return f"{self.array.job}_{self.index}"


@dataclass
class Array:
    depth: int
    resources: Resources
    parent: Optional[Array]
    tasks: list = field(default_factory=list)
    job: str = ""

    def free(self, index: int) -> bool:
        return all(t.index != index for t in self.tasks)


def list_presets(target: str) -> list[str]:
    """`family` -> every preset of conf/experiment/family/, `family/name` -> that preset."""
    families = sorted(p.name for p in EXPERIMENTS.iterdir() if p.is_dir())
    if (EXPERIMENTS / target).is_dir():
        return sorted(f"{target}/{f.stem}" for f in (EXPERIMENTS / target).glob("*.yaml"))
    if (EXPERIMENTS / f"{target}.yaml").is_file():
        return [target]
    raise SweepError(f"no experiment family '{target}' and no preset conf/experiment/{target}.yaml "
                     f"(families: {' '.join(families)})")


def compose(names: list[str], overrides: list[str]) -> list[Preset]:
    """The presets as train.py sees them (validated): run name, directories, stage and resources."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from logo.run.config import register_configs, to_dataclass
    from logo.train.plan import run_name

    register_configs()
    presets = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for preset in names:
            try:
                cfg = to_dataclass(hydra_compose("config", overrides=[f"experiment={preset}", *overrides]))
            except Exception as e:  # noqa: BLE001 - ConfigError or a Hydra/OmegaConf override error: one line
                raise SweepError(f"preset {preset}: {' '.join(ln.strip() for ln in str(e).splitlines())}") from None
            name = run_name(cfg, cfg.model.attention.kind)
            la = cfg.launch
            procs = la.procs_per_node or la.gpus_per_node or 1
            presets.append(Preset(preset, name, _abs(cfg.run.dir or f"runs/{name}"),
                                  _abs(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else None,
                                  cfg.stage.name, Resources(la.nodes, la.gpus_per_node, procs, la.cpus_per_node,
                                                            la.time)))
    return presets


def _abs(path: str) -> Path:
    return Path(os.path.normpath(ROOT / path))


def check_overrides(overrides: list[str], n_presets: int, seeds: list) -> None:
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "\t" in o or "\n" in o:
            raise SweepError(f"override {o!r} contains a tab or newline")
        if key == "experiment":
            raise SweepError(f"override {o!r}: the sweep sets experiment=<preset> itself")
        if key in ("run.dir", "run.name") and (n_presets > 1 or seeds):
            raise SweepError(f"override {o!r} would give several runs one directory; use --runs-dir DIR")
        if key in ("train.seed", "data.seed") and seeds:
            raise SweepError(f"override {o!r} conflicts with --seeds (which sets train.seed and data.seed)")


def make_tasks(presets: list[Preset], overrides: list[str], seeds: list, runs_dir: Optional[Path]) -> list:
    """One task per preset and seed, each with its train.py arguments; chained stages point at their parents."""
    tasks, by_dir = [], {}
    for p in presets:
        for seed in seeds or [None]:
            name = p.run_name if seed is None else f"{p.run_name}-seed{seed}"
            args = [f"experiment={p.name}", *overrides]
            if seed is not None:
                args += [f"train.seed={seed}", f"data.seed={seed}", f"run.name={name}"]
            run_dir = p.default_dir if seed is None else p.default_dir.parent / name
            if runs_dir is not None:
                run_dir = runs_dir / name
            if run_dir != p.default_dir:
                args.append(f"run.dir={run_dir}")
            t = Task(p, seed, name, run_dir, args)
            tasks.append(t)
            by_dir[(p.default_dir, seed)] = t
    for t in tasks:
        src = t.preset.init_from
        if src is None:
            continue
        for (d, seed), parent in by_dir.items():
            if seed == t.seed and parent is not t and (src == d or d in src.parents):
                t.parent = parent
                t.args.append(f"checkpoint.init_from={parent.run_dir / src.relative_to(d)}")
    return sorted(tasks, key=lambda t: t.depth)  # stable: presets in file order within a stage


def make_arrays(tasks: list[Task]) -> list[Array]:
    """One array per stage and resource set; a chained task takes its parent's task id (for aftercorr)."""
    arrays = []
    for t in tasks:
        parent_array = t.parent.array if t.parent else None
        for a in arrays:
            if (a.depth, a.resources, a.parent) == (t.depth, t.preset.resources, parent_array) and (
                    parent_array is None or a.free(t.parent.index)):
                break
        else:
            a = Array(t.depth, t.preset.resources, parent_array)
            arrays.append(a)
        t.index = len(a.tasks) if parent_array is None else t.parent.index
        t.array = a
        a.tasks.append(t)
    return arrays


def sbatch_command(a: Array, name: str, tasks_file: Path, log_dir: Path, throttle: int) -> list[str]:
    r = a.resources
    ids = ",".join(str(t.index) for t in a.tasks) + (f"%{throttle}" if throttle else "")
    cmd = ["sbatch", "--parsable", f"--array={ids}", f"--job-name={name}", f"--nodes={r.nodes}",
           f"--gpus-per-node={r.gpus_per_node}", f"--cpus-per-task={r.cpus_per_node}", f"--time={r.time}",
           f"--output={log_dir}/%x-%A_%a.out"]
    if a.parent is not None:
        cmd.append(f"--dependency=aftercorr:{a.parent.job}")
    cmd += shlex.split(os.environ.get("SBATCH_ARGS", ""))
    return cmd + [SBATCH_SCRIPT, "--tasks", str(tasks_file), "--nproc-per-node", str(r.procs_per_node)]


def submit(arrays: list[Array], family: str, sweep_dir: Path, log_dir: Path, throttle: int,
           records: list) -> list:
    """sbatch every array, appending a record per submitted one to `records` (as they go: an interruption still
    knows what was submitted)."""
    sweep_dir.mkdir(parents=True)
    env = {**os.environ, "LOGO_RESTART_DIR": str(log_dir / "restarts")}
    for k, a in enumerate(arrays):
        stage = a.tasks[0].preset.stage
        name = f"logo-{family}-{stage}"
        tasks_file = sweep_dir / f"array{k}-{stage}.tasks"
        tasks_file.write_text("".join("\t".join([str(t.index), *t.args]) + "\n" for t in a.tasks))
        cmd = sbatch_command(a, name, tasks_file, log_dir, throttle)
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            done = " ".join(r["job"] for r in records)
            raise SweepError(f"sbatch failed ({p.stderr.strip() or p.returncode}) for {tasks_file}"
                             + (f"; already submitted: {done} (scancel them or resubmit)" if done else ""))
        a.job = p.stdout.strip().split(";")[0]
        records.append({"job": a.job, "name": name, "tasks_file": str(tasks_file), "command": cmd,
                        "after": a.parent.job if a.parent else None})
    return records


def parse_seeds(text: str) -> list[int]:
    """--seeds "0,1,2" -> [0, 1, 2]; SweepError naming the value otherwise."""
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: give comma-separated integers, e.g. 0,1,2") from None


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(prog="launch/sweep.sh", description=__doc__.splitlines()[0],
                                 epilog="Everything after `--` is passed to every train.py.")
    ap.add_argument("target", help="a family (conf/experiment/<family>/) or one preset (<family>/<name>)")
    ap.add_argument("--seeds", default="", help="e.g. 0,1,2: each preset once per seed (train.seed and "
                    "data.seed), into run directories <run name>-seed<k>")
    ap.add_argument("--throttle", type=int, default=0, help="at most N tasks of each array at once (%%N)")
    ap.add_argument("--runs-dir", default="", help="put the run directories here (default: runs/)")
    ap.add_argument("--log-dir", default="logs", help="SLURM output, task lists and restart counts (default: logs)")
    split = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:split])
    args.overrides = argv[split + 1:]
    try:
        args.seed_list = parse_seeds(args.seeds) if args.seeds else []
    except SweepError as e:
        ap.error(str(e))
    if args.throttle < 0:
        ap.error(f"--throttle {args.throttle}: must be >= 0")
    return args


def submitted(records: list) -> str:
    return f"; already submitted: {' '.join(r['job'] for r in records)} (scancel them or resubmit)" if records else ""


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    records: list = []
    try:
        names = list_presets(args.target)
        check_overrides(args.overrides, len(names), args.seed_list)
        presets = compose(names, args.overrides)
        runs_dir = Path(os.path.abspath(args.runs_dir)) if args.runs_dir else None
        log_dir = Path(os.path.abspath(args.log_dir))
        tasks = make_tasks(presets, args.overrides, args.seed_list, runs_dir)
        arrays = make_arrays(tasks)
        family = args.target.split("/")[0]
        sweep_dir = log_dir / "sweeps" / f"{args.target.replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
        submit(arrays, family, sweep_dir, log_dir, args.throttle, records)
        rows = [{"task": t.id, "preset": t.preset.name, "seed": t.seed, "run_dir": str(t.run_dir),
                 "after": t.parent.id if t.parent else None} for t in tasks]
        (sweep_dir / "sweep.json").write_text(json.dumps({"target": args.target, "seeds": args.seed_list,
                                                          "overrides": args.overrides, "arrays": records,
                                                          "tasks": rows}, indent=1))
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {' '.join(str(e).split())}{submitted(records)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted{submitted(records)}", file=sys.stderr)
        return INTERRUPTED
    for r in rows:
        seed = f" seed={r['seed']}" if r["seed"] is not None else ""
        print(f"{r['task']} {r['preset']}{seed} {r['run_dir']}" + (f" after {r['after']}" if r["after"] else ""))
    print(f"# task lists and sweep.json in {sweep_dir}; watch: squeue -j {','.join(r['job'] for r in records)}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
