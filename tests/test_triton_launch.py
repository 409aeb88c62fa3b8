"""`logo.kernels.triton._launch`: the cached launch path runs the same kernels on the same arguments as
`kernel[grid]`, and its key never lets two calls that Triton would specialize differently share a compiled kernel.

On a machine without a GPU every launch takes `kernel[grid]` (the CPU interpreter has no compiled kernels; the
kernel tests cover that path); the key is tested here, the cached path on the GPU machine.
"""
from __future__ import annotations

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from logo.kernels import branches, ops
from logo.kernels.triton import _launch
from logo.model.layers import PackedSeqs, rope_cos_sin
from logo.model.routing import partition

CUDA = torch.cuda.is_available()


def test_tensor_key_is_dtype_and_alignment():
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert _launch._arg_key(x) == (torch.bfloat16, x.data_ptr() & 15)
    assert _launch._arg_key(x[1:]) != _launch._arg_key(x)  # 2 bytes further: not 16-byte aligned
    assert _launch._arg_key(x[8:]) == _launch._arg_key(x)  # 16 bytes further: the same specialization
    assert _launch._arg_key(x.float()) != _launch._arg_key(x.float()[1:])
    assert _launch._arg_key(torch.zeros(64, dtype=torch.float16))[0] == torch.float16


def test_scalar_keys_are_values_floats_only_their_type():
    assert [_launch._arg_key(a) for a in (1, 16, 17, True, None)] == [1, 16, 17, True, None]
    assert _launch._arg_key(0.125) is float and _launch._arg_key(3.0) is float


def test_descriptor_key_names_layout_and_block():
    x = torch.zeros(32, 4 * 16, dtype=torch.bfloat16)
    d = TensorDescriptor(x, shape=[32, 64], strides=[64, 1], block_shape=[16, 16])
    other_block = TensorDescriptor(x, shape=[32, 64], strides=[64, 1], block_shape=[32, 16])
    other_shape = TensorDescriptor(x[:16], shape=[16, 64], strides=[64, 1], block_shape=[16, 16])
    keys = [_launch._arg_key(t) for t in (d, other_block, other_shape)]
    assert len(set(keys)) == 3


def test_launch_hooks_are_seen():
    """A profiler's launch hook (proton adds one to Triton's hook chain) sends launches through kernel[grid]."""
    from triton.knobs import HookChain
    chain = HookChain()
    assert not _launch._hooked(None) and not _launch._hooked(chain)
    chain.add(print)
    assert _launch._hooked(chain) and _launch._hooked(print)


def test_only_known_triton_releases_take_the_cached_path():
    """Another release may call its compiled kernels differently: it gets the plain launch."""
    known = {v: _launch._known_release(v) for v in ("3.2.0", "3.6.0", "3.9.1", "3.10.0", "4.0.0", "3.7.0+git1a2b")}
    assert known == {"3.2.0": False, "3.6.0": True, "3.9.1": True, "3.10.0": False, "4.0.0": False,
                     "3.7.0+git1a2b": True}
    assert not _launch._known_release("main")


def test_unknown_argument_kind_is_refused():
    with pytest.raises(TypeError, match="list"):
        _launch._arg_key([1, 2])


@pytest.mark.skipif(CUDA, reason="the Triton kernels take CPU tensors only under the interpreter")
def test_cpu_tensors_take_the_plain_launch():
    """Tensors not on a GPU never reach the cache (the interpreter has no compiled kernel to run)."""
    before = dict(_launch._cache)
    N, H, D = 32, 2, 16
    q, k, v = (torch.randn(N, H, D) for _ in range(3))
    cu = torch.tensor([0, N], dtype=torch.int32)
    ops.sliding_window_attention(q, k, v, cu, 8, impl="triton")
    assert _launch._cache == before


