"""Decoding with static KV caches for every attention kind, with LoGo's global skip inside the step (paper Sec. 3.3,
App. B): a decode step is a fixed sequence of device operations, replayed as one CUDA graph on a GPU.

Decoding runs the model's own blocks: every attention module's forward takes the layer's caches
(`logo.model.kv_cache`; the layer code is `logo.model.attention` and `logo.model.logo_attention`). Prefill runs
the right-padded prompts through the blocks with the training kernels, a group of rows at a time (`PREFILL_TOKENS`
per group, so a long prompt's activations stay bounded), and the forward writes the caches (dense caches of every
position, ring buffers of the last `window`), allocated once at their final size. Then one token per row and
step, from static buffers (the tokens, each row's position and whether it is still generating, all on the
device), each block's forward given a `DecodeStep`:

- full attention: the dense cache, the decode kernel over each row's positions 0..pos;
- local (sliding window): the ring buffer;
- intra-layer hybrid: the dense cache for the global heads, the ring for the local ones;
- LoGo: the gate decides per row on the device (z = p > b, rows still generating); the local branch reads its
  ring; global keys/values of every token go into the dense cache (later selected queries see them); the global
  branch is the decode kernel over the dense cache with z as its active rows: the programs of unselected rows
  return at once, so its work follows the selected rows with no host branch (the "serving kernel that compacts
  active rows"); the layer's own fusion. Inter-layer hybrids mix the above per layer.

No step reads a device value on the host: positions advance on the device, routing counts accumulate there
(`DecodeStats`, read once at the end). On CUDA each block's step goes through torch.compile (its elementwise work
fused; one graph per attention kind, shared by its layers), the second step records the whole step as a CUDA
graph (the first runs eagerly and compiles the kernels) and every later step replays it; the step runs under the
caller's autocast dtype without autocast's weight cache (a graph may not keep pointers into it). `generate` adds
greedy or temperature / top-p sampling, stop ids and a host-side stop predicate checked every `CHECK_EVERY` steps
(a row that stopped in between is cut where it stopped: the same tokens as checking every step).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from logo.model.kv_cache import DecodeStep, LayerCache
from logo.model.layers import PackedSeqs, rope_cos_sin

PREFILL_TOKENS = 1 << 17  # rows x padded prompt length run through the blocks at once
CHECK_EVERY = 8  # decode steps between the host's looks at which rows are done (one sync each)


@dataclass
class DecodeStats:
    """LoGo routing during decoding (prompt excluded), over LoGo layers and steps."""

    rows: int = 0  # (row, layer, step) triples of rows still generating
    selected: int = 0  # of which routed global
    layer_steps: int = 0  # (layer, step) pairs
    skipped: int = 0  # of which no row was selected: the global kernel did no work

    def as_dict(self) -> dict:
        return {"rows": self.rows, "selected": self.selected, "global_fraction": self.selected / max(self.rows, 1),
                "layer_steps": self.layer_steps, "skipped": self.skipped,
                "skipped_fraction": self.skipped / max(self.layer_steps, 1)}


def block_forward(block, h, cos, sin, seqs, cache) -> torch.Tensor:
    """The block's own forward, its hidden state only: h (B, T, d) -> (B, T, d)."""
    return block(h, cos, sin, seqs, cache=cache)[0]


_compiled_block_forward = None


def compiled_block_forward():
    """`block_forward` through torch.compile for the decoding steps (one graph per attention kind, shared by the
    layers of that kind: the parameters are its inputs), so a step's elementwise work is fused into few kernels."""
    global _compiled_block_forward
    if _compiled_block_forward is None:
        _compiled_block_forward = torch.compile(block_forward, fullgraph=True)
    return _compiled_block_forward


