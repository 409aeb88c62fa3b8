"""The training loop: one process or torchrun data-parallel FSDP2, resumable, with LoGo budget control.

A launch is `_open_run` (the checks against the run directory's checkpoints), `_build` (model, optimizer,
data, held-out evaluation, budget controller, train state), `_resume` (from the run's checkpoint or init_from),
then the run directory's lock and its plan.json and config.yaml (a launch refused by any check before writes
nothing), and `_run` (the loop). The step itself is `logo/train/step.py` (no host sync); the loop reads its results on
the host only at logging and checkpoint steps. Per step the host does: take the prefetched batch, launch the
step, one host-only (gloo) all-reduce of the stop flag when distributed.
"""
from __future__ import annotations

import gc
import logging
import math
import os
import resource
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from data.format import atomic_write_json
from data.loader import StepData
from data.prefetch import StepLoader
from logo.config import ConfigError
from logo.model import BudgetController, Transformer
from logo.model.flops import mfu, peak_bf16_flops, realized_ratios
from logo.model.lm_head import resolve_loss_impl
from logo.parallel import ParallelDims, parallelize, sum_over_ranks
from logo.parallel.mesh import set_timeouts
from logo.parallel.memory import estimate, fit_hint
from logo.run.checkpoint import (CheckpointError, agreed, complete_checkpoints, load_model_only, read_train_state,
                                 resolve_checkpoint)
from logo.run.config import Config
from logo.run.hf import check_compatible, load_into, read_config, strip_prefix
from logo.run.ranks import rank0_decides
from logo.train.checkpoint import Checkpointer
from logo.train.heldout import HeldOutEval
from logo.train.loaders import build_loader, check_data, data_metrics, describe_loader, heldout_corpus
from logo.train.metrics import BudgetWatch, MetricsLogger, console_line
from logo.train.peers import PeerWatch, record_peers
from logo.train.plan import Plan, make_plan, planned_run_dir
from logo.train.rundir import RunDirLocked, RunLock, check_prior_run, config_drift
from logo.train.state import TrainState
from logo.train.step import (DivergenceMonitor, Readout, StepTimer, TrainingDiverged, make_optimizer, optimizer_step,
                             phase, read_back, spread, train_step)

log = logging.getLogger("logo")
COMM_TRACES = "comm_traces"  # the NCCL flight recorder's dumps, in the run directory
__all__ = ["TrainingDiverged", "train", "dry_run", "lr_factor"]


class _StopRequest:
    """SIGTERM / SIGUSR1 (SLURM preemption, scancel) and SIGINT (Ctrl-C): finish the step, checkpoint, exit
    cleanly. A SIGINT more than ECHO_S after the first stop signal aborts at once, without a checkpoint (as kill -9
    would: the last complete checkpoint stays latest); within ECHO_S it is the same Ctrl-C passed on by torchrun,
    which forwards the signal it got to every worker. `restore()` puts the previous handlers back."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    ECHO_S = 0.5

    def __init__(self):
        self.signal = None
        self._since = 0.0
        self._pending = None  # (work, flags) of the all-reduce started at the last check
        self._previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}

    def _handler(self, signum, frame):
        if self.signal is not None:
            if signum == signal.SIGINT and time.monotonic() - self._since > self.ECHO_S:
                os.write(2, b"second interrupt: stopped at once, without a checkpoint; re-run the same command to "
                            b"resume from the last complete checkpoint\n")
                os._exit(128 + signal.SIGINT)
            return
        self.signal, self._since = signal.Signals(signum).name, time.monotonic()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self, group, save_due: bool = False) -> tuple[bool, bool]:
        """(stop, save_due): stop is True on every rank once any rank got a signal; save_due is rank 0's
        time-based checkpoint decision, the same on every rank. Distributed: an all-reduce of CPU flags over a
        gloo group, host-only (a device flag would need a host sync per step), started at one step and read at the
        next, so that no rank's host waits for the others' at every step: every rank sees the flags one step
        late, all at the same step."""
        if group is None:
            return self.signal is not None, save_due
        agreed = (False, False)
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = (bool(flag[0]), bool(flag[1]))
        flag = torch.tensor([1 if self.signal else 0, int(save_due and dist.get_rank() == 0)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True), flag)
        return agreed

    def close(self) -> None:
        """Wait for the flags' all-reduce in flight (every rank started it)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def _host_group(world: int):
    """A process group for host-side flags: the default group when it is gloo, else a gloo side group."""
    if world == 1:
        return None
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _nccl_fault_settings(cfg: Config, run_dir: Path) -> None:
    """Environment NCCL reads when its process group starts (as torchtitan sets it; a value already in the
    environment wins): a timed-out collective tears the process down, and with the flight recorder on, every rank
    first dumps its last `parallel.flight_recorder` collectives to <run_dir>/comm_traces/rank_<r> (the folder is
    made once the run directory is locked)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the flight recorder needs 3 (no cleanup)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(cfg.parallel.flight_recorder))
    if cfg.parallel.flight_recorder:
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(run_dir.resolve() / COMM_TRACES / "rank_"))


def _restart_store(rank: int, world: int) -> dict:
    """Under torchrun after a restart (--max-restarts), the process group's keys in a store of their own attempt:
    torchrun's store outlives its workers, and a restarted rank could otherwise read the address a rank of the
    failed attempt published and wait for it for ever. {} otherwise (env:// as usual)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or "MASTER_ADDR" not in os.environ:
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    return {"store": dist.PrefixStore(f"logo/attempt_{attempt}", store), "rank": rank, "world_size": world}


def _setup_distributed(cfg: Config, run_dir: Path) -> tuple[torch.device, int, int]:
    use_cuda = torch.cuda.is_available() and cfg.parallel.device != "cpu"
    if cfg.parallel.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("invalid config parallel.device='cuda': no CUDA device is visible; use parallel.device=auto "
                          "or cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if use_cuda else "gloo")
        if backend == "nccl":
            _nccl_fault_settings(cfg, run_dir)
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.init_timeout_s),
                                **_restart_store(rank, world))
        record_peers()
    return device, rank, world


