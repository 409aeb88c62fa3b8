"""One optimizer step of the training loop, with no host synchronization (lingua / torchtitan style).

`train_step` runs a step's micro-batches (forward, loss, backward, LoGo routing counts) and returns device
tensors; `optimizer_step` applies the update on the device unless the step's loss or gradient norm is not
finite: fused AdamW's `found_inf` skips the update inside the kernel (parameters, moments and step count
unchanged), the LoGo controller leaves its thresholds and state unchanged, and `DivergenceMonitor` remembers the first such step. The loop
reads these tensors on the host only at logging and checkpoint steps (`Readout`: at a logging step one step
later, while the next step runs), where `DivergenceMonitor.check` raises `TrainingDiverged` naming that step.

Every phase is a `torch.profiler.record_function` range named `logo/<phase>` (benchmarks/profile_step.py
attributes GPU time and host syncs to them); outside a profiler a range costs about a microsecond.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional
from collections.abc import Callable
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from data.loader import Batch, StepData
from logo.model.layers import check_cu_seqlens
from logo.model.lm_head import fused_lm_loss_sum, lm_loss_sum
from logo.parallel import sync_after
from logo.parallel.cp import context_parallel, shard_batch


class TrainingDiverged(RuntimeError):
    pass


def phase(name: str):
    """A named range in profiler traces: `logo/<name>`."""
    return torch.profiler.record_function(f"logo/{name}")


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # () fp32: LM loss summed over the valid targets of the global batch (all ranks)
    n_tokens: torch.Tensor  # () fp32: valid targets of the global batch
    grad_norm: torch.Tensor  # () fp32: total gradient norm before clipping (all ranks)

    @property
    def loss(self) -> torch.Tensor:
        return self.loss_sum / self.n_tokens

    def nonfinite(self) -> torch.Tensor:
        """() bool: the loss or the gradient norm is NaN/inf (equal on every rank: both are global)."""
        return ~(torch.isfinite(self.loss_sum) & torch.isfinite(self.grad_norm))


def micro_batch_loss(model: torch.nn.Module, mb: Batch, autocast, loss_impl: str = "auto", positions=None):
    """Forward of one micro-batch (on the device) -> (LM loss summed over the valid targets, () fp32; model
    output). The one place the loss is computed: the model's LM head takes the labels and returns the summed
    loss (`loss_impl`: auto | liger | chunked | plain, see logo/model/lm_head.py), so the (T, vocab) logits
    are never materialised unless loss_impl is plain."""
    with autocast:
        if loss_impl == "plain":  # logits out of the model (what a vocab-split tensor-parallel head gives too)
            out = model(mb.inputs, cu_seqlens=mb.cu_seqlens, valid=mb.valid, positions=positions)
            loss = fused_lm_loss_sum if out.logits.is_cuda else lm_loss_sum  # the same loss; compiled on CUDA
            return loss(out.logits, mb.labels), out
        out = model(mb.inputs, cu_seqlens=mb.cu_seqlens, valid=mb.valid, labels=mb.labels, loss_impl=loss_impl,
                    positions=positions)
    return out.loss_sum, out


@torch.no_grad()
def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most max_norm; returns that norm (before scaling) as a
    plain tensor. Gradients that are DTensors (FSDP, tensor parallelism) give a partial norm, reduced over their
    mesh by `full_tensor` (the same composition of torch's clipping API as torchtitan's, without importing it)."""
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def _all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _context_parallel(model, cpu_mb: Batch, dims, window: int, device: torch.device):
    """(this rank's share of the micro-batch, its rotary positions, the context manager of its forward and
    backward); the micro-batch itself, None and a no-op when there is no context parallelism."""
    if dims is None or dims.cp == 1:
        return cpu_mb, None, nullcontext()
    local, positions, layout = shard_batch(cpu_mb, dims.cp, dims.rank("cp"), window)
    if device.type == "cuda":  # the shard is built in pageable memory: pin it so its copies are asynchronous
        local, positions = local.pin_memory(), positions.pin_memory()
    return local, positions.to(device, non_blocking=True), context_parallel(model, layout.to(device))


