"""Apply parallelism and memory/speed wrappers to a plain `Transformer`.

The model module knows nothing of what happens here. Order (as in torchtitan): tensor/sequence parallelism
(`logo/parallel/tp.py`), context parallelism's attention ops (`logo/parallel/cp.py`), activation checkpointing
(torchtitan's `apply_ac`), torch.compile of each (checkpointed) block, then data parallelism over the dp_shard x cp
ranks, one of:
- replicate (DDP, `torch.distributed._composable.replicate`): every rank holds the whole fp32 model and runs it
  under bf16 autocast exactly as one GPU does; gradients are all-reduced in buckets while the backward runs (a
  model with LoGo layers, no context parallelism and no CUDA graphs: in one all-reduce after it, `ddp_bucket_mb`). No
  per-module hooks in the forward and no weight traffic: the fastest choice whenever the whole training state fits;
- shard (FSDP2): `fully_shard` on the embedding, on every block, on [final norm, output head] and on the root,
  with a bf16/fp32 `MixedPrecisionPolicy`: weights, gradients and optimizer states sharded, each unit's bf16
  weights all-gathered before use.
Both average gradients over the data-parallel ranks (FSDP's default: a custom divide factor needs
ReduceOp.PREMUL_SUM, which gloo lacks); the trainer scales each rank's loss by the number of ranks and divides it
by the global number of target tokens, so a step's gradient is the token mean over the global batch for any number
of ranks (and equal to a single-process run of the same batch). Within a step, gradients are reduced (and FSDP's
gathered weights freed) only after the last micro-batch (`sync_after`).

Only APIs present in torch 2.11 .. 2.13 are used (`torch.distributed.fsdp.fully_shard`, `init_device_mesh`).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from logo.parallel.tp import apply_tp
from logo.parallel.cp import apply_cp

log = logging.getLogger("logo")


def apply_fsdp(model: torch.nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: str = "auto",
               forward_prefetch: int = 1, backward_prefetch: int = 1) -> None:
    """FSDP2: one unit for the embedding, one per transformer block, one for [final norm, output head], and the root.

    reshard_after_forward: "auto" frees every unit's gathered parameters after its forward except the last
    block and norm+head, whose backward follows at once (one all-gather per micro-batch saved, as torchtitan's
    default); "always" frees all but norm+head; "never" keeps every unit gathered from forward to backward (no
    all-gathers in backward; the whole model in param_dtype stays in memory during a micro-batch).
    forward_prefetch / backward_prefetch = n: each unit issues the all-gathers of the next n units (in forward
    order / in reverse order) explicitly from its own pre-hook, so they are in flight before the CPU reaches
    those units; this keeps the overlap when host syncs inside a unit (LoGo routing) stop the CPU from running
    ahead. 0 leaves FSDP2's implicit prefetching.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    blocks = list(model.layers.values())
    reshard = reshard_after_forward != "never"
    fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **kw)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard and not (last and reshard_after_forward == "auto"), **kw)
    # The head is used right after the last block; keeping it unsharded after forward saves one all-gather.
    fully_shard([model.norm, model.output], reshard_after_forward=False, **kw)
    fully_shard(model, **kw)
    units = [model.tok_embeddings, *blocks, model.norm]  # forward order (model.norm stands for norm+head)
    if forward_prefetch > 0:
        for i, unit in enumerate(units[:-1]):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + forward_prefetch])
    if backward_prefetch > 0:
        rev = units[::-1]
        for i, unit in enumerate(rev[:-1]):
            unit.set_modules_to_backward_prefetch(rev[i + 1:i + 1 + backward_prefetch])


DDP_BUCKET_MB = 100  # gradient all-reduce bucket of a model without LoGo layers (parallel.bucket_mb=null)


def gradient_mib(model: torch.nn.Module) -> int:
    """MiB of the model's gradients (trainable parameters, in their dtype), rounded up."""
    return -(-sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) // 2**20)


