"""Long-range synthetic sources: seeded episodes whose answers need context far beyond the sliding window.

An episode is one document of `length` tokens (its last token EOS) whose answer tokens can only be predicted
from tokens at least `gap` tokens back (a gap longer than window x layers, the reach of a stack of sliding
windows). Three tasks:

    associative_recall  Begin k1 v1 ... kP vP <filler >= gap> Query kq vq ... Query kq vq EOS
    needle_retrieval    Begin <filler with N needles "Needle k v1..vV" and D decoys "Fake k' w1..wV"> Query k v1..vV
                        ... (every needle once, in random order) EOS; a needle ends >= gap before the queries,
                        decoys lie anywhere (half of them repeat a needle's key with other values)
    far_copy            Begin <filler> Copy s1..sS <filler >= gap> Paste s1..sS EOS

Tokens are ids of the run's tokenizer (`SyntheticVocab`): keys, values and filler are disjoint pools of
single-token lowercase words, the markers single-token capitalised words, so `decode` reads as text. The answers
are the values after a query (`answer_len` 1 or V tokens each) and the pasted span; the token at index j of an
episode is predicted at input position j - 1.

Episode i of a stream is generated from `numpy.random.default_rng([*stream, task, i])` alone: any episode can be
regenerated, training streams (`train_stream(data_seed, name)`) and held-out streams (`heldout_stream(seed)`)
differ in their split word, so their episodes are independent draws (with these pools, never equal).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from data.format import DataError
from data.tokenizer import canonical_name, load_tokenizer

TASKS = ("associative_recall", "needle_retrieval", "far_copy")
# the parameters each task reads (besides length and gap); the others must keep their defaults
TASK_PARAMS = {"associative_recall": ("pairs", "queries"), "needle_retrieval": ("needles", "distractors", "value_len"),
               "far_copy": ("span",)}
TRAIN, HELDOUT = 0, 1  # the split word of a stream's seed
EPISODES_PER_STREAM = 1 << 40  # a training stream is endless in practice
MARKERS = {"begin": " Begin", "query": " Query", "needle": " Needle", "decoy": " Fake", "copy": " Copy",
           "paste": " Paste"}
WORD = re.compile(rb"^ [a-z]{4,9}$")


class ParamError(DataError):
    """A synthetic task parameter that cannot work: `field`, `value` and `why` for the caller's message."""

    def __init__(self, field: str, value, why: str):
        super().__init__(f"{field}={value!r}: {why}")
        self.field, self.value, self.why = field, value, why


@dataclass(frozen=True)
class SyntheticParams:
    """One task's episode shape, in tokens."""

    task: str
    length: int  # episode tokens, EOS included
    gap: int  # fewest tokens between an answer and where it was given
    pairs: int = 16  # associative_recall: key-value pairs
    queries: int = 8  # associative_recall: pairs asked (distinct)
    needles: int = 4  # needle_retrieval: needles, each asked once
    distractors: int = 8  # needle_retrieval: decoys
    value_len: int = 4  # needle_retrieval: tokens of a needle's value
    span: int = 32  # far_copy: tokens copied
    pool: int = 0  # words in each of the key, value and filler pools the episodes draw from; 0: the whole pools

    def relevant(self) -> dict:
        """The parameters this task reads."""
        names = ("task", "length", "gap", *TASK_PARAMS.get(self.task, ()), *(("pool",) if self.pool else ()))
        return {k: getattr(self, k) for k in names}


@dataclass(frozen=True)
class SyntheticVocab:
    """Disjoint token-id pools and markers of one tokenizer."""

    tokenizer: str
    keys: np.ndarray  # (K,) int64
    values: np.ndarray  # (V,) int64
    filler: np.ndarray  # (F,) int64
    markers: dict  # marker name -> token id
    eos: int

    @property
    def max_id(self) -> int:
        return int(max(self.keys.max(), self.values.max(), self.filler.max(), max(self.markers.values()), self.eos))


