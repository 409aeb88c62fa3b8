"""The LM head and its loss: summed cross-entropy of `h @ W^T` against the labels, with or without the logits.

Implementations (`train.loss`):
- plain: logits (N, V) materialised, then `F.cross_entropy` in fp32 (the reference; on CUDA the trainer runs it
  compiled, `fused_lm_loss_sum`: no fp32 copies of the logits).
- chunked: pure PyTorch; rows in chunks, each chunk's logits live only while its loss and its gradients
  (w.r.t. h and W, computed in the forward when a backward will follow) are taken, so at most one chunk of
  logits exists at a time and nothing is recomputed. The backward only scales the stored gradients.
- liger: liger-kernel's fused linear cross-entropy (Triton, CUDA; the same scheme with fused kernels).
- auto: on CUDA, liger when one micro-batch's fp32 logits would take at least AUTO_LIGER_MIN_LOGITS_GIB (and
  liger-kernel is importable), else plain; chunked on CPU. Below that size the compiled plain loss is the
  faster; above it the fp32 logits' memory is what counts.

Every implementation sums over the targets that are not IGNORE_INDEX (padding, document ends) and takes the
softmax over the padded vocabulary, as the plain loss does. Under autocast the matmul runs in the autocast
dtype and the softmax in fp32, as for `F.linear` + `.float()` + `F.cross_entropy`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100  # data.loader.IGNORE_INDEX (not imported: model code does not depend on the data package)
LOSS_IMPLS = ("auto", "liger", "chunked", "plain")
CHUNK_ELEMENTS = 1 << 25  # logits elements per chunk of the chunked loss (128 MiB in fp32)
AUTO_LIGER_MIN_LOGITS_GIB = 4.0  # train.loss=auto on CUDA: liger from this size of fp32 logits per micro-batch


def liger_available() -> bool:
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_loss_impl(impl: str, device: torch.device | str, logits_numel: int | None = None) -> str:
    """'plain' | 'chunked' | 'liger' for `impl` on `device`; ValueError naming the problem otherwise.
    logits_numel: tokens x vocabulary of one micro-batch (auto on CUDA; None counts as large)."""
    dev = torch.device(device).type
    if impl not in LOSS_IMPLS:
        raise ValueError(f"invalid config train.loss={impl!r}: choose one of {list(LOSS_IMPLS)}")
    if impl == "auto":
        if dev != "cuda":
            return "chunked"
        large = logits_numel is None or 4 * logits_numel >= AUTO_LIGER_MIN_LOGITS_GIB * 2**30
        return "liger" if large and liger_available() else "plain"
    if impl == "liger" and dev != "cuda":
        raise ValueError(f"invalid config train.loss='liger': liger-kernel needs a CUDA device (this run is on "
                         f"{dev}); use train.loss=chunked or auto")
    if impl == "liger" and not liger_available():
        raise ValueError("invalid config train.loss='liger': liger-kernel is not installed "
                         "(pip install -e '.[gpu]'), or use train.loss=chunked or auto")
    return impl


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """() fp32: cross-entropy summed over the targets that are not IGNORE_INDEX. logits (..., V), labels (...)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


_COMPILED_LOSS = None


def fused_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`lm_loss_sum` under torch.compile, for the plain loss on CUDA: the fp32 upcast, log-softmax and gather
    become a few fused passes over the 16-bit logits, and the backward writes the logits' gradient in one
    pass from them and the saved log-sum-exp. Eager, the same loss makes an fp32 copy of the logits, an fp32
    log-softmax that it keeps for the backward, and an fp32 gradient (1.5B at 8k tokens: 3.3 GB each)."""
    global _COMPILED_LOSS
    if _COMPILED_LOSS is None:
        _COMPILED_LOSS = torch.compile(lm_loss_sum, fullgraph=True)
    return _COMPILED_LOSS(logits, labels)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed CE of h @ w^T; gradients taken chunk by chunk in the forward, scaled in the backward.

    One fp32 logits buffer serves every chunk, and the softmax is taken in place in it: on CPU, a fresh
    (rows, V) tensor per chunk and op (the logits, logsumexp's temporary, the exp) cost more in page faults
    than the arithmetic (the default CPU run's step: 3.6 s, 79% of it in this loss, before this change)."""

    @staticmethod
    def forward(ctx, h, w, labels, chunk_rows: int, grad_h: bool, grad_w: bool):
        # h (N, d), w (V, d), labels (N,) int64
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        gh = torch.empty_like(h) if grad_h else None  # (N, d)
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if grad_w else None  # (V, d) fp32 sum
        fp32 = h.dtype == torch.float32 and w.dtype == torch.float32
        buf = torch.empty(min(chunk_rows, h.shape[0]), w.shape[0], dtype=torch.float32, device=h.device)  # (n, V)
        for s in range(0, h.shape[0], chunk_rows):
            hc, y = h[s:s + chunk_rows], labels[s:s + chunk_rows]  # (n, d), (n,)
            valid = y != IGNORE_INDEX
            y0 = y.clamp_min(0).unsqueeze(1)  # (n, 1)
            logits = buf[:hc.shape[0]]  # (n, V): the only logits alive
            if fp32:
                torch.mm(hc, w.t(), out=logits)
            else:
                logits.copy_(hc @ w.t())
            top = logits.amax(dim=1, keepdim=True)  # (n, 1)
            target = logits.gather(1, y0)  # (n, 1)
            p = logits.sub_(top).exp_()  # exp(logit - max), in place
            total = p.sum(dim=1, keepdim=True)  # (n, 1)
            lse = top + total.log()  # (n, 1): logsumexp of the row
            loss += torch.where(valid, (lse - target).squeeze(1), 0.0).sum()
            if not (grad_h or grad_w):
                continue
            # d(loss)/d(logits) = softmax - onehot(y), zero on ignored rows; in place over the logits
            g = p.div_(total)
            g.scatter_add_(1, y0, -valid.to(g.dtype).unsqueeze(1))
            g = g.mul_(valid.unsqueeze(1)).to(h.dtype)  # (n, V) in the matmul dtype, as autograd would cast
            if grad_h:
                torch.mm(g, w, out=gh[s:s + chunk_rows])
            if grad_w and fp32:
                gw.addmm_(g.t(), hc)  # accumulated in place
            elif grad_w:
                gw.add_(g.t() @ hc)  # the product in the matmul dtype, accumulated in fp32
        ctx.save_for_backward(gh, gw)
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        return *_scaled_gradients(ctx, grad_out), None, None, None, None


