"""The project's tiktoken encoding as a `tokenizers` BPE that `AutoTokenizer.from_pretrained` loads offline.

Ranks become the BPE vocabulary (byte-level strings) and merges (transformers' TikTokenConverter), the
encoding's own split pattern becomes the pre-tokenizer, and special tokens keep their tiktoken ids (cl100k has
gaps below and between them). Text is encoded as `encode(text, allowed_special="all")`: special-token strings
in the text become their ids (the project's own data path uses `encode_ordinary`, which never does).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from data.tokenizer import load_tokenizer


@functools.lru_cache(maxsize=2)
def _tokenizer_json(name: str) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import TikTokenConverter

    enc = load_tokenizer(name)

    class _FromEncoding(TikTokenConverter):
        def load_tiktoken_bpe(self, _url):  # the ranks we already hold, no file or download
            return enc._mergeable_ranks

        def tokenizer(self):
            vocab, merges = self.extract_vocab_merges_from_model(None)
            vocab.update(enc._special_tokens)  # at their own ids, so added tokens map onto them
            tok = Tokenizer(BPE(vocab, merges, fuse_unk=False))
            tok.model.ignore_merges = True  # a whole pre-token in the vocabulary is one id, as in tiktoken
            return tok

    specials = [t for t, _ in sorted(enc._special_tokens.items(), key=lambda kv: kv[1])]
    return _FromEncoding(vocab_file=None, pattern=enc._pat_str, extra_special_tokens=specials).converted().to_str()


@functools.lru_cache(maxsize=2)
def _saved_files(name: str) -> tuple[tuple[str, bytes], ...]:
    """The files `save_pretrained` writes for encoding `name` (built once per process: converting the encoding
    is slow)."""
    import tempfile

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json(name))
    eot_str = tok.id_to_token(load_tokenizer(name).eot_token)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot_str, eos_token=eot_str)
    with tempfile.TemporaryDirectory() as d:
        fast.save_pretrained(d)
        return tuple((f.name, f.read_bytes()) for f in sorted(Path(d).iterdir()))


def save_tokenizer(name: str, out: Path, max_length: int) -> int:
    """Write tokenizer.json + tokenizer_config.json for tiktoken encoding `name`; returns the end-of-text id."""
    for fname, data in _saved_files(name):
        if fname == "tokenizer_config.json":
            data = json.dumps({**json.loads(data), "model_max_length": max_length}, indent=2).encode()
        (Path(out) / fname).write_bytes(data)
    return load_tokenizer(name).eot_token