@functools.cache
def synthetic_vocab(tokenizer: str = "cl100k_base") -> SyntheticVocab:
    """The pools of `tokenizer`: its single-token words ' [a-z]{4,9}', shuffled with a fixed seed and split into
    keys (1/4), values (1/4) and filler (1/2); markers are the single tokens of MARKERS."""
    enc = load_tokenizer(tokenizer)
    markers = {}
    for name, text in MARKERS.items():
        ids = enc.encode_ordinary(text)
        if len(ids) != 1:
            raise DataError(f"tokenizer {tokenizer!r} encodes the marker {text!r} as {len(ids)} tokens: the synthetic "
                            f"tasks need single-token markers")
        markers[name] = ids[0]
    words = []
    for i in range(enc.n_vocab):
        try:
            b = enc.decode_single_token_bytes(i)
        except KeyError:
            continue
        if WORD.match(b) and i not in markers.values():
            words.append(i)
    if len(words) < 4096:
        raise DataError(f"tokenizer {tokenizer!r} has {len(words)} single-token words; the synthetic tasks need 4096")
    pool = np.random.default_rng(0).permutation(np.array(words, dtype=np.int64))
    q = len(pool) // 4
    return SyntheticVocab(canonical_name(enc), np.sort(pool[:q]), np.sort(pool[q:2 * q]), np.sort(pool[2 * q:]),
                          markers, enc.eot_token)


@dataclass
class Episode:
    tokens: np.ndarray  # (L,) int64, tokens[-1] = EOS
    answer_starts: np.ndarray  # (A,) int64: answer a is tokens[answer_starts[a] : answer_starts[a] + answer_len]
    answer_len: int

    @property
    def far_targets(self) -> np.ndarray:
        """(A * answer_len,) int64 indices of every answer token (predicted at index - 1), each needing far context."""
        return (self.answer_starts[:, None] + np.arange(self.answer_len)).reshape(-1)


@dataclass
class EpisodeBatch:
    tokens: np.ndarray  # (B, L) int64
    answer_starts: np.ndarray  # (B, A) int64
    answer_len: int


def train_stream(data_seed: int, source_name: str) -> tuple:
    """The seed words of a training source's episodes: data.seed and the source's name."""
    return (int(data_seed), zlib.crc32(source_name.encode()), TRAIN)


def heldout_stream(seed: int = 0) -> tuple:
    """The seed words of held-out episodes (independent of any run's data.seed: every run gets the same ones)."""
    return (int(seed), 0, HELDOUT)


def fixed_tokens(p: SyntheticParams) -> int:
    """Tokens of an episode that are not filler (markers, keys, values, queries, EOS)."""
    if p.task == "associative_recall":
        return 2 + 2 * p.pairs + 3 * p.queries
    if p.task == "needle_retrieval":
        return 2 + (2 * p.needles + p.distractors) * (p.value_len + 2)
    return 4 + 2 * p.span


