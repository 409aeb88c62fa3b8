"""A whole controlled comparison on the GPUs of one node, in one command: train every preset of a family once per
seed, evaluate every run, write the family's report (docs/mini.md).

    python -m launch.study mini [--size mini|tiny] [--seeds 0,1,2] [--gpus N] [--runs-per-gpu K] [--runs-dir DIR]
                                [--out DIR] [--log-dir DIR] [-- train.py overrides]

Runs are composed as launch/sweep.sh composes them (run names `<run name>-seed<k>`, `train.seed` and `data.seed`
per seed). One run per GPU (CUDA_VISIBLE_DEVICES; --runs-per-gpu K: K at a time on each), queued when there are
more runs than that; without GPUs
(or --gpus 0) one after another on the CPU. A run's evaluations (launch/study_eval.py) follow its training on
the same GPU; the report (`python -m logo.report RUN... --family F`) comes last. Every step appends to its own
log under --log-dir and prints one line when it starts and one when it ends. A finished run is not retrained
(train.py finds it complete and exits; an unfinished one resumes from its last checkpoint), so the same command
picks up where an interrupted one stopped. A failed step is one line naming its log; the other runs go on, and
the command exits 2 without a report. Bad arguments: one line, exit 2. Ctrl-C (or SIGTERM): the running steps
are stopped (train.py saves a checkpoint on SIGTERM), one line, exit 130.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.outputs import INTERRUPTED  # noqa: E402
from launch.sweep import SweepError, check_overrides, compose, list_presets, make_tasks, parse_seeds  # noqa: E402

# --size: train.py overrides after the preset's own settings (the user's `--` overrides come after these).
# tiny: the same presets at a CPU size (a few steps of the tiny model at 256 tokens), for trying the command
# and for the test suite; its own stage name keeps its run directories apart from the real ones.
SIZES = {
    "mini": [],
    "tiny": ["model=tiny", "attention.window=16", "train.compile=false", "stage.name=mini_tiny", "stage.seq_len=256",
             "stage.tokens=0", "stage.global_batch_tokens=512", "train.steps=2", "train.micro_batch=2", "checkpoint.interval=2",
             "eval.interval=0", "logging.interval=1", "logging.ratio_window=0", "logging.heatmap_interval=1000",
             # the synthetic sources' episodes fit 256 tokens (mix_long_range's sources 1-5: the near copy and
             # recall, 256-token episodes already; recall, needles, copy)
             "data.sources.1.span=16", "data.sources.2.pairs=4", "data.sources.2.queries=4",
             "data.sources.3.pairs=8", "data.sources.3.queries=8", "data.sources.4.needles=2",
             "data.sources.4.distractors=2", "data.sources.5.span=16"],
}
STOP_GRACE_S = 60  # after SIGTERM, how long a step may take to save and exit before it is killed


class StudyError(Exception):
    pass


class ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise ArgError(message)


@dataclass
class Step:
    kind: str  # train | eval | report
    cmd: list
    log: Path


@dataclass
class Job:
    """Steps that run one after another on one slot (a GPU, or the CPU); a failed step ends the job."""
    name: str
    steps: list
    run_dir: Optional[Path] = None
    failed: Optional[Step] = None
    code: int = 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(prog="python -m launch.study", description=__doc__.splitlines()[0],
                 epilog="Everything after `--` is passed to every train.py.")
    ap.add_argument("family", help="a family of presets, conf/experiment/<family>/ (e.g. mini)")
    ap.add_argument("--size", default="mini", help=f"{' | '.join(SIZES)}: the presets as they are, or at a CPU size")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds: each preset once per seed")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one; 0: the CPU)")
    ap.add_argument("--runs-per-gpu", type=int, default=1,
                    help="runs sharing each GPU at once (small models leave a GPU idle between launches)")
    ap.add_argument("--runs-dir", default="runs", help="run directories go here (default: runs/)")
    ap.add_argument("--out", default="", help="the report folder (default: reports/<family>[-<size>])")
    ap.add_argument("--log-dir", default="", help="logs of every step (default: logs/study/<family>[-<size>])")
    split = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:split])
    a.overrides = argv[split + 1:]
    if a.size not in SIZES:
        raise ArgError(f"--size {a.size!r}: choose one of {', '.join(SIZES)}")
    try:
        a.seed_list = parse_seeds(a.seeds)
    except SweepError as e:
        raise ArgError(str(e)) from None
    if len(set(a.seed_list)) != len(a.seed_list):
        raise ArgError(f"--seeds {a.seeds!r}: a seed is repeated")
    if a.gpus is not None and a.gpus < 0:
        raise ArgError(f"--gpus {a.gpus}: must be >= 0")
    if a.runs_per_gpu < 1:
        raise ArgError(f"--runs-per-gpu {a.runs_per_gpu}: must be >= 1")
    return a


def gpu_slots(asked: Optional[int]) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each slot: the visible GPUs (the first `asked`), or [""] for the CPU."""
    import torch

    n = torch.cuda.device_count()
    if asked is not None and asked > n:
        raise StudyError(f"--gpus {asked}: only {n} GPU{'s' * (n != 1)} visible")
    use = n if asked is None else asked
    if use == 0:
        return [""]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(n)]
    return ids[:use]