def _build_data(cfg: Config, plan: Plan, rank: int, world: int, device: torch.device,
                dims: ParallelDims) -> StepLoader:
    loader = build_loader(cfg, plan.seq_len, plan.global_batch, plan.micro_batch, rank, world, dims.data_rank,
                          dims.dp)
    # CUDA graphs record one graph per input shape: document offsets in power-of-two buckets, not one per count
    return StepLoader(loader, prefetch=cfg.data.prefetch, pin_memory=device.type == "cuda", device=device,
                      doc_buckets=cfg.train.cuda_graphs)


def lr_factor(step: int, plan: Plan) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based): linear warmup over plan.warmup_steps,
    then cosine decay to plan.lr_min / plan.lr at the last step. Closed form, so a resumed run gets
    exactly the same learning rates."""
    warm = plan.warmup_steps
    if step < warm:
        return (step + 1) / warm
    floor = plan.lr_min / plan.lr
    progress = min(1.0, (step - warm) / max(1, plan.steps - 1 - warm))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _loss_impl(cfg: Config, device: torch.device) -> str:
    """train.loss resolved for this device (auto: see logo.model.lm_head; plain under tensor
    parallelism, whose vocab-split LM head returns logits)."""
    if cfg.parallel.tp > 1:
        if cfg.train.loss not in ("auto", "plain"):
            raise ConfigError(f"invalid config train.loss={cfg.train.loss!r} with parallel.tp={cfg.parallel.tp}: the "
                              "tensor-parallel LM head is split over the vocabulary; use train.loss=auto or plain")
        impl = "plain"
    else:
        impl = None
    try:
        return impl or resolve_loss_impl(cfg.train.loss, device,
                                         cfg.train.micro_batch * cfg.stage.seq_len * cfg.model.padded_vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _fsdp_options(cfg: Config) -> dict:
    p = cfg.parallel
    return dict(reduce_dtype=torch.bfloat16 if p.reduce_dtype == "bf16" else torch.float32,
                reshard_after_forward=p.reshard_after_forward, forward_prefetch=p.forward_prefetch,
                backward_prefetch=p.backward_prefetch, bucket_mb=p.bucket_mb)


def _peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process (GPU: allocated; CPU: RSS); host values, no sync."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _rank_maxima(ctrl: BudgetController, peak_gib: float, device: torch.device) -> torch.Tensor:
    """(2,) float64 on the device: the thresholds' spread over ranks (max over layers of max - min; 0 when every
    rank holds the same values, and without LoGo layers) and the peak memory's maximum over ranks. One
    all-reduce on the default group, issued and not read: no rank's host waits for the others' here."""
    th = ctrl.thresholds().double() if ctrl.layers else torch.zeros(0, dtype=torch.float64, device=device)
    x = torch.cat([th, -th, torch.full((1,), peak_gib, dtype=torch.float64, device=device)])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    n = th.numel()
    spread = (x[:n] + x[n:2 * n]).max() if n else x.new_zeros(())  # max(th) - min(th) = max(th) + max(-th)
    return torch.stack([spread, x[-1]])


def _check_spread(spread: float) -> float:
    if spread != 0.0:
        raise RuntimeError(f"LoGo thresholds differ across data-parallel ranks by {spread}: the budget "
                           f"controller must apply identical updates on every rank")
    return spread


def check_init_from(cfg: Config):
    """checkpoint.init_from, checked before anything is built: a complete checkpoint that verifies (of a run
    directory: its newest that does), or 'hf:DIR' whose config.json matches the model's shape (one-line errors
    otherwise). Rank 0 reads the files; every rank gets its answer."""
    hf_dir = strip_prefix(cfg.checkpoint.init_from)
    if hf_dir is None:
        return agreed(lambda: resolve_checkpoint(cfg.checkpoint.init_from))
    check_compatible(read_config(hf_dir), cfg.model, hf_dir)
    return cfg.checkpoint.init_from


def load_init_from(init_from, model) -> None:
    """Weights and thresholds of a DCP checkpoint (strict), or of a Hugging Face folder: shared weights must all
    be there; LoGo-only parameters and thresholds a plain Llama folder lacks keep their initialisation."""
    hf_dir = strip_prefix(str(init_from))
    if hf_dir is None:
        load_model_only(init_from, model)
        return
    info = load_into(model, hf_dir, strict=False)
    if info["kept_init"]:
        log.info("%s: %d LoGo parameter(s) keep their identity initialisation (not in the folder)", hf_dir,
                 len(info["kept_init"]))


def train(cfg: Config, resolved: dict, attention_name: str, on_step_end=None, save_final: bool = True) -> dict:
    """Run (or resume) the training described by cfg; returns the final metrics.
    `on_step_end(step)` is called after every step (benchmarks/profile_step.py steps its profiler with it);
    `save_final=False` skips the checkpoint after the last step (benchmarks)."""
    device, rank, world = _setup_distributed(cfg, Path(planned_run_dir(cfg, attention_name)))
    loss_impl = _loss_impl(cfg, device)  # fails here, before the run directory is looked at
    plan = make_plan(cfg, world, attention_name, device)
    check_data(cfg)
    rank0_decides(lambda: _run_dir_call(plan.run_dir, lambda: RunLock(Path(plan.run_dir)).check_free()),
                  (RunDirLocked, ConfigError))  # a live run there: say so before reading its files
    return _train(cfg, resolved, plan, device, rank, world, loss_impl, on_step_end, save_final)


def _lock_run_dir(run_dir: Path, stale_minutes: float, checked: list[str]):
    """Rank 0 takes the run directory's lock once every check of the launch has passed, before anything is
    written there; every rank fails together. `checked`: the complete checkpoints the checks saw; another
    launch that changed them in the meantime makes this one stop (re-run it)."""
    def take() -> RunLock:
        lock = take_run_dir(run_dir, stale_minutes)
        now = [p.name for p in complete_checkpoints(run_dir / "checkpoints")]
        if now != checked:
            lock.release()
            raise RunDirLocked(f"run directory {run_dir} changed while this launch checked it (checkpoints "
                               f"{', '.join(checked) or 'none'} -> {', '.join(now) or 'none'}): another launch wrote "
                               f"there; re-run the same command")
        return lock
    return rank0_decides(take, (RunDirLocked, ConfigError), share_result=False)


def take_run_dir(run_dir: Path, stale_minutes: float) -> RunLock:
    """The run directory's lock; ConfigError naming run.dir when the directory cannot be created or written."""
    return _run_dir_call(run_dir, lambda: RunLock(run_dir, 60 * stale_minutes).acquire())