class Decoder:
    """Static caches for a batch of prompts: `prefill(prompts)` then `step(tokens, active)` -> next logits.

    The caches, the step's buffers and (on CUDA) its graph are made at the first prefill for that batch size and
    kept: a later prefill with as many prompts reuses them."""

    def __init__(self, model, capacity: int):
        self.model, self.capacity = model, capacity
        self.device = next(model.parameters()).device
        cfg = model.cfg
        self.vocab = cfg.vocab_size
        self.blocks = list(model.layers.values())
        self.n_logo = sum(b.attention_kind == "logo" for b in self.blocks)
        self.autocast = (torch.get_autocast_dtype(self.device.type)
                         if torch.is_autocast_enabled(self.device.type) else None)
        self.batch = 0
        self.caches: list[LayerCache] = []
        self.graph = None
        self.steps_run = 0  # steps since the prefill (host count: the capacity check needs no device value)
        self.prompt_max = 0
        self.stats = DecodeStats()
        self.block_forward = compiled_block_forward() if self.device.type == "cuda" else block_forward

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def _allocate(self, batch: int) -> None:
        dtype = self.autocast or self.model.tok_embeddings.weight.dtype
        need = batch * sum(b.attention.cache_row_bytes(self.capacity, dtype) for b in self.blocks)
        free = _free_bytes(self.device)
        if free is not None and need > 0.9 * (free + self.cache_bytes):
            where = "GPU memory" if self.device.type == "cuda" else "memory"
            raise ValueError(f"a batch of {batch} rows with room for {self.capacity} tokens needs "
                             f"{need / 2**30:.1f} GiB of KV caches but {(free + self.cache_bytes) / 2**30:.1f} GiB "
                             f"of {where} is free: lower the batch size or the context")
        self.caches = []  # the previous batch's caches go first
        self.graph = None
        cfg = self.model.cfg
        self.cos, self.sin = rope_cos_sin(self.capacity, cfg.head_dim, cfg.rope_theta, self.device)  # (S, D/2)
        self.caches = [b.attention.new_cache(batch, self.capacity, dtype, self.device) for b in self.blocks]
        self.batch = batch
        self.tokens = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.active = torch.zeros(batch, dtype=torch.bool, device=self.device)
        weight = self.model.output.weight  # logits in at least fp32, as the training forward's
        self.logits = torch.zeros(batch, weight.shape[0], device=self.device,
                                  dtype=torch.promote_types(weight.dtype, torch.float32))
        counts = torch.zeros(3, dtype=torch.float64, device=self.device)  # rows, selected, skipped
        self.decode_step = DecodeStep(self.pos, self.active, counts)

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast, cache_enabled=False)

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Right-padded prompts through the model's blocks; returns the logits after each prompt (B, V)."""
        lengths = [len(p) for p in prompts]
        if not prompts or min(lengths) < 1:
            raise ValueError("prefill needs at least one prompt and every prompt needs at least one token")
        if max(lengths) >= self.capacity:
            raise ValueError(f"a prompt of {max(lengths)} tokens leaves no room in a cache of {self.capacity} "
                             f"positions")
        if len(prompts) != self.batch:
            self._allocate(len(prompts))
        group = max(1, PREFILL_TOKENS // max(lengths))
        last = torch.cat([self._prefill_rows(slice(i, min(i + group, len(prompts))), prompts)
                          for i in range(0, len(prompts), group)])
        self.pos.copy_(torch.tensor(lengths, device=self.device))
        self.active.fill_(True)
        self.steps_run, self.prompt_max = 0, max(lengths)
        with self._autocast():
            return self.model.output(self.model.norm(last))

    def _prefill_rows(self, rows: slice, prompts) -> torch.Tensor:
        """Prompts of `rows` through the blocks, filling their caches; the hidden state after each prompt."""
        lengths = [len(p) for p in prompts[rows]]
        B, T = len(lengths), max(lengths)
        tokens = torch.zeros(B, T, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts[rows]):
            tokens[b, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        lens = torch.tensor(lengths, device=self.device)
        valid = torch.arange(T, device=self.device)[None, :] < lens[:, None]  # (B, T)
        seqs = PackedSeqs.build(B, T, self.device, None, valid)
        cos, sin = self.cos[:T], self.sin[:T]
        h = self.model.tok_embeddings(tokens)  # (B, T, d)
        for block, c in zip(self.blocks, self.caches):  # the training kernels; the forward writes the caches
            h = block_forward(block, h, cos, sin, seqs, c.at(rows, lengths))
        return h[torch.arange(B, device=self.device), lens - 1]  # (B, d)

    def _step(self) -> None:
        """One token per row from the static buffers: caches appended, logits written, positions advanced."""
        cos, sin = self.cos[self.pos], self.sin[self.pos]  # (B, D/2): each row's new position
        with self._autocast():
            h = self.model.tok_embeddings(self.tokens[:, None])  # (B, 1, d)
            for block, c in zip(self.blocks, self.caches):
                h = self.block_forward(block, h, cos, sin, self.decode_step, c)
            self.logits.copy_(self.model.output(self.model.norm(h[:, 0])))
        self.pos += self.active

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, active=None) -> torch.Tensor:
        """Append one token per row (B,) at each row's next position; returns the next logits (B, V), a buffer
        the next step overwrites. active (B,) bools (a tensor or a list): rows still generating; the others keep
        their position and are never routed global."""
        if self.prompt_max + self.steps_run >= self.capacity:
            raise ValueError(f"the cache is full ({self.capacity} positions); build the Decoder with more capacity")
        self.tokens.copy_(tokens.reshape(-1), non_blocking=True)
        if active is not None:
            self.active.copy_(torch.as_tensor(active, dtype=torch.bool).to(self.device, non_blocking=True))
        if self.device.type != "cuda":
            self._step()
        elif self.graph is not None:
            self.graph.replay()
        else:
            self._warm_or_capture()
        self.steps_run += 1
        self.stats.layer_steps += self.n_logo
        return self.logits

    def _warm_or_capture(self) -> None:
        """The first step after an allocation runs eagerly on a side stream (it compiles the kernels and sets up
        the libraries' workspaces, which a capture may not do); the second is recorded on that stream, then
        replayed."""
        side = self._side = getattr(self, "_side", None) or torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        if self.steps_run == 0:
            with torch.cuda.stream(side):
                self._step()
        else:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=side):
                self._step()
            self.graph.replay()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def read_stats(self) -> DecodeStats:
        """The routing counts so far (one host read)."""
        rows, selected, skipped = (int(x) for x in self.decode_step.counts.tolist())
        self.stats.rows, self.stats.selected, self.stats.skipped = rows, selected, skipped
        return self.stats