def run_queue(jobs: list[Job], slots: list[str], start: Callable[[Step, str], subprocess.Popen],
              event: Callable[[str, Job, Step, str, Optional[int]], None], poll_s: float = 0.2) -> list[Job]:
    """Run every job on the slots (CUDA_VISIBLE_DEVICES values; a GPU listed twice runs two jobs at once): the next
    queued job takes the first free slot, a job's steps run one after another on its slot, a failed step (non-zero
    exit code) ends its job. `start(step, slot)` launches a step;
    `event(what, job, step, slot, code)` is told of every "start" and "end". Returns the jobs (failed/code set)."""
    queue, free = deque(jobs), list(range(len(slots)))  # slot indices: a GPU may hold several slots
    running: dict[int, tuple[Job, int, subprocess.Popen]] = {}  # slot index -> (job, step index, process)
    try:
        while queue or running:
            while queue and free:
                job, k = queue.popleft(), free.pop(0)
                running[k] = (job, 0, _start(job, 0, slots[k], start, event))
            time.sleep(poll_s)
            for k, (job, i, proc) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                step = job.steps[i]
                event("end", job, step, slots[k], code)
                if code != 0:
                    job.failed, job.code = step, code
                elif i + 1 < len(job.steps):
                    running[k] = (job, i + 1, _start(job, i + 1, slots[k], start, event))
                    continue
                del running[k]
                free.append(k)
                free.sort()
    except BaseException:
        stop([proc for _, _, proc in running.values()])
        raise
    return jobs


def _start(job: Job, i: int, slot: str, start, event) -> subprocess.Popen:
    event("start", job, job.steps[i], slot, None)
    return start(job.steps[i], slot)


def stop(procs: list) -> None:
    """SIGTERM to every running step (train.py saves a checkpoint and exits), SIGKILL after STOP_GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
        for p in procs:
            if p.poll() is None:
                p.kill()
        raise


def launcher(extra_env: Optional[dict] = None) -> Callable[[Step, str], subprocess.Popen]:
    """start(step, slot): the step's command in ROOT, its output to its log, CUDA_VISIBLE_DEVICES=slot, in its
    own session (a Ctrl-C at the terminal reaches the study, which stops the steps itself)."""
    def start(step: Step, slot: str) -> subprocess.Popen:
        step.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(extra_env or {}), "CUDA_VISIBLE_DEVICES": slot, "PYTHONUNBUFFERED": "1"}
        with open(step.log, "a") as log:  # a resumed run's log keeps its earlier attempts
            log.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(step.cmd)}\n")
            log.flush()
            return subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    return start


def plan_jobs(a: argparse.Namespace, log_dir: Path, runs_dir: Path) -> list[Job]:
    """One job per preset and seed: train.py, then the run's evaluations. Seed-major order: every arm's first seed
    before any arm's second, so a study stopped part-way has comparable runs of every arm."""
    if "/" in a.family:
        raise StudyError(f"{a.family!r} is one preset; a study runs a family (e.g. {a.family.split('/')[0]})")
    names = list_presets(a.family)
    overrides = [*SIZES[a.size], *a.overrides]
    check_overrides(a.overrides, len(names), a.seed_list)
    tasks = make_tasks(compose(names, overrides), overrides, a.seed_list, runs_dir)
    chained = [t.preset.name for t in tasks if t.parent is not None or t.preset.init_from is not None]
    if chained:
        raise StudyError(f"preset {chained[0]} starts from another run (checkpoint.init_from): a study runs "
                         f"single-stage families; use launch/sweep.sh {a.family} for chained stages")
    jobs = []
    for t in sorted(tasks, key=lambda t: t.seed):  # stable: the family's preset order within a seed
        train = Step("train", [sys.executable, "train.py", *t.args], log_dir / f"{t.run_name}.train.log")
        evals = Step("eval", [sys.executable, "-m", "launch.study_eval", str(t.run_dir), "--size", a.size],
                     log_dir / f"{t.run_name}.eval.log")
        jobs.append(Job(f"{t.preset.name} seed {t.seed}", [train, evals], t.run_dir))
    return jobs