def _run_dir_call(run_dir, fn):
    """fn(), an OSError turned into a ConfigError naming run.dir."""
    try:
        return fn()
    except OSError as e:
        raise ConfigError(f"invalid config run.dir={str(run_dir)!r}: it cannot be created or written "
                          f"({type(e).__name__}: {e.strerror or e}); choose a writable directory") from None


def _check_resume(state: dict, latest: Path, resolved: dict, run_dir: Path) -> None:
    """Before anything is built: the checkpoint's config (or the run's config.yaml) must equal this one in
    every field that changes the model or the data order."""
    saved = state.get("config")
    if saved is None and (run_dir / "config.yaml").exists():
        saved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    diffs = config_drift(saved, resolved) if saved is not None else []
    if diffs:
        raise ConfigError(f"config drift on resume from {latest}: {'; '.join(diffs)}. These change the model or the "
                          f"data order of the checkpointed run: restore them, or start a fresh run directory "
                          f"(run.dir=NEW_DIR or run.name=NEW_NAME)")


def _prior_checkpoint(cfg: Config, ckpt: Checkpointer, run_dir: Path):
    """The checkpoint this launch resumes from: the run directory's newest that verifies (damaged ones are passed
    over, saying so), None for a new run. checkpoint.resume=false into a directory that holds checkpoints would
    mix two runs' files: refused."""
    if cfg.checkpoint.resume:
        return ckpt.latest_verified()
    if ckpt.complete():
        raise ConfigError(f"invalid config checkpoint.resume=false: {run_dir} already holds a run (latest checkpoint "
                          f"{ckpt.latest().name}); starting over there would mix two runs' files: choose a new run.dir "
                          f"(or run.name), or resume it (checkpoint.resume=true)")
    return None


