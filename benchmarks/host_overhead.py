"""Host time per call of LoGo's custom ops (GPU): the Python a compiled or eager step spends per layer before the
kernels reach the GPU. A step whose kernels are short waits for this time (docs/benchmarks.md, "Host time per op").

    python benchmarks/host_overhead.py [--rows 1024] [--heads 16] [--dim 128] [--impl triton|flash] [--profile]
                                       [--ops NAME] [--out F]

Per op: the median host time of one call (perf_counter around the call, the GPU drained between batches so its
queue never fills), through the custom op and through the host function it wraps (--impl: the attention ops'
implementation, `logo.kernels.ops.IMPLS`; RoPE and ContextNorm are Triton either way); --profile adds cProfile's
top functions by own time for each op (where the host time goes: our Python, Triton's launcher, allocations).
The rows are few so the GPU finishes every call quickly; the host time does not depend on the row count.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def host_us(fn, calls: int = 300, batch: int = 20) -> float:
    """Median host time of fn() in microseconds."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % batch == batch - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def top_functions(fn, calls: int = 100, top: int = 30) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def cases(n: int, H: int, D: int, impl: str) -> dict:
    """name -> (custom op, the host function it wraps, their shared arguments, the op's last argument) at the 1.5B
    layer's layout: the attention ops take the implementation's name, RoPE and ContextNorm use_triton."""
    from logo.kernels import branches, ops
    from logo.kernels.triton import _fuse, _rope
    _attn = ops._impl(impl)

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do, ol, og = (torch.randn(n, H, D, device=dev, dtype=dt, generator=g) for _ in range(6))
    rows = torch.randperm(n, device=dev, generator=g).to(torch.int32)
    nsel = n // 2
    rows = torch.cat([rows[:nsel].sort().values, rows[nsel:].sort().values])
    pos = torch.arange(n, device=dev, dtype=torch.int32)
    cu_q = torch.tensor([0, nsel], device=dev, dtype=torch.int32)
    cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
    scale = D ** -0.5
    sparse = (pos, rows, cu_q, cu, scale, 0)
    window = (None, None, cu, cu, scale, 128)
    A = torch.eye(D, device=dev).expand(3, H, D, D).contiguous()
    cos = torch.randn(n, D // 2, device=dev)
    sin = torch.randn(n, D // 2, device=dev)
    p = torch.rand(n, device=dev)
    z = p > 0.5
    w = torch.ones(H, D, device=dev)
    ys = _rope.rope_transform_forward(q, k, v, A, cos, sin)
    both = (q, k, v, A, cos, sin, pos, rows, cu_q, cu, scale, 128)  # logo_branches_fwd's, before keep_rotated
    outs = branches.branches_forward(*both, impl)
    return {
        "attention fwd, query-sparse": (ops.range_attention_fwd, _attn.attn_forward, (q, k, v, *sparse), impl),
        "attention bwd, query-sparse": (ops.range_attention_bwd, _attn.attn_backward,
                                        (do, q, k, v, *_attn.attn_forward(q, k, v, *sparse), *sparse), impl),
        "attention fwd, window": (ops.range_attention_fwd, _attn.attn_forward, (q, k, v, *window), impl),
        "attention bwd, window": (ops.range_attention_bwd, _attn.attn_backward,
                                  (do, q, k, v, *_attn.attn_forward(q, k, v, *window), *window), impl),
        "rope_transform fwd": (ops.rope_transform_fwd, _rope.rope_transform_forward, (q, k, v, A, cos, sin), True),
        "rope_transform bwd": (ops.rope_transform_bwd, _rope.rope_transform_backward, (*ys, q, k, v, A, cos, sin),
                               True),
        # the pair replacing rope_transform and both attention ops (3 op calls forward, 4 backward); the host
        # function is the op's body, so it is the body's own figure that adds up the three or four above
        "logo_branches fwd": (branches.logo_branches_fwd, lambda *a: branches.branches_forward(*a[:-1], impl),
                              (*both, False), impl),
        "logo_branches bwd (recompute)": (branches.logo_branches_bwd, lambda *a: branches.branches_backward(*a, impl),
                                          (do, do, q, k, v, A, cos, sin, *outs[:4], [], *both[6:]), impl),
        "context_fuse fwd": (ops.context_fuse_fwd, _fuse.context_fuse_forward, (ol, og, p, z, w, w, 1e-6, True), True),
        "context_fuse bwd": (ops.context_fuse_bwd, _fuse.context_fuse_backward,
                             (do, ol, og, p, z, w, w, 1e-6, True), True),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--impl", default="triton", choices=["triton", "flash"], help="the attention ops' implementation")
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions per op")
    ap.add_argument("--ops", default="", help="only the ops whose name contains this text")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = []
    for name, (op, host_fn, op_args, last) in cases(args.rows, args.heads, args.dim, args.impl).items():
        if args.ops not in name:
            continue
        def op_call():
            return op(*op_args, last)

        def host_call():
            return host_fn(*op_args)

        row = dict(op=name, custom_op_us=round(host_us(op_call), 1), host_function_us=round(host_us(host_call), 1))
        results.append(row)
        print(f"{name:32s} custom op {row['custom_op_us']:7.1f} us   host function {row['host_function_us']:7.1f} us",
              flush=True)
        if args.profile:
            row["profile"] = top_functions(op_call)
            print(row["profile"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), impl=args.impl, rows=results),
                                              indent=1))


if __name__ == "__main__":
    main()
