"""The decode attention kernel (`logo.kernels.triton._decode`, split-K over the cache) against the reference
(`logo.kernels.reference.decode_attention`), and the reference against a plain softmax in float64.

Without a GPU the kernel runs under the Triton CPU interpreter at small shapes; on CUDA also at decoding's sizes.
Tolerances (||out - ref|| <= rtol * ||ref|| + atol * sqrt(numel), reference in float64 on the same rounded inputs):
fp32 rtol 2e-5 (only the summation order differs); bf16 rtol 1e-2 (the output is rounded to bf16 once).
Inactive rows and rows with no key are exactly zero.
"""
import math

import pytest
import torch

from logo.kernels import reference as ref
from logo.kernels.triton import _decode

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RTOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


def cache(B, H, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)
    k = torch.randn(B, H, S, D, generator=g)
    v = torch.randn(B, H, S, D, generator=g)
    return (t.to(device=DEVICE, dtype=dtype) for t in (q, k, v))


def close(out, want, dtype):
    out, want = out.double(), want.double()
    assert torch.isfinite(out).all()
    err = (out - want).norm().item()
    bound = RTOL[dtype] * want.norm().item() + ATOL[dtype] * math.sqrt(want.numel())
    assert err <= bound, f"||diff|| {err:.3e} > {bound:.3e}"


def test_reference_is_a_masked_softmax():
    q, k, v = cache(3, 2, 9, 4, torch.float64)
    lengths = torch.tensor([9, 1, 5], device=DEVICE)
    active = torch.tensor([True, True, False], device=DEVICE)
    out = ref.decode_attention(q, k, v, lengths, active, 0.5)
    for b in range(3):
        n = int(lengths[b])
        p = torch.softmax(torch.einsum("hd,hsd->hs", q[b], k[b, :, :n]) * 0.5, -1)
        want = torch.einsum("hs,hsd->hd", p, v[b, :, :n]) if active[b] else torch.zeros_like(q[b])
        torch.testing.assert_close(out[b], want, atol=1e-12, rtol=1e-12)


SHAPES = [(3, 2, 40, 16), (2, 3, 200, 32)] + ([(8, 16, 8192, 128), (1, 16, 32768, 128)] if CUDA else [])


@pytest.mark.parametrize("min_chunk", [16, 256], ids=["many_splits", "default_splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference(shape, dtype, min_chunk, monkeypatch):
    """min_chunk 16: the small shapes split into several chunks of keys (the combine rescales partial sums)."""
    monkeypatch.setattr(_decode, "MIN_CHUNK", min_chunk)
    B, H, S, D = shape
    q, k, v = cache(B, H, S, D, dtype, seed=S)
    lengths = torch.tensor([S, 1, S // 3 + 1, S - 7, 0, 5, 64, S // 2][:B], device=DEVICE)
    active = (torch.arange(B, device=DEVICE) % 4) != 3
    out = _decode.decode_attention(q, k, v, lengths, active, D ** -0.5)
    want = ref.decode_attention(q.double(), k.double(), v.double(), lengths, active, D ** -0.5)
    assert out.dtype == dtype and out.shape == (B, H, D)
    close(out, want, dtype)
    empty = ~active | (lengths == 0)
    assert (out[empty] == 0).all()


def test_kernel_reads_views_of_a_larger_cache():
    """The intra-layer hybrid attends a slice of heads; keys past a row's length (stale values) are never read."""
    q, k, v = cache(2, 4, 48, 16, torch.float32, seed=1)
    lengths = torch.tensor([30, 48], device=DEVICE)
    active = torch.tensor([True, True], device=DEVICE)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 30:], v2[0, :, 30:] = float("nan"), float("nan")
    out = _decode.decode_attention(q[:, 1:3], k2[:, 1:3], v2[:, 1:3], lengths, active, 0.25)
    want = ref.decode_attention(q[:, 1:3].double(), k[:, 1:3].double(), v[:, 1:3].double(), lengths, active, 0.25)
    close(out, want, torch.float32)


def test_splits_cover_the_cache():
    for B, H, S in ((1, 16, 8192), (8, 16, 32768), (64, 32, 100), (1, 1, 1)):
        chunk, n = _decode.splits(B, H, S, 64)
        assert chunk % 64 == 0 and (n - 1) * chunk < S <= n * chunk and n <= _decode.MAX_SPLITS