@dataclass
class _Built:
    """What `_build` makes for a launch: the model and everything the loop steps with it."""
    model: Transformer
    opt: torch.optim.Optimizer
    loader: StepLoader
    heldout: HeldOutEval
    ctrl: BudgetController
    watch: BudgetWatch
    state: TrainState
    dims: ParallelDims
    data_parallel: bool  # FSDP or DDP averages the gradients over the data-parallel mesh
    autocast: object  # bf16 autocast without FSDP (FSDP casts itself), else a null context
    host_group: object  # gloo group for host-side flags, None with one process


@dataclass
class _StepLog:
    """What every logging step needs besides the step's own figures: `stage` (every rank: it issues the record's
    collective) and `finish`, which writes the metrics (rank 0) and returns them (every rank)."""
    plan: Plan
    model_cfg: object  # logo.config.ModelConfig (for MFU)
    peak: Optional[float]  # the device's bf16 peak FLOP/s, None off CUDA or when unknown
    world: int
    device: torch.device
    ctrl: BudgetController
    metrics_log: Optional[MetricsLogger]  # rank 0
    bar: object  # tqdm bar or None
    data_metrics: object = dict  # () -> the data's own metrics (a mixture's data/tokens/<source>)
    documents: list = field(default_factory=list)  # this rank's document lengths since the last record

    def add_documents(self, data: StepData) -> None:
        """Note the lengths of the documents of this rank's micro-batches (host tensors: no sync), which MFU's
        attention FLOPs count over (each token sees only its own document); nothing where no MFU is logged."""
        if not self.peak:
            return
        for mb in data.micro_batches:
            rows, seq = mb.inputs.shape
            if mb.cu_seqlens is None:
                self.documents.append(np.full(rows, seq))
            elif mb.cu_seqlens.device.type == "cpu":
                self.documents.append(np.diff(mb.cu_seqlens.numpy()))

    def stage(self, step: int, out, monitor: DivergenceMonitor, lr: float, timer: StepTimer) -> _Pending:
        """Start the record of logging step `step`: its device figures (loss, grad norm, divergence state, the
        controller's figures, the thresholds' spread and the peak memory over ranks) on their way to the host, no
        host sync."""
        figures = self.ctrl.figures()  # (L, 8) or None
        extra = [] if figures is None else [figures.double().flatten()]
        if self.world > 1:
            extra.append(_rank_maxima(self.ctrl, _peak_memory_gib(self.device), self.device))
        docs = np.concatenate(self.documents) if self.documents else None
        self.documents.clear()
        return _Pending(step, lr, Readout(out, monitor, torch.cat(extra) if extra else None), timer.take(),
                        0 if figures is None else figures.numel(), docs, self.data_metrics())

    def finish(self, pending: _Pending, timer: StepTimer, evaluated: dict, saves: list, last_good) -> dict:
        """The record of a staged logging step: waits for its figures, raises `TrainingDiverged` if a step up to
        it diverged (`last_good()`: the checkpoint to name), writes the metrics (rank 0) and returns them (every
        rank). No collective here: the one over ranks was issued by `stage`."""
        plan = self.plan
        with phase("sync"):
            loss, grad_norm, diverged, extra = pending.readout.values()
        DivergenceMonitor.check(diverged, last_good)
        durations = timer.elapsed(pending.marks)
        elapsed = sum(durations) or float("nan")
        m = {"loss": loss, "lr": pending.lr, "grad_norm": grad_norm,
             "tokens_per_s": len(durations) * plan.global_batch_tokens / elapsed,
             "tokens": pending.step * plan.global_batch_tokens, **spread(durations)}
        n_fig = pending.n_figures
        # the largest peak over ranks, up to the staged step
        m["memory_gib"] = float(extra[n_fig + 1]) if self.world > 1 else _peak_memory_gib(self.device)
        if n_fig:
            m.update(self.ctrl.metrics_of(extra[:n_fig]))
        if self.peak:  # attention FLOPs over this rank's documents, the LoGo layers at the last step's ratios
            m["mfu"] = mfu(self.model_cfg, plan.seq_len, plan.params_non_embedding, m["tokens_per_s"],
                           self.peak * self.world, realized_ratios(m), pending.documents)
        m.update(evaluated)  # held-out loss when it was due at this step
        m.update(pending.data)  # a mixture's tokens per source
        if saves:  # the latest save finished since the last logged step (each one is also on the console)
            m.update(saves[-1].metrics())
        if self.world > 1 and self.ctrl.layers:
            m["logo/threshold_spread"] = _check_spread(float(extra[n_fig]))
        if self.metrics_log is not None:
            self.metrics_log.log(pending.step, m, heatmap=pending.step % self.metrics_log.cfg.heatmap_interval == 0)
            line = console_line(pending.step, plan.steps, m)
            (self.bar.write(line) if self.bar is not None else print(line, flush=True))
        return m