def _free_bytes(device: torch.device) -> Optional[int]:
    """Memory free for the caches on `device` (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


# --- generation ------------------------------------------------------------------------------------------------
@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row (stop token excluded)
    logits: Optional[list[torch.Tensor]] = None  # per row (n_steps, V): the logits each choice was made from
    stats: dict = field(default_factory=dict)  # DecodeStats.as_dict()
    cache_bytes: int = 0


def choose(logits: torch.Tensor, temperature: float, top_p: float,
           generator: Optional[torch.Generator]) -> torch.Tensor:
    """Next tokens (B,) from logits (B, V) on the device: argmax at temperature 0, else a sample of the softmax at
    that temperature restricted to the smallest set of tokens whose probabilities reach top_p."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # tokens after the nucleus is full
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


_DECODERS: dict = {}  # (model id, capacity bucket) -> the last Decoder: its caches and CUDA graph are reused


def decoder_for(model, capacity: int) -> Decoder:
    """A Decoder with room for `capacity` positions, kept per model (one at a time): a capacity rounded up to a
    multiple of 1024 reuses the caches and graph of the previous call."""
    bucket = -(-capacity // 1024) * 1024
    device = next(model.parameters()).device.type
    key = (id(model), bucket, torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device))
    dec = _DECODERS.get(key)
    if dec is None or dec.model is not model:
        _DECODERS.clear()  # one set of caches at a time: they are large
        dec = _DECODERS[key] = Decoder(model, bucket)
    return dec


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Optional[set] = None,
             return_logits: bool = False, stop_fn: Optional[Callable[[int, list], bool]] = None,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> Generation:
    """Decode a batch of prompts (right-padded); a row stops at a stop id (not kept), when stop_fn(row, its new
    tokens) is true (checked every CHECK_EVERY steps; the row is cut where it first held), or after
    max_new_tokens. Greedy at temperature 0, else sampled (top_p, seed). Ids past the real vocabulary (padding)
    are never emitted."""
    vocab = model.cfg.vocab_size
    bad = sorted(i for i in (stop_ids or ()) if not 0 <= int(i) < vocab)
    if bad:
        raise ValueError(f"stop ids {bad} are not tokens of this model's vocabulary (0..{vocab - 1})")
    B = len(prompts)
    dec = decoder_for(model, max(len(p) for p in prompts) + max(1, max_new_tokens))
    logits = dec.prefill(prompts)
    dev = dec.device
    before = dec.read_stats().as_dict()
    gen = torch.Generator(dev).manual_seed(seed) if temperature > 0 else None
    stops = torch.tensor(sorted(stop_ids or ()), dtype=torch.long, device=dev)
    out = torch.zeros(B, max(max_new_tokens, 1), dtype=torch.long, device=dev)
    kept = torch.zeros_like(out, dtype=torch.bool)
    active = torch.full((B,), max_new_tokens > 0, dtype=torch.bool, device=dev)
    rec, cut, checked = [], [max_new_tokens] * B, 0
    for t in range(max_new_tokens):
        nxt = choose(logits[:, :vocab], temperature, top_p, gen)
        if return_logits:
            rec.append(logits[:, :vocab].clone())
        emit = active & ~torch.isin(nxt, stops)
        out[:, t], kept[:, t] = nxt, emit
        active = emit & (t + 1 < max_new_tokens)
        if (t + 1) % CHECK_EVERY == 0 or t + 1 == max_new_tokens:
            active, checked = _host_check(out, kept, active, t + 1, checked, stop_fn, cut)
            if not bool(active.any()):
                break
        logits = dec.step(nxt, active)
    return _finish(out, kept, cut, rec, dec, before, return_logits)


