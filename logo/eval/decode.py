"""KV-cache decoding for every attention kind, with LoGo's global skip (paper Sec. 3.3, App. B).

Prefill runs the prompt through the model's own blocks (the training kernels: sliding-window and query-sparse
attention, or SDPA for full attention) and fills the caches from the same layer inputs. Then one token per
step and row:

- full attention: a dense cache of every earlier token;
- local (sliding window): a ring buffer of the last `window` keys/values;
- intra-layer hybrid: dense cache for the global heads, ring buffer for the local heads;
- LoGo: the local branch reads its ring buffer; global keys/values are computed for every token (keys stay
  dense) into a dense cache; the gate is computed first and the global branch runs only for rows it selects.
  Batched policy: one global call per layer over the rows from the first to the last selected one (a cache
  view, no copy), whose selected rows are kept; a step where no row is selected skips the global call
  entirely. This is at least as good as the paper's policy (skip only when no row is selected, else compute
  every row and mask).

Batches: prompts of different lengths are right-padded (padding is never routed global and never read);
each row then decodes at its own position. Autocast (bf16) is the caller's: caches take the dtype of the
projections. Inter-layer hybrids are per-layer mixtures of the above.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from logo.eval.kv_cache import DenseCache, RingCache
from logo.model.layers import PackedSeqs, apply_rope, apply_rope_rows, rope_cos_sin, upcast


@dataclass
class LayerState:
    kind: str  # full | local | intra_layer | logo
    dense: Optional[DenseCache] = None
    ring: Optional[RingCache] = None


@dataclass
class DecodeStats:
    """LoGo routing during decoding (prompt excluded): per LoGo layer and step."""

    rows: int = 0  # valid (row, layer, step) triples
    selected: int = 0  # of which routed global
    layer_steps: int = 0  # (layer, step) pairs
    skipped: int = 0  # of which no row was selected: no global call at all
    global_calls: int = 0  # attention launches of the global branch

    def as_dict(self) -> dict:
        return {"rows": self.rows, "selected": self.selected, "global_fraction": self.selected / max(self.rows, 1),
                "layer_steps": self.layer_steps, "skipped": self.skipped, "global_calls": self.global_calls}


# --- LoGo global-branch projections from the layer's public building blocks ---------------------------
def _global_q(attn, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE global queries: x (n, d), local q (n, H, D) -> (n, H, D)."""
    if attn.attn_cfg.transform == "full":
        return attn.wq_g(x).view(q.shape)
    return attn.transform(0, q)