def _scaled_gradients(ctx, grad_out: torch.Tensor):
    """(dh, dw): the gradients a loss function stored in its forward (ctx.saved_tensors: gh, gw, either None),
    scaled by the loss's upstream gradient on the device (no host read of grad_out), dw cast to ctx.w_dtype."""
    gh, gw = ctx.saved_tensors
    dh = gh * grad_out.to(gh.dtype) if gh is not None else None
    dw = (gw * grad_out).to(ctx.w_dtype) if gw is not None else None
    return dh, dw


def autocast_operands(h: torch.Tensor, w: torch.Tensor):
    """(h, w) cast to the autocast dtype when autocast is on for their device (differentiable casts), as the
    model's head runs them."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return h.to(dt), w.to(dt)
    return h, w


def chunked_loss_sum(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 0) -> torch.Tensor:
    """() fp32 summed CE of h (N, d) @ w (V, d)^T against labels (N,), one chunk of rows at a time.
    chunk_rows: 0 = CHUNK_ELEMENTS // V."""
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // w.shape[0])
    need = torch.is_grad_enabled()
    hc, wc = autocast_operands(h, w)
    with torch.autocast(h.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hc, wc, labels, rows, need and hc.requires_grad,
                                                need and wc.requires_grad)


class _LigerLinearCrossEntropy(torch.autograd.Function):
    """Summed CE of h @ w^T through liger-kernel's fused forward (logits chunk by chunk, gradients taken in the
    forward, the weight's accumulated in fp32); the backward scales the stored gradients on the device.
    liger's own backward compares grad_out with 1.0 on the host, which waits for the GPU: this one does not."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, h, w, labels):
        # h (N, d), w (V, d), labels (N,) int64
        from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward
        loss, _, _, _, gh, gw, _ = fused_linear_cross_entropy_forward(
            _input=h, weight=w, target=labels, ignore_index=IGNORE_INDEX, reduction="sum",
            accum_dtype=torch.float32)
        ctx.save_for_backward(gh if h.requires_grad else None, gw if w.requires_grad else None)
        ctx.w_dtype = w.dtype
        return loss.float()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        return *_scaled_gradients(ctx, grad_out), None


def liger_loss_sum(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """() fp32 summed CE through liger-kernel's fused linear cross-entropy (CUDA). Autocast applies to its
    matmuls; the weight gradient is accumulated in fp32. Note: liger's forward reads the number of valid targets
    on the host (one wait for the GPU per call)."""
    return _LigerLinearCrossEntropy.apply(h, w, labels)


def linear_cross_entropy_sum(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                             impl: str = "auto") -> torch.Tensor:
    """() fp32 CE of the logits h @ w^T summed over the valid targets. h (..., d), w (V, d), labels (...)."""
    impl = resolve_loss_impl(impl, h.device, labels.numel() * w.shape[0])
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)  # (N, d), (N,)
    if impl == "plain":
        return lm_loss_sum(F.linear(h2, w), y)
    if impl == "liger":
        return liger_loss_sum(h2, w, y)
    return chunked_loss_sum(h2, w, y)


class LMHead(nn.Linear):
    """The output projection (an nn.Linear: same parameter name and init). Called with `labels`, it returns
    the summed loss instead of the logits, so FSDP's hooks on this module gather its weight as for logits."""

    def __init__(self, dim: int, vocab: int):
        super().__init__(dim, vocab, bias=False)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, loss_impl: str = "auto") -> torch.Tensor:
        if labels is None:
            return super().forward(h)  # (B, T, V) logits
        return linear_cross_entropy_sum(h, self.weight, labels, loss_impl)  # () fp32
