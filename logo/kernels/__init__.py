"""Attention ops. `reference` is pure PyTorch (CPU path, test oracle); `triton` holds the GPU kernels.

The model calls attention only through `logo.kernels.dispatch`.
"""