def train_step(model: torch.nn.Module, data: StepData, *, device: torch.device, autocast, ctrl, grad_clip: float,
               data_parallel: bool, world: int = 1, dims=None, window: int = 1,
               loss_impl: str = "auto") -> StepOutput:
    """Forward and backward of this rank's micro-batches, gradient clipping; no host sync.

    The gradient is the token mean over the global batch for any split: with `data_parallel` (the model wrapped
    by FSDP or DDP, `logo.parallel.parallelize`) gradients are averaged over the ranks (dp_shard x cp), so each
    rank's loss is scaled by their number and divided by the global target count, which the loader knows on the
    host (`data.target_tokens`); the aux loss is the mean over all micro-batches (and context shards). `dims` (a
    `logo.parallel.ParallelDims`) replaces `world` when given:
    tensor-parallel ranks hold the same tokens and count once; with cp > 1 each micro-batch is split along
    time (`window`: the model's sliding window, for the halo).
    """
    micro = data.micro_batches
    ranks = dims.dp * dims.cp if dims is not None else world
    group = dims.dim("dp_shard_cp").get_group() if dims is not None and dims.mesh is not None else None
    dp = ranks if data_parallel else 1
    n_micro = len(micro) * ranks
    loss_sum = torch.zeros((), device=device)
    if device.type == "cuda":
        # One iteration of CUDA-graphed blocks (train.compile_mode=reduce-overhead; else a no-op) per optimizer step,
        # not per micro-batch: autograd keeps the first micro-batch's parameter gradients as the graphs' own output
        # buffers (.grad), which a replay in a new iteration would overwrite before the next micro-batch adds to them.
        torch.compiler.cudagraph_mark_step_begin()
    for i, cpu_mb in enumerate(micro):
        if cpu_mb.cu_seqlens is not None and cpu_mb.cu_seqlens.device.type == "cpu":
            check_cu_seqlens(cpu_mb.cu_seqlens, *cpu_mb.inputs.shape)  # on the host: the model reads none on a GPU
        cpu_mb, positions, cp_ctx = _context_parallel(model, cpu_mb, dims, window, device)
        with phase("h2d"):
            mb = cpu_mb.to(device)  # non-blocking; a true async copy from the loader's pinned memory
        if data_parallel:
            sync_after(model, last=i == len(micro) - 1)
        with cp_ctx:  # forward and backward (activation checkpointing recomputes the forward in backward)
            with phase("forward"):
                ce, out = micro_batch_loss(model, mb, autocast, loss_impl, positions)
            with phase("backward"):
                (dp * (ce / data.target_tokens + out.aux_loss / n_micro)).backward()
        loss_sum += ce.detach()
        ctrl.accumulate(out.routing)
    with phase("clip"):
        grad_norm = clip_grad_norm_(list(model.parameters()), grad_clip)
        loss_sum = _all_reduce_sum(loss_sum, group)
    return StepOutput(loss_sum, torch.full((), float(data.target_tokens), device=device), grad_norm)


class DivergenceMonitor:
    """The first step whose loss or gradient norm was not finite, with both values; kept on the device."""

    def __init__(self, device: torch.device):
        self.state = torch.zeros(3, dtype=torch.float64, device=device)  # [step (0: none), loss, grad norm]

    def record(self, step: int, bad: torch.Tensor, out: StepOutput) -> None:
        first = bad & (self.state[0] == 0)
        now = torch.stack((out.loss_sum.new_full((), step, dtype=torch.float64), out.loss.double(),
                           out.grad_norm.double()))
        self.state.copy_(torch.where(first, now, self.state))

    @staticmethod
    def check(state: list[float], last_good: Callable[[], object]) -> None:
        """Raise TrainingDiverged if a step diverged; `state` is `self.state` read on the host, `last_good()` the
        latest checkpoint (asked only then)."""
        step, loss, gnorm = state
        if step:
            raise TrainingDiverged(
                f"training diverged at step {int(step)}: loss {loss:.6g}, grad norm {gnorm:.6g} (not finite); its "
                f"update and any later one were skipped, so the weights are those of step {int(step) - 1}. Last "
                f"good checkpoint: {last_good() or 'none'}. Lower stage.lr or check the data, then re-run.")