def _host_check(out, kept, active, n: int, checked: int, stop_fn, cut: list):
    """Every CHECK_EVERY steps: rows whose stop_fn held at some step since the last check end there (`cut`)."""
    if stop_fn is None:
        return active, n
    toks, keep = out[:, :n].tolist(), kept[:, :n].tolist()
    act = active.tolist()
    for b, (row, k) in enumerate(zip(toks, keep)):
        mine = [x for x, y in zip(row, k) if y]
        for m in range(checked + 1, len(mine) + 1):
            if m <= cut[b] and stop_fn(b, mine[:m]):
                cut[b], act[b] = m, False
                break
    return torch.tensor(act, dtype=torch.bool, device=out.device), n


def _finish(out, kept, cut, rec, dec: Decoder, before: dict, return_logits: bool) -> Generation:
    toks, keep = out.tolist(), kept.tolist()
    rows = [[x for x, y in zip(r, k) if y][:c] for r, k, c in zip(toks, keep, cut)]
    stats = dec.read_stats().as_dict()
    stats = {k: stats[k] - before[k] for k in ("rows", "selected", "layer_steps", "skipped")}
    stats["global_fraction"] = stats["selected"] / max(stats["rows"], 1)
    stats["skipped_fraction"] = stats["skipped"] / max(stats["layer_steps"], 1)
    logits = None
    if return_logits:
        steps = torch.stack(rec, 1).cpu() if rec else torch.zeros(len(rows), 0, 0)  # (B, n, V)
        logits = [steps[b, :len(r) + (len(r) < steps.shape[1])] for b, r in enumerate(rows)]
    return Generation(rows, logits, stats, dec.cache_bytes)