def _global_kv(attn, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Pre-RoPE global keys and values of every token: x (..., d), local k, v (..., H, D)."""
    if attn.attn_cfg.transform == "full":
        return attn.wk_g(x).view(k.shape), attn.wv_g(x).view(v.shape)
    return attn.transform(1, k), attn.transform(2, v)


# --- prefill: caches from the layer input x (B, T, d) ------------------------------------------------------
def _n_global_heads(attn, kind: str) -> int:
    return {"full": attn.n_heads, "local": 0, "logo": 0}.get(kind, getattr(attn, "n_global", 0))


def prefill_layer(attn, kind: str, x, cos, sin, lengths: Sequence[int], capacity: int) -> LayerState:
    """A layer's caches after the prompt: x (B, T, d) its attention input, cos/sin (T, D/2)."""
    B = x.shape[0]
    q, k, v = attn.project(x)  # (B, T, H, D) pre-RoPE
    H, D, W = k.shape[2], k.shape[3], attn.attn_cfg.window
    kr = apply_rope(k, cos, sin)
    st = LayerState(kind)
    g = _n_global_heads(attn, kind)
    if g > 0:  # full attention, or the global heads of the intra-layer hybrid
        st.dense = DenseCache(B, g, capacity, D, kr.dtype, x.device)
        st.dense.prefill(kr[:, :, :g], v[:, :, :g])
    if g < H:  # local heads (all heads of local and LoGo layers)
        st.ring = RingCache(B, H - g, W, capacity, D, kr.dtype, x.device)
        st.ring.prefill(kr[:, :, g:], v[:, :, g:], lengths)
    if kind == "logo":  # global branch: keys/values of every token
        kg, vg = _global_kv(attn, x, k, v)
        st.dense = DenseCache(B, H, capacity, D, kg.dtype, x.device)
        st.dense.prefill(apply_rope(kg, cos, sin), vg)
    return st


# --- one decoding step: x (B, 1, d) -> attention output (B, 1, d) ------------------------------------------
@dataclass
class StepInfo:
    """Where each row's new token sits: pos (B,) int64 and the same as Python ints, its RoPE angles
    cos/sin (B, D/2), valid (B,) bool rows still generating (n_valid of them)."""

    pos: torch.Tensor
    host_pos: list
    cos: torch.Tensor
    sin: torch.Tensor
    valid: torch.Tensor
    n_valid: int


def step_layer(attn, st: LayerState, x, s: StepInfo, stats: DecodeStats) -> torch.Tensor:
    q, k, v = (t[:, 0] for t in attn.project(x))  # (B, H, D) pre-RoPE
    qr, kr = apply_rope_rows(q, s.cos, s.sin), apply_rope_rows(k, s.cos, s.sin)
    if st.kind == "logo":
        o = _logo_mix(attn, st, x[:, 0], q, k, v, qr, kr, s, stats)
    else:
        parts = []
        g = st.dense.k.shape[1] if st.dense is not None else 0
        if st.dense is not None:
            st.dense.append(kr[:, :g], v[:, :g], s.pos)
            parts.append(st.dense.attend(qr[:, :g], s.pos, s.host_pos))
        if st.ring is not None:
            st.ring.append(kr[:, g:], v[:, g:], s.pos)
            parts.append(st.ring.attend(qr[:, g:], s.host_pos))
        o = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # (B, H, D)
    return attn.wo(o.flatten(1))[:, None]


def _logo_mix(attn, st: LayerState, x, q, k, v, qr, kr, s: StepInfo, stats: DecodeStats):
    """LoGo before W_o for one token per row: x (B, d); q, k, v pre-RoPE and qr, kr rotated (B, H, D)."""
    p = attn.gate_probs(x[:, None])  # (B,) fp32
    z = (p > attn.threshold) & s.valid  # (B,) the routing decision, before any global work
    st.ring.append(kr, v, s.pos)
    o = attn.norm_local(st.ring.attend(qr, s.host_pos))  # (B, H, D)
    kg, vg = _global_kv(attn, x, k, v)  # every token: later selected queries see it
    st.dense.append(apply_rope_rows(kg, s.cos, s.sin), vg, s.pos)

    sel = torch.nonzero(z).flatten()
    rows = sel.tolist()  # host sync: the skip decision
    stats.layer_steps += 1
    stats.rows += s.n_valid
    stats.selected += len(rows)
    if not rows:
        stats.skipped += 1
        return o  # every row local: exactly Norm^L(O^L), no global call
    # One attention call over the span of rows first..last selected (a cache view, no copy): the rows in
    # between that are not selected cost their share of that call, never a call of their own.
    a, b = rows[0], rows[-1] + 1
    qg = apply_rope_rows(_global_q(attn, x[a:b], q[a:b]), s.cos[a:b], s.sin[a:b])  # (b - a, H, D)
    og = st.dense.attend(qg, s.pos[a:b], s.host_pos[a:b], rows=slice(a, b))
    stats.global_calls += 1
    og = attn.norm_global(og[sel - a] if len(rows) < b - a else og)  # (n, H, D)
    p_sel = p[sel][:, None, None]
    o_sel = upcast(o[sel])
    fused = ((1.0 - p_sel) * o_sel if attn.attn_cfg.fusion == "weighted" else o_sel) + p_sel * upcast(og)
    return o.index_copy(0, sel, fused.to(o.dtype))


class Decoder:
    """Caches for one batch of prompts: `prefill(prompts)` then `step(tokens)` -> next-token logits."""

    def __init__(self, model, capacity: int):
        self.model, self.capacity = model, capacity
        self.device = next(model.parameters()).device
        cfg = model.cfg
        self.cos, self.sin = rope_cos_sin(capacity, cfg.head_dim, cfg.rope_theta, self.device)  # (S, D/2)
        self.blocks = list(model.layers.values())
        self.states: list[LayerState] = []
        self.stats = DecodeStats()
        self.host_pos: list[int] = []
        self.pos: Optional[torch.Tensor] = None

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for st in self.states for c in (st.dense, st.ring) if c is not None)

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Right-padded prompts through the model's blocks; returns the logits after each prompt (B, V)."""
        lengths = [len(p) for p in prompts]
        if not prompts or min(lengths) < 1:
            raise ValueError("prefill needs at least one prompt and every prompt needs at least one token")
        B, T = len(prompts), max(lengths)
        if T >= self.capacity:
            raise ValueError(f"a prompt of {T} tokens leaves no room in a cache of {self.capacity} positions")
        tokens = torch.zeros(B, T, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        lens = torch.tensor(lengths, device=self.device)
        valid = torch.arange(T, device=self.device)[None, :] < lens[:, None]  # (B, T)
        seqs = PackedSeqs.build(B, T, self.device, None, valid)
        cos, sin = self.cos[:T], self.sin[:T]
        h = self.model.tok_embeddings(tokens)  # (B, T, d)
        self.states = []
        for block in self.blocks:  # the model's own blocks: the training kernels
            x = block.attention_norm(h)
            self.states.append(prefill_layer(block.attention, block.attention_kind, x, cos, sin, lengths,
                                             self.capacity))
            h = block(h, cos, sin, seqs)[0]
        last = h[torch.arange(B, device=self.device), lens - 1]  # (B, d)
        self.host_pos, self.pos = list(lengths), lens.clone()
        return self.model.output(self.model.norm(last))

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append one token per row (B,) at each row's next position; returns the next logits (B, V).
        active (B,) bools (a list or a tensor): rows still generating; the others are never routed global."""
        if max(self.host_pos) >= self.capacity:
            raise ValueError(f"the cache is full ({self.capacity} positions); build the Decoder with more capacity")
        B = tokens.shape[0]
        act = [True] * B if active is None else [bool(a) for a in active]
        valid = torch.tensor(act, dtype=torch.bool, device=self.device)
        s = StepInfo(self.pos, self.host_pos, self.cos[self.pos], self.sin[self.pos], valid, sum(act))
        h = self.model.tok_embeddings(tokens.to(self.device)[:, None])  # (B, 1, d)
        for block, st in zip(self.blocks, self.states):
            h = h + step_layer(block.attention, st, block.attention_norm(h), s, self.stats)
            h = h + block.feed_forward(block.ffn_norm(h))
        self.pos += 1
        self.host_pos = [p + 1 for p in self.host_pos]
        return self.model.output(self.model.norm(h[:, 0]))


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row (stop token excluded)
    logits: Optional[list[torch.Tensor]] = None  # per row (n_steps, V): the logits each choice was made from
    stats: dict = field(default_factory=dict)  # DecodeStats.as_dict()
    cache_bytes: int = 0


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Optional[set] = None,
             return_logits: bool = False, stop_fn: Optional[Callable[[int, list], bool]] = None) -> Generation:
    """Greedy decoding with caches for a batch of prompts (right-padded); a row stops at a stop id (not kept),
    when stop_fn(row, its new tokens) is true (e.g. a stop string appeared), or after max_new_tokens. Argmax
    is taken over the real vocabulary (padded ids are never emitted)."""
    vocab = model.cfg.vocab_size
    dec = Decoder(model, max(len(p) for p in prompts) + max(1, max_new_tokens))
    logits = dec.prefill(prompts)
    B = len(prompts)
    out: list[list[int]] = [[] for _ in range(B)]
    rec: list[list[torch.Tensor]] = [[] for _ in range(B)]
    done = [max_new_tokens <= 0] * B
    while not all(done):
        nxt = logits[:, :vocab].argmax(-1).tolist()
        for b in range(B):
            if done[b]:
                continue
            if return_logits:
                rec[b].append(logits[b].cpu())
            if stop_ids and nxt[b] in stop_ids:
                done[b] = True
                continue
            out[b].append(nxt[b])
            done[b] = len(out[b]) >= max_new_tokens or bool(stop_fn and stop_fn(b, out[b]))
        if all(done):
            break
        logits = dec.step(torch.tensor(nxt, device=dec.device), [not d for d in done])
    return Generation(out, [torch.stack(r) if r else torch.zeros(0) for r in rec] if return_logits else None,
                      dec.stats.as_dict(), dec.cache_bytes)