def optimizer_step(opt: torch.optim.Optimizer, sched, ctrl, out: StepOutput, monitor: DivergenceMonitor,
                   step: int) -> None:
    """The update of optimizer step `step` (1-based), skipped on the device when the step is not finite."""
    bad = out.nonfinite()
    opt.found_inf = bad.float()  # fused AdamW: no update, no step count when 1 (read in the kernel, no sync)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    with phase("controller"):
        ctrl.step(skip=bad)  # a skipped step leaves the thresholds and the controller state unchanged
    monitor.record(step, bad, out)


class Readout:
    """A step's device values on their way to the host: loss, grad norm, the divergence state and `extra` values
    (the controller's figures), gathered into one copy (later steps may change the sources in place) and copied
    to pinned host memory behind an event, with no host sync. `values()` waits for the copy: the training loop
    asks one step later, when the next step's kernels keep the GPU busy while the host reads."""

    def __init__(self, out: StepOutput, monitor: DivergenceMonitor, extra: Optional[torch.Tensor] = None):
        parts = [out.loss.double().reshape(1), out.grad_norm.double().reshape(1), monitor.state]
        vals = torch.cat(parts + ([extra.double().flatten()] if extra is not None else []))
        self.done = None
        if vals.is_cuda:
            self.host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
            self.host.copy_(vals, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = vals

    def values(self) -> tuple[float, float, list[float], torch.Tensor]:
        """(loss, grad norm, divergence state, extra values (host tensor))."""
        if self.done is not None:
            self.done.synchronize()
        v = self.host
        return float(v[0]), float(v[1]), v[2:5].tolist(), v[5:]


def read_back(out: StepOutput, monitor: DivergenceMonitor) -> tuple[float, float, list[float]]:
    """(loss, grad norm, divergence state) on the host now: one host sync."""
    return Readout(out, monitor).values()[:3]


class StepTimer:
    """Wall time of each step on the device's timeline: CUDA events at step boundaries (no sync), or the host
    clock on CPU. `take()` hands over the marks since the last call; `elapsed` of them once they are complete
    (after a host sync or a later event's)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.restart()

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def restart(self) -> None:
        """Forget the unlogged steps (e.g. after a checkpoint save, whose time is not a step's)."""
        self.marks = [self._now()]

    def mark(self) -> None:
        """End of a step."""
        self.marks.append(self._now())

    def take(self) -> list:
        """The marks of the steps since the last call (the last one stays as the next interval's start)."""
        marks, self.marks = self.marks, self.marks[-1:]
        return marks

    def elapsed(self, marks: list) -> list[float]:
        """Seconds of each step between `take()`'s marks."""
        a, b = marks[:-1], marks[1:]
        return [x.elapsed_time(y) / 1e3 for x, y in zip(a, b)] if self.cuda else [y - x for x, y in zip(a, b)]


def spread(durations: list[float]) -> dict[str, float]:
    """Step-time figures of a logging interval (seconds)."""
    if not durations:
        return {}
    return {"step_time_s": sum(durations) / len(durations), "step_time_min_s": min(durations),
            "step_time_max_s": max(durations)}


def make_optimizer(model: torch.nn.Module, lr: float, betas, eps: float, weight_decay: float):
    """AdamW, fused (CPU and CUDA): needed for the on-device skip of non-finite steps (`found_inf`)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
