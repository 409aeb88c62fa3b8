"""Shared fixtures for the training and config tests (small, fast settings on the embedded corpus)."""
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zygote


def _worker_threads() -> int:
    """CPU threads for one test process: this machine's cores shared out among pytest-xdist's workers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


# Under xdist, each worker and the processes it starts (train.py, torchrun ranks, mp.spawn) use the worker's share of
# the cores: more OpenMP threads than cores make the workers' spinning threads wait on each other. Set before torch
# starts its thread pool; an explicit OMP_NUM_THREADS is kept.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(_worker_threads()))

# The processes a worker starts keep the memory they free for their next allocations: the tiny model's 100k-token
# embedding, its gradient, its Adam moments and a checkpoint's buffers are blocks of 100 MiB and more, which glibc
# otherwise maps afresh (and the kernel zeroes page by page) at every allocation; about 8% less CPU per training
# run. An explicit GLIBC_TUNABLES is kept.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296")

import torch  # noqa: E402

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, Triton kernels run under Triton's CPU interpreter (set before anything imports triton kernels).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]

# A few tiny steps: 4 sequences of 64 tokens per step, 2 micro-batches of 2 (grad accumulation 2); the paper's
# sign controller (the thresholds move by gamma a step, which several tests check).
TINY_RUN = ["model=tiny", "stage.seq_len=64", "stage.global_batch_tokens=256", "train.micro_batch=2",
            "logging.interval=1", "logging.progress_bar=false", "logging.heatmap_interval=1000",
            "attention.window=16", "attention.gamma=0.01", "attention.budget_control=threshold", "eval.tokens=512"]


# pytest-xdist deals whole files to the workers (--dist loadfile), and the run ends when the last file does. The files
# that take longest are dealt first, longest first (about their seconds in the README's command on a 2-core CPU:
# multi-process tests, training runs, the Triton interpreter's kernels), so that the short files fill the end.
LONG_FILES = ("test_faults.py", "test_triton_kernels.py", "test_parallel.py",  # 290, 220, 215
              "test_faults_ranks.py", "test_export.py", "test_train_distributed.py", "test_checkpoint_async.py",  # 120
              "test_study.py", "test_cli_outputs.py", "test_logo_branches.py", "test_train_loop.py",  # 100-75
              "test_rope_transform.py", "test_report_sweep.py", "test_eval.py",  # 75
              "test_config_compose.py", "test_benchmarks_dp.py", "test_train_mix.py", "test_budget.py",  # 55-35
              "test_parallelize.py", "test_attention_ops.py", "test_context_fuse.py",  # 35-30
              "test_train_dashboards.py", "test_config_errors.py", "test_report_inputs.py", "test_launch.py")  # 25-20


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist would order the files by their number of tests instead


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order


def train_cmd(*overrides, nproc: int = 1, fault: bool = False) -> list:
    """The train.py command line; `fault`: through tests/fault_entry.py (a fault injected per LOGO_FAULT)."""
    script = str(ROOT / "tests" / "fault_entry.py") if fault else str(ROOT / "train.py")
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                script, *overrides]
    return [sys.executable, script, *overrides]


def terminal_sigint() -> None:
    """preexec_fn of a child that is sent Ctrl-C: SIGINT at its default, as under a terminal. A suite started in the
    background (`pytest ... &`, nohup) passes SIGINT ignored to its children, and Python then never raises
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def train_env(nproc: int = 1, env=None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
            "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}


def run_train(*overrides, nproc: int = 1, timeout: int = 300, check: bool = True, env=None, cwd=None,
              fault: bool = False):
    """Run train.py in a subprocess (one process: a fork of the test zygote, `zygote.py`); returns the
    CompletedProcess (stdout/stderr as text). Under torchrun (nproc > 1), torchrun is the fork, and on a machine
    without CUDA its ranks are forks of it (`--run-path --start-method=fork`: they start with the trainer's modules
    imported) unless `fault`: a fault's ranks are fresh interpreters, as a user's are."""
    cmd = train_cmd(*overrides, nproc=nproc, fault=fault)
    if nproc > 1 and not fault and zygote.usable(cmd):  # usable: no CUDA here
        cmd[4:4] = ["--run-path", "--start-method=fork"]
    p = zygote.run(cmd, env=train_env(nproc, env), cwd=cwd or ROOT, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py {' '.join(overrides)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
                             f"\n--- stderr\n{p.stderr[-4000:]}")
    return p


def run_python(cmd: list, *, env=None, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` of a `python script ...` or `python -m module ...` command,
    as a fork of the test zygote (`zygote.py`); env: os.environ unless given, cwd: the checkout unless given."""
    return zygote.run(cmd, env=dict(os.environ if env is None else env), cwd=cwd or ROOT, timeout=timeout)


def start_fault_train(*overrides, fault: str = "", release=None):
    """train.py through tests/fault_entry.py in the background (a fork of the test zygote, `zygote.start`; its output
    as text at the end): LOGO_FAULT=fault when given; `release`: a path whose creation ends the fault's sleep
    (LOGO_FAULT_RELEASE)."""
    env = {**({"LOGO_FAULT": fault} if fault else {}), **({"LOGO_FAULT_RELEASE": str(release)} if release else {})}
    return zygote.start(train_cmd(*overrides, fault=True), env=train_env(env=env), cwd=ROOT)


def read_metrics(run_dir) -> list:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


@contextlib.contextmanager
def scratch_dir(tmp_path_factory, name: str):
    """A temp dir for a module or session fixture, removed when the fixture ends.

    Training runs leave checkpoints of 0.3-1 GiB (the tiny model's 100k-token embedding and its Adam moments);
    pytest keeps a fixture's temp dirs to the end of the session, which adds up to tens of GB over the suite.
    Function-scoped `tmp_path` dirs of passing tests go right away (tmp_path_retention_policy in pyproject.toml).
    """
    d = tmp_path_factory.mktemp(name)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def default_corpus():
    """Build (or reuse) the embedded default corpus once per session."""
    from data.default_corpus import ensure_default_corpus
    return ensure_default_corpus()


# The checkpoint and fault tests' reference: 5 steps, a synchronous save every 2 steps (kept) and at the end.
CKPT_STEPS = 5
CKPT_ARGS = [*TINY_RUN, f"train.steps={CKPT_STEPS}", "checkpoint.interval=2", "checkpoint.keep=10", "eval.interval=0"]
SLOW_BOX_TIMEOUT = 900  # seconds per training run: the shared CPU box can be slow


@pytest.fixture(scope="session")
def sync_reference(tmp_path_factory, default_corpus):
    """CKPT_ARGS with synchronous saves, uninterrupted: checkpoints at steps 2, 4, 5."""
    with scratch_dir(tmp_path_factory, "sync_reference") as d:
        run_train(*CKPT_ARGS, "checkpoint.async_mode=none", f"run.dir={d}", timeout=SLOW_BOX_TIMEOUT)
        yield d


def same_rows(a: list, b: list, steps) -> None:
    """Training records equal (losses, LR, grad norm, thresholds, ratios), timings and checkpoint figures aside."""
    ra = {r["step"]: r for r in a if "loss" in r}
    rb = {r["step"]: r for r in b if "loss" in r}
    assert sorted(rb) == list(steps)
    for s in steps:
        for k, v in ra[s].items():
            if k in ("tokens_per_s", "memory_gib") or k.startswith(("step_time", "checkpoint/")):
                continue
            assert rb[s][k] == v, (s, k, v, rb[s].get(k))


def wait_for_train(cond, proc, timeout: float = SLOW_BOX_TIMEOUT):
    """Poll cond() until true while the train.py process `proc` runs; fail if it exits first or on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited {proc.returncode} early:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("timed out")


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of the worker process of `rank` started by the torchrun process `launcher`."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


def logged(run_dir, step) -> bool:
    """metrics.jsonl holds a training row of step `step` or later."""
    m = Path(run_dir) / "metrics.jsonl"
    return m.exists() and any(r.get("step", 0) >= step for r in read_metrics(run_dir) if "loss" in r)


def close_in_norm(out, want, rtol, atol, what):
    """Kernel vs reference, in float64: no non-finite values and ||out - want|| <= rtol ||want|| + atol sqrt(n)."""
    out, want = out.double(), want.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = (out - want).norm().item()
    bound = rtol * want.norm().item() + atol * math.sqrt(want.numel())
    assert err <= bound, f"{what}: ||diff|| {err:.3e} > {bound:.3e} (||ref|| {want.norm().item():.3e})"


@contextlib.contextmanager
def kept_for_backward():
    """Within the block, records the distinct storages autograd keeps for the backward: yields a dict
    {storage pointer: bytes}; sum its values for the bytes kept."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield storages


def logo_layer_step(layer, fn=None, B: int = 2, T: int = 24):
    """One forward and backward (loss: sum of squares) of a LoGo attention layer (or `fn`, e.g. its compiled self)
    on a (B, T) float32 batch of several documents, some crossing the row boundary -> out (detached), the input's
    gradient, the routing stats. The layer's parameters keep their gradients."""
    from logo.model.layers import PackedSeqs, rope_cos_sin
    device = layer.wq.weight.device
    x = torch.randn(B, T, layer.wq.weight.shape[1], device=device,
                    generator=torch.Generator(device).manual_seed(3), requires_grad=True)
    seqs = PackedSeqs.build(B, T, device, torch.tensor([0, 10, 24, 31, 48], dtype=torch.int32, device=device))
    cos, sin = rope_cos_sin(T, layer.head_dim, 10000.0, device)
    out, _, stats = (layer if fn is None else fn)(x, cos, sin, seqs)
    out.square().sum().backward()
    return out.detach(), x.grad, stats


def _forked_rank(rank, fn, *args):
    if "torch._dynamo" in sys.modules:  # the compile state of a new process: nothing compiled by earlier tests
        sys.modules["torch._dynamo"].reset()
    fn(rank, *args)


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`: fn(rank, *args) in `nprocs` processes, joined; a rank that
    fails fails the caller. The ranks are forks of this process where that is safe (no CUDA context, one CPU thread:
    the xdist workers): a spawned rank spends seconds importing torch and the test module again."""
    import torch.multiprocessing as mp
    if torch.get_num_threads() == 1 and not torch.cuda.is_initialized():
        mp.start_processes(_forked_rank, args=(fn, *args), nprocs=nprocs, join=True, start_method="fork")
    else:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)


def free_port() -> int:
    """A free TCP port on localhost (for a process group's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