def check_params(p: SyntheticParams, vocab: Optional[SyntheticVocab] = None) -> None:
    """ParamError naming the first parameter that cannot work (vocab: also check the pools are large enough)."""
    if p.task not in TASKS:
        raise ParamError("task", p.task, f"unknown synthetic task; choose one of {list(TASKS)}")
    ints = {"length": 8, "gap": 1, "pairs": 1, "queries": 1, "needles": 1, "distractors": 0, "value_len": 1,
            "span": 1, "pool": 0}
    for name, low in ints.items():
        v = getattr(p, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ParamError(name, v, f"must be an integer >= {low}")
    if p.task == "associative_recall" and p.queries > p.pairs:
        raise ParamError("queries", p.queries, f"at most pairs={p.pairs} (each pair is asked at most once)")
    keys = {"associative_recall": p.pairs, "needle_retrieval": p.needles + p.distractors}.get(p.task, 0)
    if p.pool and keys > p.pool:
        raise ParamError("pool", p.pool, f"an episode needs {keys} distinct keys; pool must be at least that")
    if vocab is not None and p.pool > vocab.keys.size:
        raise ParamError("pool", p.pool, f"the tokenizer's key pool has {vocab.keys.size} words")
    if vocab is not None and keys > vocab.keys.size:
        name = "pairs" if p.task == "associative_recall" else "distractors"
        raise ParamError(name, getattr(p, name), f"an episode needs {keys} distinct keys, the pool has {vocab.keys.size}")
    need = fixed_tokens(p) + p.gap
    if need > p.length:
        shape = ", ".join(f"{k}={v}" for k, v in p.relevant().items() if k not in ("task", "length"))
        raise ParamError("length", p.length, f"an episode of {p.task} with {shape} needs at least {need} tokens")


def _filler(rng: np.random.Generator, v: SyntheticVocab, n: int) -> np.ndarray:
    return v.filler[rng.integers(0, v.filler.size, n)]


def _recall(rng: np.random.Generator, p: SyntheticParams, v: SyntheticVocab) -> tuple[np.ndarray, np.ndarray]:
    L, P, Q = p.length, p.pairs, p.queries
    keys = v.keys[rng.choice(v.keys.size, P, replace=False)]  # (P,) distinct
    vals = v.values[rng.integers(0, v.values.size, P)]  # (P,)
    fill = L - fixed_tokens(p)
    out = np.empty(L, np.int64)
    out[0] = v.markers["begin"]
    out[1:1 + 2 * P:2], out[2:2 + 2 * P:2] = keys, vals
    out[1 + 2 * P:1 + 2 * P + fill] = _filler(rng, v, fill)
    asked = rng.choice(P, Q, replace=False)  # (Q,)
    qs = 1 + 2 * P + fill  # the first query's marker
    out[qs:qs + 3 * Q:3], out[qs + 1:qs + 3 * Q:3], out[qs + 2:qs + 3 * Q:3] = v.markers["query"], keys[asked], \
        vals[asked]
    out[-1] = v.eos
    return out, qs + 2 + 3 * np.arange(Q)


def _needles(rng: np.random.Generator, p: SyntheticParams, v: SyntheticVocab) -> tuple[np.ndarray, np.ndarray]:
    L, N, D, V = p.length, p.needles, p.distractors, p.value_len
    item = V + 2  # marker, key, value tokens
    same_key = D // 2  # decoys that repeat a needle's key
    keys = v.keys[rng.choice(v.keys.size, N + D - same_key, replace=False)]
    items = np.empty((N + D, item), np.int64)  # needles, then decoys
    items[:N, 0], items[N:, 0] = v.markers["needle"], v.markers["decoy"]
    items[:N, 1] = keys[:N]
    items[N:, 1] = np.concatenate((keys[:N][rng.integers(0, N, same_key)], keys[N:]))
    items[:, 2:] = v.values[rng.integers(0, v.values.size, (N + D, V))]
    hay = L - 2 - N * item  # tokens 1..hay: filler and items
    fill = hay - (N + D) * item
    # insertion points in the filler: a needle has >= gap filler tokens after it, a decoy anywhere
    at = np.concatenate((rng.integers(0, fill - p.gap + 1, N), rng.integers(0, fill + 1, D)))  # (N+D,)
    order = np.lexsort((rng.random(N + D), at))  # items by insertion point, ties in random order
    starts = np.empty(N + D, np.int64)
    starts[order] = 1 + at[order] + item * np.arange(N + D)
    out = np.empty(L, np.int64)
    is_filler = np.zeros(L, bool)
    is_filler[1:1 + hay] = True
    pos = starts[:, None] + np.arange(item)  # (N+D, item)
    out[pos], is_filler[pos] = items, False
    out[is_filler] = _filler(rng, v, fill)
    out[0], out[-1] = v.markers["begin"], v.eos
    asked = rng.permutation(N)
    queries = out[1 + hay:L - 1].reshape(N, item)  # a view: written in place
    queries[:, 0], queries[:, 1:] = v.markers["query"], items[asked, 1:]
    return out, 1 + hay + 2 + item * np.arange(N)


def _copy(rng: np.random.Generator, p: SyntheticParams, v: SyntheticVocab) -> tuple[np.ndarray, np.ndarray]:
    L, S = p.length, p.span
    fill = L - fixed_tokens(p)
    before = int(rng.integers(0, fill - p.gap + 1))  # filler before the span; the rest (>= gap) after it
    span = v.values[rng.integers(0, v.values.size, S)]
    filler = _filler(rng, v, fill)
    out = np.empty(L, np.int64)
    out[0] = v.markers["begin"]
    out[1:1 + before] = filler[:before]
    c = 1 + before
    out[c], out[c + 1:c + 1 + S] = v.markers["copy"], span
    paste = c + 1 + S + fill - before
    out[c + 1 + S:paste] = filler[before:]
    out[paste], out[paste + 1:paste + 1 + S], out[-1] = v.markers["paste"], span, v.eos
    return out, np.array([paste + 1])


GENERATORS = {"associative_recall": _recall, "needle_retrieval": _needles, "far_copy": _copy}


class SyntheticTask:
    """Episodes of one task's parameters over one tokenizer's vocabulary."""

    def __init__(self, params: SyntheticParams, tokenizer: str = "cl100k_base"):
        self.vocab = synthetic_vocab(tokenizer)
        check_params(params, self.vocab)
        if params.pool:  # the first `pool` words of each pool (the pools are fixed shuffles of the tokenizer's words)
            v = self.vocab
            self.vocab = replace(v, keys=v.keys[:params.pool], values=v.values[:params.pool],
                                 filler=v.filler[:params.pool])
        self.params = params
        self._generate = GENERATORS[params.task]
        self.answer_len = {"associative_recall": 1, "needle_retrieval": params.value_len,
                           "far_copy": params.span}[params.task]
        self.answers = {"associative_recall": params.queries, "needle_retrieval": params.needles,
                        "far_copy": 1}[params.task]
        # format 2: `pool` also restricts the filler (episodes with pool 0 are those of format 1)
        rec = {"params": params.relevant(), "tokenizer": self.vocab.tokenizer, "format": 2 if params.pool else 1}
        self.fingerprint = hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def first_token(self) -> int:
        """Every episode's first token."""
        return self.vocab.markers["begin"]

    def episode(self, index: int, stream: tuple) -> Episode:
        """Episode `index` of the stream `stream` (`train_stream` / `heldout_stream`)."""
        rng = np.random.default_rng([*stream, TASKS.index(self.params.task), int(index)])
        tokens, starts = self._generate(rng, self.params, self.vocab)
        return Episode(tokens, starts, self.answer_len)

    def episodes(self, indices, stream: tuple) -> EpisodeBatch:
        """Episodes `indices` of a stream, stacked."""
        eps = [self.episode(i, stream) for i in indices]
        return EpisodeBatch(np.stack([e.tokens for e in eps]), np.stack([e.answer_starts for e in eps]),
                            self.answer_len)

    def describe(self) -> dict:
        return {**self.params.relevant(), "fingerprint": self.fingerprint}


class SyntheticStream:
    """A task's training episodes back to back as one endless token stream, with the reading interface of
    `data.loader.ShardDataset` (`read`, `doc_boundaries`, `num_tokens`, `eos`, `token_limit`), so the loader's
    rows and document offsets come from the same code as a corpus's; each episode is a document."""

    CACHED = 8  # episodes kept (a row reads its own and the next episode's first token)

    def __init__(self, task: SyntheticTask, stream: tuple, name: str = ""):
        self.task, self.stream = task, stream
        self.length = task.params.length
        self.num_tokens = self.length * EPISODES_PER_STREAM
        self.eos = task.vocab.eos
        self.token_limit = None  # ids come from the tokenizer's pools
        self.root, self.split = f"synthetic:{name or task.params.task}", "train"
        self.fingerprint = f"{task.fingerprint}:{':'.join(map(str, stream))}"
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def _episode(self, k: int) -> np.ndarray:
        with self._lock:
            tokens = self._cache.get(k)
            if tokens is None:
                tokens = self.task.episode(k, self.stream).tokens
                self._cache[k] = tokens
                if len(self._cache) > self.CACHED:
                    self._cache.popitem(last=False)
            return tokens

    def read(self, start: int, length: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Tokens [start, start+length) of the stream -> (length,) int64."""
        out = np.empty(length, dtype=np.int64) if out is None else out
        L, pos, filled = self.length, start, 0
        while filled < length:
            k, off = divmod(pos, L)
            take = min(length - filled, L - off)
            if off == 0 and take == 1:  # only an episode's first token: no need to generate it
                out[filled] = self.task.first_token
            else:
                out[filled:filled + take] = self._episode(k)[off:off + take]
            filled, pos = filled + take, pos + take
        return out

    def doc_boundaries(self, start: int, length: int) -> np.ndarray:
        """Offsets (relative to start) in (0, length) where an episode begins -> (k,) int64."""
        first = (start // self.length + 1) * self.length
        return np.arange(first, start + length, self.length, dtype=np.int64) - start