@dataclass
class _Pending:
    """A logging step whose record `_StepLog.stage` started: its figures on their way to the host."""
    step: int
    lr: float
    readout: Readout
    marks: list  # the step timer's marks of the steps since the last record
    n_figures: int  # the controller's figures among the readout's extra values (0: none yet)
    documents: Optional[np.ndarray]  # this rank's document lengths of the steps since the last record (MFU)
    data: dict  # the data's own metrics at the step (a mixture's tokens per source)


def _train(cfg: Config, resolved: dict, plan: Plan, device: torch.device, rank: int, world: int, loss_impl: str,
           on_step_end, save_final: bool) -> dict:
    """Every check first (checkpoints, drift, extension, data, the checkpoint's contents), then the run directory's
    lock and its files: a refused launch creates and changes nothing there."""
    run_dir = Path(plan.run_dir)
    ckpt, latest, init_from = _open_run(cfg, resolved, plan, world)
    checked = [p.name for p in ckpt.complete()]
    b = _build(cfg, resolved, plan, device, rank, world)
    try:
        _resume(b, ckpt, latest, init_from, rank)
        lock = _lock_run_dir(run_dir, cfg.run.lock_stale_minutes, checked)
    except BaseException:
        b.loader.close()  # its prefetch thread; the loop closes it otherwise
        raise
    try:
        if rank == 0:
            _write_run_files(run_dir, plan, resolved)
            log.info("LM loss: %s (train.loss=%s)", loss_impl, cfg.train.loss)
            log.info("plan:\n%s", plan.table())
            if not cfg.checkpoint.enable:
                log.warning("checkpoint.enable=false: this run saves no checkpoint, not even at its end or on a stop")
            if world > 1:
                log.info("%s", b.dims.describe())
            if os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1":
                (run_dir / COMM_TRACES).mkdir(exist_ok=True)
        return _run(cfg, resolved, plan, run_dir, b, ckpt, device, rank, world, loss_impl, on_step_end, save_final)
    finally:
        if lock is not None:
            lock.release()


def _write_run_files(run_dir: Path, plan: Plan, resolved: dict) -> None:
    """plan.json and config.yaml, each replaced whole (never half-written)."""
    plan.write(run_dir)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(resolved))
    os.replace(tmp, run_dir / "config.yaml")


def _open_run(cfg: Config, resolved: dict, plan: Plan, world: int):
    """(checkpointer, checkpoint to resume from or None, init_from or None), checked before anything is built
    so that a bad path or a drifted config fails at once; nothing is written. Resume wins over init_from."""
    run_dir = Path(plan.run_dir)
    ck = cfg.checkpoint
    ckpt = Checkpointer(run_dir, ck.keep, ck.async_mode, ck.writer_threads,
                        dist.new_group(backend="gloo") if world > 1 and ck.async_mode != "none" else None)
    latest = _prior_checkpoint(cfg, ckpt, run_dir)
    init_from = check_init_from(cfg) if cfg.checkpoint.init_from and latest is None else None
    if latest is not None:
        saved = read_train_state(latest)
        _check_resume(saved, latest, resolved, run_dir)
        check_prior_run(saved, latest, ck.init_from, cfg.run.extend, plan.steps, run_dir)
    return ckpt, latest, init_from


