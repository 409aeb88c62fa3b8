"""Parallelism for a plain `Transformer`: one device mesh (dp_shard, cp, tp), tensor/sequence parallel plans,
context parallelism's attention ops, FSDP2, and the per-GPU memory estimate. The model knows nothing
of it: everything is applied from outside (`parallelize`; `cp.context_parallel` sets a micro-batch's layout on the
attention ops the context-parallel plan installed)."""
from logo.parallel.fsdp import apply_fsdp, parallelize, sync_after
from logo.parallel.mesh import ParallelDims, sum_over_ranks

__all__ = ["ParallelDims", "apply_fsdp", "parallelize", "sum_over_ranks", "sync_after"]
