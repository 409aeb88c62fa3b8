"""Shared helpers for the data tests (no tests here): small corpora written to disk and prepared."""
import json

import numpy as np
import pytest

from data.prepare import main as prepare_main
from data.tokenizer import load_tokenizer

ENC = load_tokenizer("cl100k_base")
WORDS = ["alpha", "beta", "gamma", "delta", "logo", "attention", "token", "span", "local", "global"]


def corpus_texts(n=60, seed=0):
    """n documents of 5..120 random words, each ending with a unique marker."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 120)))) + f" doc{i}." for i in range(n)]


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def run_prepare(args, capsys):
    """(exit code, stderr) of `python -m data.prepare ARGS`."""
    code = prepare_main(args)
    return code, capsys.readouterr().err


@pytest.fixture(name="prepared")
def prepared_fixture(tmp_path):
    """60 documents, 10% validation, shards of ~300 tokens (so the stream spans many shards)."""
    texts = corpus_texts()
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    out = tmp_path / "corpus"
    assert prepare_main([str(src), "--out", str(out), "--workers", "2", "--val-fraction", "0.1",
                         "--shard-tokens", "300"]) == 0
    return out, texts