def _build(cfg: Config, resolved: dict, plan: Plan, device: torch.device, rank: int, world: int) -> _Built:
    """Model (initialised with the plan's thresholds, parallelized), optimizer and LR schedule, data, held-out
    evaluation, budget controller and the train state over them."""
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        model = Transformer(plan.model_config(cfg.model))
    model.to_empty(device=device)
    model.init_weights()
    bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda")
    dims = ParallelDims.build(world, cfg.parallel.tp, cfg.parallel.cp, device.type)
    dp_mesh = dims.submesh("dp_shard_cp")
    parallelize(model, dp_mesh, torch.bfloat16 if bf16 else torch.float32,
                cfg.train.activation_checkpointing, cfg.train.compile, fsdp=_fsdp_options(cfg),
                tp_mesh=dims.submesh("tp"), cp_mesh=dims.submesh("cp"), compile_mode=cfg.train.compile_mode,
                data_parallel=plan.data_parallel)
    sharded = plan.data_parallel == "shard"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 and not sharded else nullcontext()

    opt = make_optimizer(model, plan.lr, (cfg.train.beta1, cfg.train.beta2), cfg.train.eps, cfg.train.weight_decay)
    sched = LambdaLR(opt, partial(lr_factor, plan=plan))
    loader = _build_data(cfg, plan, rank, world, device, dims)
    plan.data_sources = describe_loader(cfg, loader.loader)  # with the fingerprints of what was opened
    dp_cp_group = dims.dim("dp_shard_cp").get_group() if dims.mesh is not None else None
    # eval.interval=0: does nothing; context-parallel ranks each evaluate whole sequences (no CP at eval)
    corpus = heldout_corpus(cfg, rank, world) if cfg.eval.interval > 0 else None
    heldout = HeldOutEval(cfg, plan, corpus, dims.data_rank, dims.dp, device,
                          group=dims.mesh["dp_shard"].get_group() if dims.mesh is not None else None)
    # routing counts summed over the ranks that see different tokens (dp x cp), never over tp (same tokens)
    window = cfg.logging.ratio_window or cfg.logging.interval
    ctrl = BudgetController(model, reduce=sum_over_ranks(dp_cp_group), window=window)
    a = cfg.model.attention
    hint = "; try attention.budget_control=quantile (docs/model.md)" if a.budget_control == "threshold" else ""
    watch = BudgetWatch(a.rho, cfg.logging.budget_tolerance if ctrl.layers else 0.0, plan.pmask_steps, window,
                        hint=hint)
    state = TrainState(sched, loader, ctrl, plan.to_json(), resolved)
    return _Built(model, opt, loader, heldout, ctrl, watch, state, dims, dp_mesh is not None, autocast,
                  _host_group(world))


def _resume(b: _Built, ckpt: Checkpointer, latest: Optional[Path], init_from, rank: int) -> None:
    """Restore model, optimizer and train state from `latest`, or only the weights and thresholds from
    `init_from` (a fresh stage: new optimizer, schedule and data order), or nothing (a new run)."""
    if latest is not None:
        saved = ckpt.load(latest, b.model, b.opt)
        if saved["data"]["batches_consumed"] != saved["step"]:  # one global batch per optimizer step
            raise CheckpointError(f"checkpoint {latest} is inconsistent: step {saved['step']} but its data position "
                                  f"is {saved['data']['batches_consumed']} global batches")
        b.state.load_state_dict(saved)
        if rank == 0:
            log.info("resumed from %s (step %d)", latest, b.state.step)
    elif init_from is not None:
        load_init_from(init_from, b.model)
        if rank == 0:
            log.info("initialized model and thresholds from %s (fresh optimizer, schedule and data)", init_from)