def _was_complete(log: Path) -> bool:
    """train.py said the run was already complete (it trained nothing)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            return b"is already complete" in f.read()
    except OSError:
        return False


class Progress:
    """One line per step start and end, with the elapsed time of the study."""

    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self, what: str, job: Job, step: Step, slot: str, code: Optional[int]) -> None:
        where = f"GPU {slot}" if slot else "CPU"
        if what == "start":
            self.line(f"start {step.kind:<6} {job.name} on {where} (log {step.log})")
        elif code == 0:
            self.line(f"done  {step.kind:<6} {job.name}" + (" (already complete: not retrained)"
                                                             if step.kind == "train" and _was_complete(step.log) else ""))
        else:
            self.line(f"FAILED {step.kind} {job.name}: exit code {code}; see {step.log}")

    def line(self, text: str) -> None:
        s = int(time.monotonic() - self.t0)
        print(f"[{s // 60:3d}:{s % 60:02d}] {text}", flush=True)


def _terminated(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (a scheduler stopping the study): stop the steps as for Ctrl-C


def main(argv: list[str]) -> int:
    try:
        a = parse_args(argv)
        runs_dir = Path(os.path.abspath(a.runs_dir))
        tag = a.family if a.size == "mini" else f"{a.family}-{a.size}"
        log_dir = Path(os.path.abspath(a.log_dir or f"logs/study/{tag}"))
        out = Path(os.path.abspath(a.out or f"reports/{tag}"))
        jobs = plan_jobs(a, log_dir, runs_dir)
        gpus = gpu_slots(a.gpus)
        slots = gpus * a.runs_per_gpu if gpus != [""] else gpus  # every GPU's first run, then the second ones
    except (ArgError, SweepError, StudyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was started", file=sys.stderr)
        return INTERRUPTED
    progress = Progress()
    where = f"{len(gpus)} GPU{'s' * (len(gpus) != 1)}" if gpus != [""] else "the CPU"
    if gpus != [""] and a.runs_per_gpu > 1:
        where += f", {a.runs_per_gpu} at a time on each"
    progress.line(f"{a.family} ({a.size}): {len(jobs)} runs on {where}; logs in {log_dir}")
    start = launcher()
    try:
        run_queue(jobs, slots, start, progress)
        failed = [j for j in jobs if j.failed]
        if failed:
            progress.line(f"failed: {len(failed)} of {len(jobs)} runs ({', '.join(j.name for j in failed)}); "
                          f"no report")
            return 2
        report = Step("report", [sys.executable, "-m", "logo.report", *(str(j.run_dir) for j in jobs),
                                 "--family", a.family, "--out", str(out)], log_dir / "report.log")
        (job,) = run_queue([Job(f"of {len(jobs)} runs", [report])], [slots[0]], start, progress)
        if job.failed:
            return 2
    except KeyboardInterrupt:
        print("interrupted: the running steps were stopped (a training run saves a checkpoint first); the same "
              "command resumes", file=sys.stderr)
        return INTERRUPTED
    except OSError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    progress.line(f"report: {out}/report.md")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    sys.exit(main(sys.argv[1:]))
