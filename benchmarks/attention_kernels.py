"""LoGo attention kernels vs dense baselines, forward + backward, on one GPU (same run, same inputs).

    python benchmarks/attention_kernels.py --out results/            # the full table (docs/benchmarks.md)
    python benchmarks/attention_kernels.py --lens 8192 --only ours    # a quick look
    python benchmarks/attention_kernels.py --sweep 16384              # block-size sweep of our kernels

Shape of the paper's kernel benchmark: B=1, H=8, D=128, bf16, causal. Times are medians of
`triton.testing.do_bench` (CUDA events); every row is measured twice and both medians are kept, so the
spread between repeats is visible. FLOP accounting as FlashAttention: causal fwd = 2*H*T^2*D, fwd+bwd = 3.5x
fwd; query-sparse rows count only the selected rows' causal work, sliding window only min(t+1, w) keys.

Rows: dense cuDNN / FlashAttention-2 SDPA, dense FlashAttention-4 (when flash-attn-4 is importable), dense FLA
`parallel_attn` (when fla-core is importable), flex attention with compacted queries (block mask cached), flex and
FLA sliding window, cuDNN frontend's `flex_attention` on the query-sparse problem (`--only cudnn_flex`, when
nvidia-cudnn-frontend is importable: its mask plan cached, and rebuilt every call as a changing routing needs);
ours, for each implementation of `--impls` (`logo.kernels.ops.IMPLS`: triton, flash): query-sparse at
rho = 0.25/0.5/0.75/1.0 (random selection), sliding window, dense causal; the routing + partition alone,
and the whole LoGo attention of one layer (gate, routing, partition, branch transforms, RoPE, local and
global branches, ContextNorm and fusion) next to RoPE + dense cuDNN attention.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logo.kernels import ops  # noqa: E402
from logo.kernels.triton import _attn  # noqa: E402

B, H, D = 1, 8, 128
DT = torch.bfloat16
ROWS: list[dict] = []


def bench_ms(fn, reps: int = 2) -> list[float]:
    from triton.testing import do_bench
    fn()
    torch.cuda.synchronize()
    return [do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(reps)]


def record(name, T, fn, flops=None, bytes_=None, rho=None, extra=None):
    try:
        ms = bench_ms(fn)
    except Exception as e:  # noqa: BLE001 - a baseline that does not run here is reported, not fatal
        print(f"{name:34s} T={T:6d} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.empty_cache()
        return None
    m = min(ms)
    row = dict(name=name, T=T, rho=rho, ms=m, ms_repeats=ms)
    if flops:
        row["tflops"] = flops / m / 1e9
    if bytes_:
        row["gbps"] = bytes_ / m / 1e6
    row.update(extra or {})
    ROWS.append(row)
    tail = (f" {row['tflops']:7.1f} TFLOP/s" if flops else "") + (f" {row['gbps']:7.0f} GB/s" if bytes_ else "")
    print(f"{name:34s} T={T:6d} {m:9.3f} ms (repeats {', '.join(f'{x:.3f}' for x in ms)}){tail}", flush=True)
    torch.cuda.empty_cache()
    return m


def fwd_bwd(f, *args):
    gouts = {}

    def run():
        for a in args:
            a.grad = None
        o = f(*args)
        if o.shape not in gouts:
            gouts[o.shape] = torch.randn_like(o)
        o.backward(gouts[o.shape])
    return run


def flops_rows(pos: torch.Tensor) -> float:
    return 3.5 * 4 * B * H * D * float((pos.double() + 1).sum())


def flops_causal(T):
    return 3.5 * 2 * B * H * T * T * D


def flops_window(T, w):
    return 3.5 * 4 * B * H * D * float(sum(min(t + 1, w) for t in range(T)))


def selection(T, rho, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = int(round(T * rho))
    return torch.randperm(T, device="cuda", generator=g)[:n].sort().values


def static_selection(T, rho, seed=0, docs=1):
    """The model's static-shape form of `selection`: rows (T,) int32 (selected first), every row's position
    (T,) int32 and cu_seqlens_q (docs+1,) int32 for `docs` equal sequences (rows of T // docs tokens)."""
    from logo.model.layers import PackedSeqs
    from logo.model.routing import partition
    z = torch.zeros(T, dtype=torch.bool, device="cuda")
    z[selection(T, rho, seed)] = True
    seqs = PackedSeqs.build(docs, T // docs, "cuda")
    sel = partition(z, seqs)
    return sel.rows, seqs.pos, sel.cu_seqlens_q


def qsparse_op(rows, pos, cu_q, cu, impl="triton"):
    return lambda a, b, c: ops.query_sparse_attention(a, b, c, pos, rows, cu_q, cu, impl=impl)


def window_op(cu, window, impl="triton"):
    return lambda a, b, c: ops.sliding_window_attention(a, b, c, cu, window, impl=impl)


def ceilings():
    """Measured device ceilings: copy bandwidth (read + write) and a large bf16 matmul."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = min(bench_ms(lambda: y.copy_(x)))
    bw = 2 * x.numel() / ms / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    b = torch.randn(8192, 8192, device="cuda", dtype=DT)
    ms2 = min(bench_ms(lambda: a @ b))
    tf = 2 * 8192 ** 3 / ms2 / 1e9
    print(f"ceilings: copy {bw:.0f} GB/s, bf16 matmul {tf:.0f} TFLOP/s", flush=True)
    ROWS.append(dict(name="ceiling copy GB/s", value=bw))
    ROWS.append(dict(name="ceiling bf16 matmul TFLOP/s", value=tf))
    x = y = a = b = None  # free the ceilings' buffers before the next measurement
    torch.cuda.empty_cache()


def packed_qkv(T, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(B * T, H, D, device="cuda", dtype=DT, requires_grad=True) for _ in range(3)]


def baselines(T, only):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = [torch.randn(B, H, T, D, device="cuda", dtype=DT, requires_grad=True) for _ in range(3)]
    for name, be in (("dense sdpa cuDNN", SDPBackend.CUDNN_ATTENTION), ("dense sdpa flash2", SDPBackend.FLASH_ATTENTION)):
        def f(q, k, v, be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        record(name, T, fwd_bwd(f, q, k, v), flops_causal(T), rho=1.0)
    try:
        from fla.ops.attn.parallel import parallel_attn
    except Exception as e:  # noqa: BLE001
        print(f"fla not importable ({type(e).__name__}: {e}); FLA rows skipped", flush=True)
        parallel_attn = None
    qt, kt, vt = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001
        print(f"flash-attn-4 not importable ({type(e).__name__}: {e}); FA4 rows skipped", flush=True)
        flash_attn_func = None
    if flash_attn_func is not None:
        record("dense FA4 causal", T, fwd_bwd(lambda a, b, c: flash_attn_func(a, b, c, causal=True)[0], qt, kt, vt),
               flops_causal(T), rho=1.0)
    if parallel_attn is not None:
        record("dense fla parallel_attn", T, fwd_bwd(lambda a, b, c: parallel_attn(a, b, c), qt, kt, vt),
               flops_causal(T), rho=1.0)
        record("local fla parallel_attn w128", T,
               fwd_bwd(lambda a, b, c: parallel_attn(a, b, c, window_size=128), qt, kt, vt), flops_window(T, 128))
    if "flex" in only:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        swa = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 128), None, None, T, T, device="cuda",
                                _compile=True)
        record("local flex w128", T, fwd_bwd(lambda a, b, c: flex(a, b, c, block_mask=swa), q, k, v),
               flops_window(T, 128))
        pos = selection(T, 0.5).to(torch.int32)
        qs = q.detach()[:, :, pos.long()].contiguous().requires_grad_()
        bm = create_block_mask(lambda b, h, qi, ki: pos[qi] >= ki, None, None, pos.numel(), T, device="cuda",
                               _compile=True)
        record("qsparse flex rho=0.5 (mask cached)", T, fwd_bwd(lambda a, b, c: flex(a, b, c, block_mask=bm), qs, k, v),
               flops_rows(pos), rho=0.5)
    del q, k, v, qt, kt, vt


def ours(T, rhos, window, impl="triton"):
    """The op pair of one implementation (`logo.kernels.ops.IMPLS`) through the custom ops, as the model calls it."""
    q, k, v = packed_qkv(T)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    tensor_bytes = B * T * H * D * 2
    for rho in rhos:  # static shapes: q, o, dq over all T rows, the kernels read the selected rows
        rows, pos, cu_q = static_selection(T, rho)
        record(f"qsparse {impl} rho={rho}", T, fwd_bwd(qsparse_op(rows, pos, cu_q, cu, impl), q, k, v),
               flops_rows(selection(T, rho)), rho=rho, extra=dict(impl=impl))
    record(f"local {impl} w{window}", T, fwd_bwd(window_op(cu, window, impl), q, k, v), flops_window(T, window),
           bytes_=12 * tensor_bytes, extra=dict(impl=impl))
    record(f"dense causal {impl}", T, fwd_bwd(lambda a, b, c: ops.causal_attention(a, b, c, cu, impl=impl), q, k, v),
           flops_causal(T), rho=1.0, extra=dict(impl=impl))
    del q, k, v


def cudnn_flex(T, rhos):
    """cuDNN frontend's flex_attention on the query-sparse problem: the selected queries compacted (n, H, D) over
    every key, each query's keys [0, its position] as an interval mask; its mask plan built once (cached) and, as
    a routing that changes every step needs, rebuilt in every call (the plan's build reads sizes on the host)."""
    try:
        from cudnn.flex_attention import create_mask_plan, flex_attn_func
    except Exception as e:  # noqa: BLE001
        print(f"cudnn.flex_attention not importable ({type(e).__name__}: {e}); its rows skipped", flush=True)
        return
    k, v = [torch.randn(1, T, H, D, device="cuda", dtype=DT, requires_grad=True) for _ in range(2)]
    for rho in rhos:
        pos = selection(T, rho).to(torch.int32)
        qc = torch.randn(1, pos.numel(), H, D, device="cuda", dtype=DT, requires_grad=True)
        limits = (pos + 1).view(1, 1, -1).contiguous()  # visible keys [0, pos + 1)

        def plan():
            return create_mask_plan(limits, qc, k, v, build_backward=True)
        cached = plan()
        record(f"qsparse cudnn.flex rho={rho} (plan cached)", T,
               fwd_bwd(lambda a, b, c: flex_attn_func(a, b, c, mask_plan=cached), qc, k, v), flops_rows(pos), rho=rho)
        record(f"qsparse cudnn.flex rho={rho} (plan per call)", T,
               fwd_bwd(lambda a, b, c: flex_attn_func(a, b, c, mask_plan=plan()), qc, k, v), flops_rows(pos), rho=rho)


def routing_cost(T):
    """Gate routing + the static partition of the rows (selected first), as the model does it (no host sync)."""
    from logo.model.layers import PackedSeqs
    from logo.model.logo_attention import route
    from logo.model.routing import partition
    seqs = PackedSeqs.build(B, T, "cuda")
    p = torch.rand(B * T, device="cuda")
    th = torch.full((1,), 0.5, device="cuda")

    def run():
        return partition(route(p, th, seqs), seqs).rows
    record("routing+partition", T, run)


def logo_layer(T, window, out: Path, profile_it: bool):
    """The LoGo attention of one layer (everything between the shared W_q/W_k/W_v projections and W_o: gate,
    routing, partition, LP transforms, RoPE, both branches, ContextNorm, fusion) vs RoPE + dense cuDNN; eager,
    and compiled with fullgraph=True (the custom ops inside one graph)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from logo.config import AttentionConfig, ModelConfig
    from logo.kernels.rope import apply_rope
    from logo.model.layers import PackedSeqs, rope_cos_sin
    from logo.model.logo_attention import LoGoAttention
    cfg = ModelConfig(dim=H * D, n_heads=H, n_layers=1, attention=AttentionConfig(kind="logo", window=window))
    layer = LoGoAttention(cfg).cuda()
    layer.init_weights(0.02, 0.02)
    layer.to(DT)
    x = torch.randn(B, T, H * D, device="cuda", dtype=DT, requires_grad=True)
    q, k, v = [torch.randn(B, T, H, D, device="cuda", dtype=DT, requires_grad=True) for _ in range(3)]
    with torch.no_grad():
        layer.threshold.data = layer.gate_probs(x).median().reshape(1).float()  # about half the rows global
    seqs = PackedSeqs.build(B, T, "cuda")
    cos, sin = rope_cos_sin(T, D, 10000.0, "cuda")

    def logo_fn(x, q, k, v):
        return layer.branches(x, x, q, k, v, cos, sin, seqs)[0]
    with torch.no_grad():
        ratio = float(layer.branches(x, x, q, k, v, cos, sin, seqs)[2].float().mean())
    run = fwd_bwd(logo_fn, x, q, k, v)
    record(f"LoGo layer (rho~{ratio:.2f}, w{window})", T, run, rho=ratio)
    compiled = torch.compile(layer.branches, fullgraph=True)  # glue fused by Inductor around the custom ops
    record("LoGo layer, torch.compile fullgraph", T,
           fwd_bwd(lambda x, q, k, v: compiled(x, x, q, k, v, cos, sin, seqs)[0], x, q, k, v), rho=ratio)

    def dense(q, k, v):
        qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
    record("RoPE + dense sdpa cuDNN", T, fwd_bwd(dense, q, k, v), rho=1.0)
    record("dense sdpa cuDNN (no RoPE)", T, fwd_bwd(
        lambda a, b, c: _sdpa_cudnn(a, b, c), *[t.detach().transpose(1, 2).contiguous().requires_grad_()
                                               for t in (q, k, v)]), flops_causal(T), rho=1.0)
    if profile_it:
        profile_table(run, f"LoGo layer T={T}", out / f"profile_layer_{T}.txt", rows=25)


def profile_table(fn, title: str, path: Path, rows: int = 12) -> None:
    """torch.profiler over 5 calls of fn (after 3 warm-ups): CUDA time per kernel, printed and saved."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
    print(f"--- profile {title} (5 iterations)\n{table}", flush=True)
    path.write_text(table)


def _sdpa_cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sweep_configs(kind):
    """(label, launch parameters over the defaults (`_attn._default_cfg`), timed part) triples for one kernel
    kind."""
    if kind == "global":
        fwd = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3),
               (64, 64, 4, 4), (128, 64, 4, 3)]
        dq = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
              (64, 128, 8, 3)]
        dkdv = [(64, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 4), (32, 128, 8, 3),
                (64, 64, 8, 3), (32, 128, 4, 4), (128, 64, 8, 3), (64, 64, 4, 4), (32, 64, 4, 3)]
    else:
        fwd = [(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3)]
        dq = [(128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3)]
        dkdv = [(64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3)]
    out = [(f"fwd {c}", {"fwd": c}, "fwd") for c in fwd]
    out += [(f"dq {c}", {"dq": c}, "bwd") for c in dq]
    out += [(f"dkdv {c}", {"dkdv": c}, "bwd") for c in dkdv]
    return out