def _run(cfg: Config, resolved: dict, plan: Plan, run_dir: Path, b: _Built, ckpt: Checkpointer,
         device: torch.device, rank: int, world: int, loss_impl: str, on_step_end, save_final: bool) -> dict:
    """The loop from the train state's step to plan.steps (or a stop signal); returns the final metrics."""
    ck, state = cfg.checkpoint, b.state
    metrics_log = MetricsLogger(run_dir, cfg.logging, plan.run_name, resolved, state.step, state.wandb_id) \
        if rank == 0 else None
    if metrics_log is not None:
        state.wandb_id = metrics_log.wandb_id
    stop = _StopRequest()
    bar = None
    if rank == 0 and cfg.logging.progress_bar and sys.stderr.isatty():  # logs get the line per logging.interval
        bar = tqdm(total=plan.steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True, leave=False)
    step_log = _StepLog(plan, cfg.model, peak_bf16_flops(torch.cuda.get_device_name()) if device.type == "cuda"
                        else None, world, device, b.ctrl, metrics_log, bar,
                        partial(data_metrics, b.loader.loader))
    last = {}
    monitor, timer = DivergenceMonitor(device), StepTimer(device)
    if cfg.train.gc_interval:
        gc.collect()
        gc.disable()
    last_save = time.monotonic()
    start_step, t_start = state.step, time.monotonic()
    peer_watch = PeerWatch().arm()
    pending = None  # a logging step whose record is read at the next step

    def _finish_record(staged, evaluated: dict) -> dict:
        with phase("log"):
            m = step_log.finish(staged, timer, evaluated, ckpt.take_stats(), lambda: _last_good(ckpt))
            if rank == 0:
                b.watch.check(staged.step, m)
        return m

    try:
        while state.step < plan.steps:
            with phase("data"):
                data = b.loader.next_step()
            step_log.add_documents(data)
            out = train_step(b.model, data, device=device, autocast=b.autocast, ctrl=b.ctrl,
                             grad_clip=cfg.train.grad_clip, data_parallel=b.data_parallel, dims=b.dims,
                             window=cfg.model.attention.window, loss_impl=loss_impl)
            lr = b.opt.param_groups[0]["lr"]  # the learning rate of this step
            with phase("optimizer"):
                ckpt.wait_staging()  # async_pinned: the previous save's host copy is taken before the update
                optimizer_step(b.opt, state.lr_scheduler, b.ctrl, out, monitor, state.step + 1)
            state.step += 1
            step = state.step
            if step == start_step + 1 and world > 1:  # start-up and compilation are over: the run's timeout
                set_timeouts(cfg.parallel.timeout_s)
            if step == start_step + 1 and ck.enable:  # the process's first step (its time also holds compilation)
                with phase("checkpoint"):
                    prestage_s = ckpt.prestage(b.model, b.opt)
                if prestage_s and rank == 0:
                    log.info("checkpoint: host buffers for async_pinned saves allocated in %.1f s", prestage_s)
            timer.mark()
            if bar is not None:
                bar.update(1)
            if pending is not None:  # the last logging step's record, read while this step keeps the GPU busy
                last = _finish_record(pending, {})
                pending = None

            ckpt.poll()  # a finished background write becomes latest
            with phase("stop_check"):
                stop_now, time_due = stop.requested(
                    b.host_group, ck.interval_minutes > 0 and time.monotonic() - last_save >= 60 * ck.interval_minutes)
            with phase("eval"):
                evaluated = b.heldout.maybe_evaluate(step, b.model, b.autocast)  # {} unless due; every rank
            log_now = step % cfg.logging.interval == 0 or step == plan.steps or bool(evaluated)
            milestone = _milestone(step, plan.global_batch_tokens, ck.keep_every_tokens)
            last_step = step == plan.steps
            save_now = ck.enable and (step % ck.interval == 0 or (last_step and save_final) or stop_now or time_due
                                      or milestone)
            # The loop's only host syncs: a logging step's figures (loss, grad norm, divergence state, the
            # controller's) are read one step later, while the next step runs, unless the step saves, evaluated,
            # stops or ends the run: then at once (a save must follow the divergence check of its step).
            if log_now:
                with phase("log"):
                    pending = step_log.stage(step, out, monitor, lr, timer)
            at_once = save_now or bool(evaluated) or last_step or stop_now
            if save_now:
                with phase("sync"):
                    diverged = pending.readout.values()[2] if pending is not None else read_back(out, monitor)[2]
                DivergenceMonitor.check(diverged, lambda: _last_good(ckpt))
                with phase("checkpoint"):
                    gc.collect()
                    ckpt.save(step, b.model, b.opt, state.state_dict(), milestone=milestone,
                              wait=last_step or stop_now)
                last_save = time.monotonic()
            if pending is not None and at_once:
                last = _finish_record(pending, evaluated)
                pending = None
            if evaluated or save_now:
                timer.restart()  # neither the held-out evaluation nor the save is part of the next step's time
            if cfg.train.gc_interval and step % cfg.train.gc_interval == 0:
                with phase("gc"):
                    gc.collect(1)
            if on_step_end is not None:
                on_step_end(step)
            if stop_now:
                if rank == 0:
                    log.warning("received %s: %s", stop.signal or "a stop signal on another rank",
                                f"checkpoint saved at step {step}; re-run the same command to resume" if ck.enable
                                else f"stopped at step {step} without a checkpoint (checkpoint.enable=false)")
                break
    finally:
        error = sys.exc_info()[1]
        if not isinstance(error, (RuntimeError, ConnectionError)):  # a collective's failure: the watch stays armed
            peer_watch.disarm()
        if error is None:
            stop.close()
        _close_checkpointer(ckpt, failing=error is not None)
        gc.enable()
        b.loader.close()
        if bar is not None:
            bar.close()
        heatmap = None
        if metrics_log is not None:
            if state.step:
                heatmap = metrics_log.heatmap(state.step)
            metrics_log.close()
        stop.restore()
    step = state.step
    if rank == 0 and last:  # a launch that logged nothing leaves the earlier final metrics as they are
        atomic_write_json(run_dir / "final_metrics.json", {"step": step, **last})
    if rank == 0:
        print(summary_line(run_dir, step, plan.steps, time.monotonic() - t_start, start_step, plan, last,
                           ckpt.latest(), heatmap), flush=True)
    return {"step": step, **last}


