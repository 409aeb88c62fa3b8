"""Moved to `logo.parallel` (this import path keeps working)."""
from logo.parallel.fsdp import apply_fsdp, build_dp_mesh, parallelize  # noqa: F401