def _layer_problem(B=2, T=512, H=4, D=128, seed=0):
    """bf16 q, k, v (N, H, D), transforms near identity, angles, several documents, half the rows selected."""
    g = torch.Generator().manual_seed(seed)
    N = B * T
    q, k, v = (torch.randn(N, H, D, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    A = (torch.eye(D) + 0.05 * torch.randn(3, H, D, D, generator=g)).cuda()
    cos, sin = (t.cuda() for t in rope_cos_sin(T, D, 10000.0, "cpu"))
    seqs = PackedSeqs.build(B, T, "cuda", torch.tensor([0, 100, 512, 700, N], dtype=torch.int32))
    p = torch.rand(N, generator=g).cuda()
    return q, k, v, A, cos, sin, seqs, p


def _layer_outputs_and_grads(problem, keep_rotated):
    """The branch pair and the ContextNorm fusion, forward and backward: outputs and every input's gradient."""
    q, k, v, A, cos, sin, seqs, p = problem
    z = p > 0.5
    sel = partition(z, seqs)
    H, D = q.shape[1:]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, A, p, torch.ones(H, D, device="cuda"),
                                                   torch.ones(H, D, device="cuda"))]
    q_, k_, v_, A_, p_, w_l, w_g = leaves
    o_l, o_g = branches.logo_branches(q_, k_, v_, A_, cos, sin, seqs.pos, sel.rows, sel.cu_seqlens_q,
                                      seqs.cu_seqlens, 128, keep_rotated, impl="triton")
    o = ops.context_fuse(o_l, o_g, p_, z, w_l, w_g, 1e-6, True, impl="triton")
    g = torch.Generator().manual_seed(1)
    (o.float() * torch.randn(o.shape, generator=g).cuda()).sum().backward()
    return [o_l.detach(), o_g.detach(), o.detach()] + [t.grad for t in leaves]


@pytest.mark.skipif(not CUDA, reason="compiled kernels run on a GPU")
@pytest.mark.parametrize("keep_rotated", [False, True])
def test_cached_launches_equal_plain_launches(monkeypatch, keep_rotated):
    """Every kernel of a LoGo layer's branch pair (RoPE + transforms, both attention forwards and backwards, the
    backward's split and dA passes) and of its ContextNorm fusion: the same bits through the cache, on its first
    call and on a hit, as through kernel[grid]."""
    problem = _layer_problem()
    runtime = _launch._RUNTIME
    monkeypatch.setattr(_launch, "_RUNTIME", None)  # every launch through kernel[grid]
    plain = _layer_outputs_and_grads(problem, keep_rotated)
    monkeypatch.setattr(_launch, "_RUNTIME", runtime)
    _launch.clear()
    first = _layer_outputs_and_grads(problem, keep_rotated)
    entries = len(_launch._cache)
    again = _layer_outputs_and_grads(problem, keep_rotated)
    assert entries >= 9 and len(_launch._cache) == entries  # the second run found every kernel it launched
    for a, b, c in zip(plain, first, again):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(not CUDA, reason="compiled kernels run on a GPU")
def test_misaligned_inputs_get_their_own_compiled_kernel(monkeypatch):
    """An input 2 bytes off a 16-byte boundary must not reuse the kernel compiled for aligned pointers."""
    N, H, D = 512, 2, 64
    base = torch.randn(N * H * D + 8, device="cuda", dtype=torch.bfloat16)
    aligned = base[:N * H * D].view(N, H, D)
    shifted = base[1:1 + N * H * D].view(N, H, D)
    cu = torch.tensor([0, N], device="cuda", dtype=torch.int32)
    outs, runtime = {}, _launch._RUNTIME
    for fast in (False, True):
        monkeypatch.setattr(_launch, "_RUNTIME", runtime if fast else None)
        _launch.clear()
        outs[fast] = [ops.causal_attention(x, x, x, cu, impl="triton") for x in (aligned, shifted, aligned)]
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    keys = [k for k in _launch._cache]
    assert len(keys) == 2 and keys[0][3] != keys[1][3]