def sweep(T, window, sweep_filter=(), docs=1):
    """Each kernel's block sizes / warps / stages, one at a time, at rho=0.5 (global) and for the window;
    the backward rows time the whole backward (dQ with delta, then dK/dV). docs: equal sequences in the T tokens.
    Each row's parameters replace the kernels' `_attn._cfg` while it is timed."""
    q, k, v = packed_qkv(T)
    cu = torch.arange(0, T + 1, T // docs, dtype=torch.int32, device="cuda")
    rows, pos, cu_q = static_selection(T, 0.5, docs=docs)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    scale = 1 / math.sqrt(D)
    default_cfg = _attn._cfg
    for kind, (qp, rw, cq, w) in {"global": (pos, rows, cu_q, 0), "window": (None, None, cu, window)}.items():
        o, lse = _attn.attn_forward(qd, kd, vd, qp, rw, cq, cu, scale, w)
        do = torch.randn_like(o)
        for label, override, part in _sweep_configs(kind):
            if sweep_filter and not any(f in f"{kind} {label}" for f in sweep_filter):
                continue
            _attn._cfg = (lambda *a, o=override: {**default_cfg(*a), **o})
            def fn(part=part):
                if part == "fwd":
                    return _attn.attn_forward(qd, kd, vd, qp, rw, cq, cu, scale, w)
                return _attn.attn_backward(do, qd, kd, vd, o, lse, qp, rw, cq, cu, scale, w)
            try:
                record(f"sweep {kind} {label}", T, fn, extra=dict(kind=kind, part=part, override=str(override)))
            finally:
                _attn._cfg = default_cfg


def profile(T, window, out: Path):
    """CUDA time per kernel (torch.profiler) for one fwd+bwd of query-sparse rho=0.5 and of the window:
    shows what the wall time is made of (kernels vs gaps)."""
    q, k, v = packed_qkv(T)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    rows, pos, cu_q = static_selection(T, 0.5)
    cases = {"qsparse rho=0.5": fwd_bwd(qsparse_op(rows, pos, cu_q, cu), q, k, v),
             f"local w{window}": fwd_bwd(window_op(cu, window), q, k, v)}
    for name, fn in cases.items():
        profile_table(fn, f"{name} T={T}", out / f"profile_{name.split()[0]}_{T}.txt")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="4096,8192,16384,32768,65536")
    ap.add_argument("--rhos", default="0.25,0.5,0.75,1.0")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--heads", type=int, default=H, help="heads (H=16 is the 1.5B model's layer)")
    ap.add_argument("--head-dim", type=int, default=D, help="head dim (64: model_step's small shape)")
    ap.add_argument("--docs", type=int, default=1, help="--sweep: equal sequences in the T tokens")
    ap.add_argument("--only", default="ceilings,baselines,flex,ours,routing,layer",
                    help="comma list of: ceilings, baselines, flex, cudnn_flex, ours, routing, layer")
    ap.add_argument("--impls", default="triton,flash", help="implementations of our ops to time (ours)")
    ap.add_argument("--sweep", type=int, default=0, help="sequence length for a block-size sweep (0: none)")
    ap.add_argument("--layer-lens", default="8192,32768")
    ap.add_argument("--sweep-filter", default="", help="comma list of substrings of sweep rows to run (e.g. 'global dkdv')")
    ap.add_argument("--profile-layer", action="store_true", help="torch.profiler breakdown of the LoGo layer")
    ap.add_argument("--profile", type=int, default=0, help="sequence length for a torch.profiler breakdown (0: none)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    globals().update(H=a.heads, D=a.head_dim)
    only = set(a.only.split(","))
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    torch._dynamo.config.cache_size_limit = 64
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if "ceilings" in only:
        ceilings()
    if a.profile:
        profile(a.profile, a.window, out)
    if a.sweep:
        sweep(a.sweep, a.window, [f for f in a.sweep_filter.split(",") if f], a.docs)
    for T in [int(x) for x in a.lens.split(",") if x]:
        if "baselines" in only:
            baselines(T, only)
        if "cudnn_flex" in only:
            cudnn_flex(T, [float(r) for r in a.rhos.split(",") if float(r) < 1.0])
        if "ours" in only:
            for impl in a.impls.split(","):
                ours(T, [float(r) for r in a.rhos.split(",")], a.window, impl)
        if "routing" in only:
            routing_cost(T)
    if "layer" in only:
        for T in [int(x) for x in a.layer_lens.split(",") if x]:
            logo_layer(T, a.window, out, a.profile_layer)
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), time=time.strftime("%Y-%m-%d %H:%M"),
                argv=sys.argv[1:], heads=H, head_dim=D)
    (out / "attention_kernels.json").write_text(json.dumps(dict(meta=meta, rows=ROWS), indent=1))
    print(f"wrote {out / 'attention_kernels.json'}")


if __name__ == "__main__":
    main()