def summary_line(run_dir: Path, step: int, steps: int, seconds: float, start_step: int, plan: Plan, last: dict,
                 checkpoint, heatmap) -> str:
    """The console's last line: how far the run got, how fast, and where its results are."""
    done = step - start_step
    tok_s = done * plan.global_batch_tokens / seconds if seconds > 0 else 0.0
    loss = f", loss {last['loss']:.4f}" if "loss" in last else ""
    files = ["metrics.jsonl"] + (["final_metrics.json"] if last else []) + \
        ([heatmap.name] if heatmap is not None else []) + ([f"checkpoints/{checkpoint.name}"] if checkpoint else [])
    state = "done" if step >= steps else "stopped"
    return (f"{state}: step {step} of {steps} ({done} this launch in {seconds:.0f} s, {tok_s / 1e3:.1f}k tok/s{loss}); "
            f"results in {run_dir}: {', '.join(files)}")


def _last_good(ckpt: Checkpointer):
    """The newest checkpoint that verifies, or None (for the divergence message)."""
    try:
        return ckpt.latest_verified()
    except CheckpointError:
        return None


def _milestone(step: int, batch_tokens: int, every: int) -> bool:
    """True at the first step whose token count reaches the next multiple of `every` (0: never)."""
    return every > 0 and step * batch_tokens // every > (step - 1) * batch_tokens // every


def _close_checkpointer(ckpt: Checkpointer, failing: bool) -> None:
    """Finish the in-flight save (it holds a good state) at the end, on SIGTERM and on errors. While another
    error propagates, a failing save is only logged."""
    if not failing:
        ckpt.close()
        return
    try:
        ckpt.close()
    except Exception as e:  # noqa: BLE001
        log.warning("%s", e)


def dry_world(cfg: Config, launch_set: bool) -> tuple[int, str]:
    """(world size, why) a dry run plans for: $WORLD_SIZE under torchrun; the SLURM resources of an experiment
    preset or of launch.* options on the command line (launch.nodes x processes per node); else one process."""
    la = cfg.launch
    if int(os.environ.get("WORLD_SIZE", "0")):
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE of this torchrun launch"
    if cfg.experiment or launch_set:
        n = la.nodes * (la.procs_per_node or la.gpus_per_node or 1)
        src = f"experiment {cfg.experiment}" if cfg.experiment and not launch_set else "launch.* options"
        per_node = la.procs_per_node or la.gpus_per_node or 1
        return n, f"the SLURM resources of {src}: launch.nodes={la.nodes} x {per_node}"
    return 1, "one process (no experiment preset or launch.* option; set launch.nodes / launch.gpus_per_node, or run " \
              "under torchrun, to plan for more)"


def dry_run(cfg: Config, resolved: dict, attention_name: str = "", launch_set: bool = False) -> Plan:
    """Build the model on the meta device, print the plan, the mesh and the per-GPU memory estimate, and write
    <run_dir>/plan.json (not into a directory that holds a run's checkpoints). No training. World size:
    `dry_world`."""
    world, why = dry_world(cfg, launch_set)
    plan = make_plan(cfg, world, attention_name)
    if int(os.environ.get("RANK", "0")) == 0:
        run_dir = Path(plan.run_dir)
        lock = take_run_dir(run_dir, cfg.run.lock_stale_minutes)  # not over a live run's files
        try:
            held = Checkpointer(run_dir, 1).latest()
            if held is None:
                plan.write(run_dir)
                (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        finally:
            lock.release()
        mem = estimate(cfg.model, plan.seq_len, plan.micro_batch, plan.dp, plan.cp, plan.tp)
        ac = "on" if cfg.train.activation_checkpointing else "off"
        wrote = (f"wrote {run_dir / 'plan.json'}" if held is None else
                 f"plan.json not written: {run_dir} holds a run (latest checkpoint {held.name}) whose files stay")
        hint = fit_hint(cfg.model, plan.seq_len, plan.micro_batch, plan.dp, plan.cp, plan.tp)
        print(f"dry run: {plan.run_name}, world size {world} ({why})\n{plan.table()}\nper-GPU memory estimate "
              f"(activation checkpointing is {ac} in this config; logo/parallel/memory.py):\n{mem.table()}\n"
              + (f"{hint}\n" if hint else "") + wrote)
    return plan
