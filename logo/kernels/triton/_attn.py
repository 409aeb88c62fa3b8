"""Host side of the Triton kernels for LoGo's two attention ops (query-sparse global, sliding-window local).

One family of kernels (`_kernels.py`) serves both ops and dense causal attention. A "range attention" problem
is: packed query rows, dense packed keys/values, and per sequence the offsets cu_q / cu_k; query row r sees
the keys first[r] .. last[r] of its own sequence:

- query-sparse global attention: query slot i < n_sel holds the selected row rows[i] (the rows are
  partitioned, selected first, in sequence then position order); last = cu_k[seq] + q_pos[row],
  first = cu_k[seq]. The grid covers every row (static); n_sel = cu_q[-1] is read in the kernels, blocks of
  dead slots only write zero rows (o, dQ) and zero lse/delta;
- sliding-window attention: q = every row (`DENSE_Q`), last = r, first = max(seq start, r - window + 1);
- dense causal attention: every row, no window.

Forward and dQ kernels run one program per (block of BM query slots, head). Each slot finds its sequence
by a binary search over cu_seqlens inside the kernel (no block maps built on the host, no host sync); a
block may straddle sequences. The smallest/largest `first` and `last` of the block split its key range into
  masked head | unmasked middle (every row sees every key: no predicate) | masked diagonal,
so only blocks that can hold a masked element pay for the mask, and keys after the block's largest `last`
are never touched (paper App. B). The sliding window runs every block through the masked loop instead
(`one_loop`): its blocks see about six key blocks each, and three loops of two never reach a pipelined steady
state (the same bits either way). The dK/dV kernel runs one program per
(KV block, head) and walks the query slots that can see the block: masked head blocks, then unmasked blocks, then
the masked tail (for the window, all through the masked loop). For sparse queries the first slot at/after the
block's first and last key come from a binary search (`_split_kernel`) over the slots' key rows, which the
backward's first pass writes (dead slots sort last; two launches where the torch ops of `key_rows_and_split`, the
reference, take about fourteen); for dense queries they are arithmetic.
The grids are 1-D and ordered by work over a group of heads at once (the query blocks that see the most keys,
the key blocks that the most queries see, first, for every head of the group): with one head after another,
the last head's longest blocks ran alone at the end of the kernel (at 8k tokens and 16 heads a block can be
half of an SM's share of the work); at long sequences one head after another keeps its keys in L2.
`head_group` sizes the group.

dQ comes from a kernel of its own that recomputes P and dP, mirroring the forward (7 matmuls per tile pair in the
backward, deterministic). The dK/dV kernel also needs delta = rowsum(dO * O) per slot (and, for sparse queries,
the key rows and slot-ordered copies below): the dQ kernel, which loads each slot's q and dO once anyway, writes
them in its prologue rather than in a pass of their own (which would read O and dO once more).

TMA (`desc`, on from Hopper at D=128): the forward loads its K/V tiles and the dK/dV kernel its q/dO tiles through
tensor descriptors over (rows, H * D) views instead of per-thread pointers. Sparse queries are scattered rows, which
a descriptor cannot gather, so the first backward pass (which reads q and dO per slot anyway) also writes them in
slot order for the dK/dV kernel: two (N, H, D) copies per backward for a faster dK/dV kernel. The dQ
kernel loads its q/dO once per program and gained nothing from descriptors (not used there).

All accumulation is float32; scores use exp2 with log2(e) folded into the scale; the log-sum-exp is kept in
base 2, (H, N) float32 per slot, between forward and backward. `attn_forward` / `attn_backward` are the op pair
that `logo.kernels.ops` wraps as custom ops (same signatures as in `logo.kernels.reference`).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from logo.kernels.triton._kernels import _dkdv_kernel, _dq_kernel, _fwd_kernel, _split_kernel
from logo.kernels.triton._launch import launch

_LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on the device, in bytes (0 where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def _cfg(D: int, dtype: torch.dtype, window: int, device: torch.device) -> dict:
    """Launch parameters per kernel, (BM, BN, warps, stages), `desc`: TMA tile loads (Hopper on) of K/V in the
    forward and of q/dO in the dK/dV kernel, and `one_loop`: every key (query) block of a program through the
    masked loop instead of the masked head | unmasked middle | masked tail split (the window's blocks see about six
    key blocks, so the split would make three loops too short to pipeline). Read-only: built once per (D, dtype,
    kind, device) (`_default_cfg`), since every attention call asks."""
    return _default_cfg(D, dtype, "window" if window > 0 else "global", device)


@functools.cache
def _default_cfg(D: int, dtype: torch.dtype, kind: str, device: torch.device) -> dict:
    window = kind == "window"
    if INTERPRET or device.type != "cuda":
        c = dict(fwd=(16, 16, 4, 1), dq=(16, 16, 4, 1), dkdv=(16, 16, 4, 1))
    elif dtype == torch.float32:
        c = dict(fwd=(64, 32, 4, 2), dq=(64, 32, 4, 2), dkdv=(32, 64, 4, 2))
    elif window:  # sliding window: small tiles waste the fewest masked keys (sweep on H100, w=128, D=128)
        c = dict(fwd=(64, 32, 4, 3), dq=(64, 32, 4, 3), dkdv=(32, 64, 4, 3))
    elif D <= 64:  # H100 sweeps at D=64, 32 x 1024 and 1 x 8192 tokens (docs/benchmarks.md)
        c = dict(fwd=(64, 64, 4, 3), dq=(64, 64, 4, 3), dkdv=(32, 64, 4, 3))
    else:  # global / causal, D=128: best of the H100 sweep in docs/benchmarks.md
        c = dict(fwd=(128, 128, 8, 3), dq=(128, 64, 8, 3), dkdv=(64, 128, 8, 3))
        if D == 128 and _shared_memory(device) >= 227 << 10:  # Hopper: a 4-stage backward
            c.update(dq=(128, 64, 8, 4), dkdv=(64, 128, 8, 4))
    c["desc"] = dtype != torch.float32 and D >= 128 and not INTERPRET and _has_tma(device)
    # the window's few key blocks per program through one masked loop, not three short ones
    c["one_loop"] = window
    return c


def _prec(dtype):
    if dtype == torch.float32:
        return "ieee"
    return "up" if INTERPRET else "tf32"  # 16-bit operands: tensor-core bf16/fp16 dot (the flag is moot)


def _empty(*shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Every kernel output is allocated here (tests swap in a NaN-filled allocator to catch unwritten rows)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


def _steps(cu: torch.Tensor) -> tuple[int, int]:
    """(number of sequences, binary-search steps over them): host-known shapes, no sync."""
    nseq = cu.shape[0] - 1
    return nseq, max(nseq - 1, 0).bit_length()


def _check_dims(q, what: str = "Triton attention"):
    D = q.shape[-1]
    if D < 16 or D > 256 or (D & (D - 1)) != 0:
        raise ValueError(f"{what} supports head dims 16..256 that are powers of two, got {D}")


# Bytes of the tensors a group of heads re-reads (keys and values in the forward and dQ, queries and dO in the
# dK/dV kernel) that may be in flight at once: past L2's reach (long sequences), every head at once is slower than
# one head after another; within it (8k tokens, 16 heads), all at once is fastest.
L2_GROUP_BYTES = 64 << 20


def head_group(H: int, x: torch.Tensor) -> int:
    """Heads whose programs run interleaved (see `_query_block`): as many as fit two (rows, D) tensors like x
    per head in L2_GROUP_BYTES, at least 1 (one head after another), at most H."""
    per_head = 2 * x.shape[0] * x.shape[-1] * x.element_size()
    return max(1, min(H, L2_GROUP_BYTES // max(per_head, 1)))


def _rowmajor(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _row_desc(x, block_rows: int):
    """A TMA descriptor over x (rows, H, D) as a (rows, H * D) matrix with (block_rows, D) tiles, or None where the
    layout does not allow one (D not unit-stride, heads not adjacent, rows or base not 16-byte aligned)."""
    n, H, D = x.shape
    es = x.element_size()
    if x.stride(2) != 1 or x.stride(1) != D or (x.stride(0) * es) % 16 or x.data_ptr() % 16:
        return None
    return TensorDescriptor(x, shape=[n, H * D], strides=[x.stride(0), 1], block_shape=[block_rows, D])


def _descs(c: dict, block_rows: int, *xs):
    """`_row_desc` of each x when the config asks for TMA loads (`desc`) and every x allows one, else Nones."""
    if not c.get("desc"):
        return (None,) * len(xs)
    ds = tuple(_row_desc(x, block_rows) for x in xs)
    return (None,) * len(xs) if any(d is None for d in ds) else ds


def attn_forward(q, k, v, q_pos, rows, cu_q, cu_k, scale: float, window: int):
    """o (N, H, D) in q's dtype (zero at unselected rows) and lse2 (H, N) float32 per slot (base-2 log-sum-exp of
    the scaled scores; zero for dead slots). rows None: every row a query (DENSE_Q; q_pos is not read)."""
    n, H, D = q.shape
    dense_q = rows is None
    c = _cfg(D, q.dtype, window, q.device)
    BM, BN, warps, stages = c["fwd"]
    o = _empty(*q.shape, like=q)
    lse = _empty(H, n, like=q, dtype=torch.float32)
    if n == 0:
        return o, lse
    nseq, steps = _steps(cu_q)
    nb = triton.cdiv(n, BM)
    kd, vd = _descs(c, BN, k, v)
    launch(_fwd_kernel, (nb * H,), q, k, v, o, lse, cu_q if dense_q else rows, cu_q if dense_q else q_pos, cu_q, cu_k,
        n, nseq, steps, window, nb, H, head_group(H, k), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), o.stride(0), o.stride(1), scale * _LOG2E, kd, vd, WINDOWED=window > 0,
        ONE_LOOP=c["one_loop"], DENSE_Q=dense_q, BM=BM, BN=BN, D=D, PREC=_prec(q.dtype), DESC=kd is not None,
        num_warps=warps, num_stages=stages)
    return o, lse


def key_rows_and_split(q_pos, rows, cu_q, cu_k, nk, block_n):
    """Reference (PyTorch) of what the backward computes in its kernels for sparse queries: each slot's packed key
    row (cu_k[seq] + q_pos[row], ascending over the live slots; dead slots get nk, after every key) and, per KV
    block, the first slot at or after its first and its last key ((2*NB,) int32). The tests compare the two."""
    n = rows.shape[0]
    slots = torch.arange(n, device=rows.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_q[1:], slots, right=True).clamp_max(cu_q.shape[0] - 2)
    kidx = torch.where(slots < cu_q[-1], cu_k[seq] + q_pos[rows.long()], nk).to(torch.int32)
    starts = torch.arange(0, nk, block_n, device=rows.device, dtype=torch.int32)
    bounds = torch.cat([starts, (starts + block_n - 1).clamp_max(nk - 1)])
    return kidx, torch.searchsorted(kidx, bounds).to(torch.int32)


_SPLIT_BLOCK = 128


def attn_backward(do, q, k, v, o, lse, q_pos, rows, cu_q, cu_k, scale: float, window: int):
    """dq (zero at unselected rows), dk, dv of `attn_forward`."""
    n, H, D = q.shape
    nk = k.shape[0]
    dense_q = rows is None
    if n == 0 or nk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    c = _cfg(D, q.dtype, window, q.device)
    prec = _prec(q.dtype)
    do = _rowmajor(do)
    rows_ = cu_q if dense_q else rows
    qpos_ = cu_q if dense_q else q_pos
    nseq, steps = _steps(cu_q)
    delta = _empty(H, n, like=q, dtype=torch.float32)
    # TMA loads of q and dO in the dK/dV kernel: sparse queries read slot-ordered copies written with delta
    compact = bool(c.get("desc")) and not dense_q
    qc, doc = (_empty(*q.shape, like=q), _empty(*q.shape, like=do)) if compact else (q, do)
    qd, dod = _descs(c, c["dkdv"][0], qc, doc)
    # sparse queries: each slot's key row (written with delta), then per KV block its first slots
    kidx = cu_k if dense_q else _empty(n, like=q, dtype=torch.int32)
    # the dQ kernel writes delta, the copies and the key rows in its prologue
    dq = _empty(*q.shape, like=q)
    BM, BN, warps, stages = c["dq"]
    nb = triton.cdiv(n, BM)
    launch(_dq_kernel, (nb * H,), q, k, v, o, do, dq, lse, delta, qc, doc, kidx, rows_, qpos_, cu_q, cu_k, n,
        nseq, nk, steps, window, nb, H, head_group(H, k), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), o.stride(0), o.stride(1), do.stride(0), do.stride(1), dq.stride(0),
        dq.stride(1), scale * _LOG2E, scale, WINDOWED=window > 0, ONE_LOOP=c["one_loop"], DENSE_Q=dense_q,
        COMPACT=compact, BM=BM, BN=BN, D=D, PREC=prec, num_warps=warps, num_stages=stages)
    dk = _empty(*k.shape, like=k)
    dv = _empty(*v.shape, like=v)
    BM, BN, warps, stages = c["dkdv"]
    nbk = triton.cdiv(nk, BN)
    split = cu_k
    if not dense_q:
        split = _empty(2 * nbk, like=q, dtype=torch.int32)
        launch(_split_kernel, (triton.cdiv(2 * nbk, _SPLIT_BLOCK),), kidx, split, n, nk, nbk, n.bit_length(), BN=BN,
            BLOCK=_SPLIT_BLOCK, num_warps=4)
    launch(_dkdv_kernel, (nbk * H,), q, k, v, do, dk, dv, lse, delta, kidx, split, rows_, cu_q, cu_k, n, nk, nbk,
        nseq, steps, window, H, head_group(H, q), qd, dod, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        scale * _LOG2E, scale, WINDOWED=window > 0, ONE_LOOP=c["one_loop"], DENSE_Q=dense_q,
        BM=BM, BN=BN, D=D, PREC=prec, DESC=qd is not None, num_warps=warps, num_stages=stages)
    return dq, dk, dv


def validate(q, k, v):
    """What the kernels support, beyond the op contract's shapes: dtype and head dim (one-line errors)."""
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of float16/bfloat16/float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_dims(q)