def ddp_bucket_mb(model: torch.nn.Module, context_parallel: bool = False, cuda_graphs: bool = False) -> int:
    """The automatic all-reduce bucket (parallel.bucket_mb=null): for a model with LoGo layers whose blocks are not
    CUDA graphs, one bucket of every gradient (past DDP's first bucket of 1 MiB), so the all-reduce runs after the
    backward instead of beside it (on 4 GPUs of one host such ranks wait for their hosts, and the overlapping
    collectives cost the backward more than they saved; docs/benchmarks.md); otherwise `DDP_BUCKET_MB`: full
    attention, context parallelism (whose long backward hid the buckets' all-reduce but for a few ms) and
    CUDA-graphed blocks (no host pacing the ranks: the buckets' all-reduce hides under the backward)."""
    one_bucket = bool(getattr(model, "logo_layer_ids", None)) and not (context_parallel or cuda_graphs)
    return gradient_mib(model) + 1 if one_bucket else DDP_BUCKET_MB


def apply_ddp(model: torch.nn.Module, dp_mesh: DeviceMesh, reduce_dtype: torch.dtype = torch.float32,
              bucket_mb: int = DDP_BUCKET_MB) -> None:
    """Replicated data parallelism over dp_mesh (composable DDP: parameter names unchanged). reduce_dtype bf16:
    gradients all-reduced in bf16 (half the bytes) through DDP's compression hook; bucket_mb: MiB of gradients
    per all-reduce (`gradient_mib(model)` or more: one all-reduce, after the backward)."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    device = next(model.parameters()).device
    on_gpu = {"device_id": device} if device.type == "cuda" else {}
    replicate(model, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
              broadcast_buffers=False, **on_gpu)
    if reduce_dtype == torch.bfloat16:
        model.register_comm_hook(dp_mesh.get_group(), default_hooks.bf16_compress_hook)


def sync_after(model: torch.nn.Module, last: bool) -> None:
    """Before each micro-batch of a step: gradients are reduced over the data-parallel ranks only in the `last`
    one's backward (the others accumulate locally), and FSDP keeps its gathered weights from one micro-batch's
    backward to the next one's forward (one all-gather per unit and step saved), freeing them after the last."""
    model.set_requires_gradient_sync(last)
    if isinstance(model, FSDPModule):
        model.set_reshard_after_backward(last)


# Inductor options of the compiled blocks, on top of those of train.compile_mode. realize_reads_threshold: Inductor
# stores a pointwise result that several kernels read once it reads more than this many buffers (default 4), and
# recomputes it in each reader otherwise. The LoGo layer's gate adds its rank-1 gradient (dlogit w_g^T) to the sum of
# the three projections' input gradients: six buffers, so that sum would be written in float32 for the two
# reductions of the attention norm's backward (the input's and the weight's gradient), one more pass over
# (tokens, dim) per layer. At 8 both reductions recompute it from the bf16 gradients, as they recompute full
# attention's three-buffer sum.
BLOCK_INDUCTOR_OPTIONS = {"realize_reads_threshold": 8}


def block_compile_options(compile_mode: str) -> dict:
    """torch.compile options of each block: the mode's own (`torch._inductor.list_mode_options`; reduce-overhead:
    CUDA graphs) plus `BLOCK_INDUCTOR_OPTIONS` (torch.compile takes a mode or options, not both)."""
    from torch._inductor import list_mode_options
    return {**list_mode_options(compile_mode), **BLOCK_INDUCTOR_OPTIONS}


