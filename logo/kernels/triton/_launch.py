"""Triton kernel launches with less host time than `kernel[grid](...)`.

`kernel[grid](*args, **meta)` binds and specializes every argument, hashes the specialization into Triton's cache
key and looks the compiled kernel up on every call, which takes several times the host time of the compiled
kernel's own `run`. A LoGo layer launches about a dozen Triton kernels per training step; where the step is
host-paced (small models, eager mode, slow hosts) that host time is step time.

`launch(kernel, grid, *args, **meta)` launches the same kernel with the same arguments. The first call for a key
goes through `kernel[grid]` (which compiles, or finds Triton's compiled kernel) and remembers the compiled kernel;
later calls with an equal key call its `run` directly. The key is at least as fine as Triton's specialization:
tensors by dtype and address modulo 16 (Triton specializes pointers on 16-byte alignment), integers and booleans
by value (Triton specializes them on value 1, divisibility by 16 and width), None by itself, floats by type (not
specialized), host tensor descriptors by dtype, address modulo 16, shape, strides and block shape, and the
keyword meta-parameters (constexprs, num_warps, num_stages) by value, with the current device. Anything else, the
CPU interpreter, a Triton release outside `_RELEASES` and a launch hook (profilers such as proton set one) take
`kernel[grid]`.
"""
from __future__ import annotations

import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_MAX_ENTRIES = 4096  # keys remembered; a model sees a handful of shapes, so this only bounds a pathological run
_LAUNCH_META = ("num_warps", "num_stages", "num_ctas", "maxnreg")

# (id(kernel), device, meta, argument key) -> (compiled kernel, constexpr values in signature order)
_cache: dict = {}


# Triton releases whose JITFunction.run ends in `compiled.run(grid0, grid1, grid2, stream, compiled.function,
# compiled.packed_metadata, launch_metadata, enter_hook, exit_hook, *bound arguments)`, which `launch` repeats:
# 3.6 (the GPU machines' release; tests/test_triton_launch.py compares the bits there) through 3.9 (read).
_RELEASES = ((3, 6), (3, 9))


def _known_release(version: str) -> bool:
    """Whether a Triton version string names a release in `_RELEASES`."""
    try:
        release = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return _RELEASES[0] <= release <= _RELEASES[1]


def _runtime():
    """Triton's driver and runtime knobs (launch hooks), or None where this Triton's launch path is not known or
    no GPU driver is active."""
    if not _known_release(triton.__version__):
        return None
    try:
        from triton import knobs
        from triton.runtime import driver
        return driver.active, knobs.runtime
    except Exception:  # noqa: BLE001 - no GPU driver (a CPU-only machine): always the plain launch
        return None


_RUNTIME = None if INTERPRET else _runtime()


def _arg_key(a):
    """One argument's share of the key (see the module docstring); raises TypeError for an unknown kind."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15
    if a is None or type(a) is int or type(a) is bool:
        return a
    if type(a) is float:
        return float
    if type(a) is TensorDescriptor:
        return (a.base.dtype, a.base.data_ptr() & 15, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                getattr(a, "padding", None))
    raise TypeError(f"no launch key for a {type(a).__name__}")


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: None or an empty HookChain (Triton >= 3.4's default) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **meta):
    """kernel[grid](*args, **meta) with the host work of a repeated launch cut to the compiled kernel's `run`.
    args: the kernel's leading parameters, in order; meta: the rest by name (constexprs) and launch options."""
    if _RUNTIME is None or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_cuda:
        return kernel[grid](*args, **meta)
    drv, knobs = _RUNTIME
    if _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook):
        return kernel[grid](*args, **meta)
    device = drv.get_current_device()
    try:  # plain tensors and ints inline (most arguments), the rest through _arg_key
        key = (id(kernel), device, tuple(meta.items()), tuple([
            (a.dtype, a.data_ptr() & 15) if type(a) is torch.Tensor else a if type(a) is int else _arg_key(a)
            for a in args]))
    except TypeError:
        return kernel[grid](*args, **meta)
    hit = _cache.get(key)
    if hit is None:
        return _first_launch(key, kernel, grid, args, meta)
    compiled, tail = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, drv.get_current_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args, *tail)
    return compiled


def _first_launch(key, kernel, grid, args, meta):
    """Launch through kernel[grid] and remember the compiled kernel with the constexpr values that follow args in
    the kernel's signature (what `run` takes after the leading arguments)."""
    compiled = kernel[grid](*args, **meta)
    names = kernel.arg_names[len(args):]
    consts = {k: v for k, v in meta.items() if k not in _LAUNCH_META}
    ok = (compiled is not None and set(names) == set(consts) and all(
        hasattr(compiled, a) for a in ("run", "function", "packed_metadata")))
    if ok:  # every later parameter given by name: their values in signature order
        if len(_cache) >= _MAX_ENTRIES:
            _cache.clear()
        _cache[key] = (compiled, tuple(consts[n] for n in names))
    return compiled


def clear():
    """Forget every remembered compiled kernel (tests; a changed kernel source)."""
    _cache.clear()


__all__ = ["launch", "clear"]
