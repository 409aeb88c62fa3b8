"""Parallelism for a plain `Transformer`: one device mesh (dp_shard, cp, tp), tensor/sequence parallel plans,
context parallelism around the attention ops, FSDP2, and the per-GPU memory estimate. The model knows nothing
of it: everything is applied from outside (`parallelize`) or around a forward (`cp.context_parallel`)."""
from logo.parallel.fsdp import apply_fsdp, build_dp_mesh, parallelize
from logo.parallel.mesh import ParallelDims

__all__ = ["ParallelDims", "apply_fsdp", "build_dp_mesh", "parallelize"]