def parallelize(model: torch.nn.Module, dp_mesh: Optional[DeviceMesh], param_dtype: torch.dtype,
                activation_checkpointing: bool = False, compile_blocks: bool = False,
                fsdp: Optional[dict] = None, tp_mesh: Optional[DeviceMesh] = None,
                compile_mode: str = "default", cp_mesh: Optional[DeviceMesh] = None,
                data_parallel: str = "shard") -> torch.nn.Module:
    """In place: tensor parallelism over tp_mesh, context parallelism's attention ops over cp_mesh, activation
    checkpointing, compile, then data parallelism over dp_mesh (the flattened dp_shard x cp mesh), each when there
    is one. data_parallel: "shard" (FSDP2, weights in param_dtype) or "replicate" (DDP; the caller runs the forward
    under autocast, as on one GPU). `fsdp`: keyword options of `apply_fsdp` (reduce_dtype, reshard_after_forward,
    forward/backward_prefetch) and bucket_mb; replicate takes reduce_dtype and bucket_mb (None: `ddp_bucket_mb`).
    compile_mode: torch.compile's mode for the blocks (train.compile_mode; reduce-overhead replays them as CUDA
    graphs: on one device or under replicated data parallelism, whose all-reduce runs outside the blocks)."""
    cuda_graphs = compile_blocks and compile_mode == "reduce-overhead"
    communicates_inside = tp_mesh is not None or cp_mesh is not None or (dp_mesh is not None
                                                                         and data_parallel != "replicate")
    if cuda_graphs and communicates_inside:
        raise ValueError("train.compile_mode=reduce-overhead (CUDA graphs) runs on one device or under replicated "
                         "data parallelism only: FSDP, tensor and context parallelism communicate inside the blocks; "
                         "use train.compile_mode=default")
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
        if dist.get_rank() == 0:
            log.info("tensor + sequence parallel over %d ranks", tp_mesh.size())
    if cp_mesh is not None:
        apply_cp(model, cp_mesh.get_group())
    if activation_checkpointing:
        from torchtitan.config.job_config import ActivationCheckpoint
        from torchtitan.distributed.activation_checkpoint import apply_ac
        for block in model.layers.values():  # the block's rerun forward replaces the branch inputs' recomputation
            block.attention.attention_ops.block_recomputed = True
        apply_ac(model, ActivationCheckpoint(mode="full"))
    if compile_blocks:
        # Each (checkpointed) block compiled in place (parameter names unchanged, so checkpoints do not depend on
        # it), whole: the attention ops are custom ops and LoGo's routing has static shapes (no graph breaks).
        options = block_compile_options(compile_mode)
        for block in model.layers.values():
            block.compile(options=options)
    opts = dict(fsdp or {})
    bucket_mb = opts.pop("bucket_mb", None)
    if dp_mesh is not None and data_parallel == "replicate":
        bucket_mb = bucket_mb or ddp_bucket_mb(model, context_parallel=cp_mesh is not None, cuda_graphs=cuda_graphs)
        reduce = opts.get("reduce_dtype", torch.float32)
        apply_ddp(model, dp_mesh, reduce, bucket_mb)
        if dist.get_rank() == 0:
            buckets = ("in one all-reduce after the backward" if bucket_mb >= gradient_mib(model)
                       else f"in buckets of {bucket_mb} MiB during the backward")
            log.info("DDP data parallel over %d ranks (whole weights, gradients all-reduced in %s %s)",
                     dp_mesh.size(), str(reduce).removeprefix("torch."), buckets)
    elif dp_mesh is not None:
        apply_fsdp(model, dp_mesh, param_dtype, **opts)
        if dist.get_rank() == 0:
            reduce = opts.get("reduce_dtype", torch.float32)
            log.info("FSDP2 data parallel over %d ranks (%s mesh, params in %s, gradients reduced in %s, "
                     "reshard after forward: %s, prefetch forward %d / backward %d)", dp_mesh.size(),
                     dp_mesh.device_type, str(param_dtype).removeprefix("torch."), str(reduce).removeprefix("torch."),
                     opts.get("reshard_after_forward", "auto"), opts.get("forward_prefetch", 1),
                     opts.get("backward_prefetch", 1))
    return model
