"""One device mesh (dp_shard, cp, tp) for every kind of parallelism, built over NCCL or gloo (CPU).

tp: tensor + sequence parallel ranks (same tokens, heads and FFN columns split); cp: context-parallel ranks
(one sequence split along time); dp_shard: data-parallel FSDP2 ranks (different sequences) = world / (cp x tp).
FSDP shards parameters over the flattened (dp_shard, cp) mesh, as torchtitan does: context-parallel ranks see
different tokens, so their gradients are summed like data-parallel ones. Built with `init_device_mesh` directly:
torchtitan 0.2.2's `ParallelDims.build_mesh` takes its device type from `torchtitan.tools.utils.device_type`,
which is "cuda" even without GPUs, so it cannot build the gloo/CPU mesh of CPU runs and tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from logo.config import ConfigError


@dataclass
class ParallelDims:
    """Sizes of the three mesh dimensions and, when distributed, the mesh itself."""

    dp: int
    cp: int
    tp: int
    mesh: Optional[DeviceMesh] = None
    flat: Optional[DeviceMesh] = None  # the flattened (dp_shard, cp) mesh FSDP shards over, kept as flattened

    @staticmethod
    def sizes(world: int, tp: int, cp: int) -> ParallelDims:
        """Check the layout (one-line errors naming the bad value) without building anything."""
        if tp < 1:
            raise ConfigError(f"invalid config parallel.tp={tp}: must be >= 1")
        if cp < 1:
            raise ConfigError(f"invalid config parallel.cp={cp}: must be >= 1")
        if world % (tp * cp):
            raise ConfigError(f"invalid config parallel.tp={tp}, parallel.cp={cp}: their product {tp * cp} does "
                              f"not divide the {world} ranks")
        return ParallelDims(world // (tp * cp), cp, tp)

    @staticmethod
    def build(world: int, tp: int, cp: int, device_type: str) -> ParallelDims:
        dims = ParallelDims.sizes(world, tp, cp)
        if world > 1:
            dims.mesh = init_device_mesh(device_type, (dims.dp, cp, tp), mesh_dim_names=("dp_shard", "cp", "tp"))
            dims.flat = dims.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return dims

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    def dim(self, name: str) -> DeviceMesh:
        """The mesh of 'dp_shard', 'cp', 'tp' or 'dp_shard_cp' (the flattened one as built: slicing a flattened
        dimension from the root mesh is deprecated). Needs the mesh (a distributed run)."""
        return self.flat if name == "dp_shard_cp" else self.mesh[name]

    def submesh(self, name: str) -> Optional[DeviceMesh]:
        """'dp_shard', 'cp', 'tp' or 'dp_shard_cp' (FSDP), or None when that dimension is 1 (or no mesh)."""
        if self.mesh is None or self.dim(name).size() == 1:
            return None
        return self.dim(name)

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        m = self.submesh(name)
        return None if m is None else m.get_group()

    def rank(self, name: str) -> int:
        return 0 if self.mesh is None else self.dim(name).get_local_rank()

    @property
    def data_rank(self) -> int:
        """Index of this rank's data shard (ranks with equal index read the same sequences)."""
        return self.rank("dp_shard")

    def describe(self) -> str:
        return (f"mesh (dp_shard={self.dp}, cp={self.cp}, tp={self.tp}) over {self.world} rank(s); FSDP over "
                f"dp_shard x cp = {self.dp * self.cp}")


def sum_over_ranks(group: Optional[dist.ProcessGroup]) -> Callable[[torch.Tensor], torch.Tensor]:
    """t -> t summed over the ranks of `group` (in place; all-reduce), or t itself in a single process: the
    `reduce` of `logo.model.BudgetController`, whose routing counts are summed over the ranks that see different
    tokens (dp x cp, never tp)."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t
    return reduce


def set_timeouts(seconds: float) -> None:
    """Every process group of this process (the default one, the mesh's, the gloo side groups) times its collectives
    out after `seconds`, once all ranks got here (a barrier first: no rank may start a collective under the short
    timeout while another still works under the long one). torchtitan does the same after its first step."""
    device_ids = [torch.cuda.current_device()] if dist.get_backend() == "nccl" else None
    dist.barrier(device_ids=device_ids)
    if device_ids:
        torch.cuda.synchronize()
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
