"""Tensor + sequence parallelism (DTensor plans in the style of torchtitan's Llama `parallelize`).

Between blocks the residual stream is sharded along time (Shard(1): sequence parallel), with the RMSNorms
computed on the shards; each attention / feed-forward module all-gathers its input, runs column-wise q/k/v
and w1/w3 (heads and FFN columns split over the tp ranks), and row-wise wo/w2 reduce-scatter back to Shard(1).
LoGo's own parameters shard with their heads: the LP/SO transforms (3, H, ...) on dim 1, the per-head
ContextNorms (H, D) on dim 0, the `full` variant's global projections column-wise. The gate reads the whole
(all-gathered) hidden state with a replicated weight, so every tp rank of a group computes the same p and
makes the same routing decisions; its gradient is a partial sum over the ranks' heads (`Partial`), reduced by
DTensor. The aux-loss ablation adds the same replicated loss on every tp rank: its gradient is scaled by 1/tp
so that the partial sums add up to it once. The LM head is split over the vocabulary and its logits all-gathered,
so with tp > 1 the loss is the plain one on those logits (the fused losses need the whole head weight on one rank;
`train.loss=auto` resolves to `plain`). Heads are split in contiguous blocks; the attention modules read their
head count from the projections' outputs, and only the intra-layer hybrid's `n_global` (how many of the heads a
rank holds are global) is set per rank.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from logo.config import ConfigError
from logo.model.attention import IntraLayerHybridAttention
from logo.model.layers import RMSNorm
from logo.model.logo_attention import BranchTransform, LoGoAttention


def check_tp(cfg, tp: int) -> None:
    """Heads and FFN columns must split evenly over the tp ranks."""
    for name, n in (("model.n_heads", cfg.n_heads), ("model.hidden_dim", cfg.hidden_dim),
                    ("model.padded_vocab_size", cfg.padded_vocab_size)):
        if n % tp:
            raise ConfigError(f"invalid config parallel.tp={tp}: {name}={n} is not divisible by it")


def _shard_params(dim_of):
    """partition_fn: every parameter of the module becomes a DTensor sharded on dim_of(param) (heads)."""
    def partition(name, module, mesh):
        for pname, p in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(p.data, mesh, [Shard(dim_of(pname, p))])
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))
    return partition


def _heads_in(head_dim: int):
    """input_fn: local per-head tensors (..., H_local, D) at position `head_dim` from the end -> DTensor."""
    def fn(module, inputs, mesh):
        out = []
        for x in inputs:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(x.dim() - head_dim)], run_check=False)
            out.append(x)
        return tuple(out)
    return fn


def _to_local(module, out, mesh):
    return out.to_local() if isinstance(out, DTensor) else out


def _shard_per_head(module: nn.Module, mesh: DeviceMesh) -> None:
    """BranchTransform (3, H, ...) params on dim 1; head-wise RMSNorm (H, D) on dim 0; computed as DTensors."""
    if isinstance(module, BranchTransform):
        if module.kind in ("lp", "so"):
            distribute_module(module, mesh, _shard_params(lambda n, p: 1), _heads_in(2), _to_local)
    elif isinstance(module, RMSNorm):
        distribute_module(module, mesh, _shard_params(lambda n, p: 0), _heads_in(2), _to_local)


def _replicate_params(name, module, mesh):
    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))


def _gate_in(module, inputs, mesh):
    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) else t
                 for t in inputs)


def _gate_out(module, p, mesh):
    # Same value on every tp rank; its gradient arrives from each rank's own heads: a partial sum.
    return p.to_local(grad_placements=[Partial()])


def _scale_aux_grad(tp: int):
    def hook(module, args, output):
        out, aux, stats = output
        if aux is None:
            return output
        return out, aux / tp + (aux * (1.0 - 1.0 / tp)).detach(), stats
    return hook


def _attention_plan(attn: nn.Module) -> dict:
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=Shard(1))}
    if isinstance(attn, LoGoAttention) and attn.attn_cfg.transform == "full":
        plan.update(wq_g=ColwiseParallel(), wk_g=ColwiseParallel(), wv_g=ColwiseParallel())
    return plan


def _localize_global_heads(attn: IntraLayerHybridAttention, tp: int, tp_rank: int) -> None:
    """The intra-layer hybrid's global heads among those this rank holds (contiguous block tp_rank of H / tp)."""
    h = attn.n_heads // tp
    attn.n_global = min(max(attn.n_global - tp_rank * h, 0), h)


def _wait_for_output(module, inputs, out):
    """The embedding's sequence-parallel output arrives as an AsyncCollectiveTensor (its reduce-scatter still in
    flight). Fed as such into a compiled block, AOTAutograd treats it as a tensor subclass and drops its gradient
    (the embedding's backward then receives none); waiting here hands the block a plain tensor, with the wait
    itself in the autograd graph (an identity in the backward)."""
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """In place: tensor + sequence parallel plan over tp_mesh (before FSDP, AC and compile)."""
    tp, tp_rank = tp_mesh.size(), tp_mesh.get_local_rank()
    check_tp(model.cfg, tp)
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # vocab-split head, logits all-gathered: with tp > 1 the trainer takes the plain loss on the logits
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    })
    model.tok_embeddings.register_forward_hook(_wait_for_output)
    for block in model.layers.values():
        attn = block.attention
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None),
                                            use_local_output=True),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        parallelize_module(attn, tp_mesh, _attention_plan(attn))
        if isinstance(attn, LoGoAttention):
            _shard_per_head(attn.transform, tp_mesh)
            for norm in (attn.norm_local, attn.norm_global):
                _shard_per_head(norm, tp_mesh)
            distribute_module(attn.gate, tp_mesh, _replicate_params, _gate_in, _gate_out)
            if attn.attn_cfg.budget_control == "aux_loss":
                attn.register_forward_hook(_scale_aux_grad(tp))
        if isinstance(attn, IntraLayerHybridAttention):
            _localize_global_heads(attn, tp, tp_rank)
