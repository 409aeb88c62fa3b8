"""Selective recomputation of the LoGo branches' inputs: keep the attention kernels' outputs, recompute the rest.

Between the shared pre-RoPE q, k, v and the two attention ops lie only cheap maps (the per-head branch transform
and RoPE), yet autograd would keep every one of their outputs for the backward: the rotated local q, k and the
global q, k, v, five (N, H, D) tensors per layer. Under `recompute_all_but_attention` the backward recomputes
them from q, k, v (kept anyway) and keeps only what the attention ops return. Same values and gradients
(the recomputation repeats the forward's arithmetic, the fused RoPE + transform op included); in eager mode
and under `torch.compile` (which reads the same policy). The LoGo layer applies it to its composition of the
separate ops where `logo.kernels.dispatch.AttentionOps.recomputes_branch_inputs` (while torch.compile traces).
"""
from __future__ import annotations

import logging
from functools import partial

from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _keep_only_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save the outputs of the attention ops and of collectives (context parallelism gathers keys and values
    inside the region: recomputing would repeat the communication); recompute everything else."""
    ns = getattr(op, "namespace", "")
    if ns == "logo" and not op.name().startswith("logo::rope_transform"):  # the fused RoPE is recomputed
        return CheckpointPolicy.MUST_SAVE
    if ns.startswith("_c10d_functional") or ns == "c10d_functional":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _KnownRegionFilter(logging.Filter):
    """torch.compile warns once per process that a checkpoint with a policy must not hold in-place ops; the
    region here (branch transform, RoPE, the attention ops) holds none (tests/test_logo_layer.py compares the
    gradients), so the warning only adds noise to every compiled run's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_KnownRegionFilter())


def recompute_all_but_attention(fn, *args):
    """fn(*args) whose backward recomputes every intermediate except the attention ops' outputs."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _keep_only_attention))
