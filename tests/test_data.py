"""Data preparation, the embedded default corpus and the deterministic loader."""
import json
import logging

import numpy as np
import pytest
import torch

from data.default_corpus import ensure_default_corpus
from data.format import DataError
from data.loader import ShardDataset, TokenLoader
from data.prepare import main as prepare_main
from data.prepare import prepare
from data.tokenizer import load_tokenizer

ENC = load_tokenizer("cl100k_base")


def corpus_texts(n=60, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "logo", "attention", "token", "span", "local", "global"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 120)))) + f" doc{i}." for i in range(n)]


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture
def prepared(tmp_path):
    texts = corpus_texts()
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    out = tmp_path / "corpus"
    assert prepare_main([str(src), "--out", str(out), "--workers", "2", "--val-fraction", "0.1",
                         "--shard-tokens", "300"]) == 0
    return out, texts


def test_round_trip_text_to_batches(prepared):
    out, texts = prepared
    m = json.loads((out / "manifest.json").read_text())
    assert m["num_documents"] == len(texts) and m["tokenizer"]["name"] == "cl100k_base"
    assert len(m["splits"]["train"]["shards"]) > 1  # small shards: the stream spans several files
    val_docs = [t for i, t in enumerate(texts) if i % 10 == 9]
    train_docs = [t for i, t in enumerate(texts) if i % 10 != 9]
    ds = ShardDataset(out, "train")
    stream = ds.read(0, ds.num_tokens)
    assert ENC.decode(stream.tolist()) == "".join(t + "<|endoftext|>" for t in train_docs)
    assert ShardDataset(out, "val").num_tokens == sum(len(ENC.encode(t)) + 1 for t in val_docs)
    loader = TokenLoader(ds, seq_len=16, global_batch=4, micro_batch=2, seed=3)
    seen = []
    for _ in range(loader.batches_per_epoch):
        for b in loader.next_step():
            assert torch.equal(b.inputs[:, 1:], b.labels[:, :-1])
            seen.extend(b.inputs.tolist())
    # every instance of the epoch once: instance i = stream[16 i : 16 i + 16]
    want = sorted(stream[: loader.batches_per_epoch * 4 * 16].reshape(-1, 16).tolist())
    assert sorted(seen) == want


def test_document_boundaries(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    loader = TokenLoader(ds, seq_len=32, global_batch=4, micro_batch=4, seed=0)
    b = loader.next_step()[0]
    cu = b.cu_seqlens.tolist()
    flat = b.inputs.flatten().tolist()
    assert cu[0] == 0 and cu[-1] == 4 * 32 and all(r * 32 in cu for r in range(5))
    for start, end in zip(cu[:-1], cu[1:]):
        seg = flat[start:end]
        assert ENC.eot_token not in seg[:-1]  # documents end with EOS; no EOS inside a segment
        if end % 32 and end != cu[-1]:
            assert seg[-1] == ENC.eot_token
    loader_nodoc = TokenLoader(ds, seq_len=32, global_batch=4, micro_batch=4, seed=0, document_mask=False)
    assert loader_nodoc.next_step()[0].cu_seqlens is None


@pytest.mark.parametrize("world", [2, 4])
def test_rank_count_independence(prepared, world):
    out, _ = prepared
    ds = ShardDataset(out)
    single = TokenLoader(ds, 8, global_batch=8, micro_batch=2, seed=7)
    ranks = [TokenLoader(ds, 8, global_batch=8, micro_batch=8 // world // 2 or 1, dp_rank=r, dp_world=world, seed=7)
             for r in range(world)]
    for _ in range(single.batches_per_epoch + 2):  # crosses into the next epoch
        want = torch.cat([b.inputs for b in single.next_step()])
        got = torch.cat([b.inputs for r in ranks for b in r.next_step()])
        assert torch.equal(want, got)


def test_exact_resume_mid_epoch(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    a = TokenLoader(ds, 8, 4, 2, seed=1)
    for _ in range(3):
        a.next_step()
    state = a.state_dict()
    rest_a = [torch.cat([b.inputs for b in a.next_step()]) for _ in range(a.batches_per_epoch)]
    b = TokenLoader(ds, 8, 4, 2, seed=1)
    b.load_state_dict(state)
    rest_b = [torch.cat([x.inputs for x in b.next_step()]) for _ in range(b.batches_per_epoch)]
    assert all(torch.equal(x, y) for x, y in zip(rest_a, rest_b))
    with pytest.raises(DataError, match="seq_len"):
        TokenLoader(ds, 16, 4, 2, seed=1).load_state_dict(state)


def test_state_against_another_dataset_fails(prepared, tmp_path):
    out, _ = prepared
    src = write_jsonl(tmp_path / "b.jsonl", corpus_texts(seed=5))
    other = tmp_path / "other"
    prepare_main([str(src), "--out", str(other), "--workers", "1", "--val-fraction", "0.1"])
    state = TokenLoader(ShardDataset(out), 8, 4, 2).state_dict()
    with pytest.raises(DataError, match="fingerprint"):
        TokenLoader(ShardDataset(other), 8, 4, 2).load_state_dict(state)


def test_eval_iteration_covers_the_split_once(prepared):
    out, _ = prepared
    ds = ShardDataset(out, "val")
    loader = TokenLoader(ds, 8, 1, 1)
    rows = [r for b in loader.iter_eval() for r in b.inputs.tolist()]
    assert len(rows) == loader.num_instances
    assert rows[0] == ds.read(0, 8).tolist()


# --- bad input --------------------------------------------------------------------------------------

def run_prepare(args, capsys):
    code = prepare_main(args)
    return code, capsys.readouterr().err


def test_missing_and_empty_files(tmp_path, capsys):
    code, err = run_prepare([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "nope.jsonl does not exist" in err
    code, err = run_prepare([str(tmp_path / "*.parquet"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "matched no file" in err
    (tmp_path / "empty.jsonl").write_text("")
    code, err = run_prepare([str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "empty.jsonl is empty" in err


def test_missing_text_field(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", ["hello"], field="content")
    code, err = run_prepare([str(src), "--out", str(tmp_path / "o"), "--workers", "1"], capsys)
    assert code == 2 and "a.jsonl:1: no text field 'text'" in err and "content" in err
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x y z"]}), tmp_path / "p.parquet")
    code, err = run_prepare([str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o2")], capsys)
    assert code == 2 and "no text field 'text'" in err and "body" in err


def test_bad_bytes_and_empty_documents_are_skipped_with_counts(tmp_path, caplog):
    src = tmp_path / "a.jsonl"
    with open(src, "wb") as f:
        f.write(b'{"text": "good one"}\n')
        f.write(b'{"text": "bad \xff\xfe bytes"}\n')
        f.write(b'{"text": ""}\n')
        f.write(b'{"text": "good two"}\n')
    with caplog.at_level(logging.INFO, logger="logo.data"):
        assert prepare_main([str(src), "--out", str(tmp_path / "o"), "--workers", "1", "--val-fraction", "0"]) == 0
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["skipped"] == {"documents_with_bad_bytes": 1, "empty_documents_skipped": 1}
    assert m["num_documents"] == 3
    assert "empty documents skipped: 1" in caplog.text and "documents with bad bytes: 1" in caplog.text
    text = ENC.decode(ShardDataset(tmp_path / "o").read(0, m["num_tokens"]).tolist())
    assert "bad  bytes" in text


def test_truncated_corrupted_and_mismatched_shards(prepared):
    out, _ = prepared
    shard = out / "train_00000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-4])
    with pytest.raises(DataError, match="train_00000.bin is truncated"):
        ShardDataset(out)
    shard.write_bytes(data[:8] + bytes([data[8] ^ 1]) + data[9:])
    with pytest.raises(DataError, match="train_00000.bin is corrupted"):
        ShardDataset(out)
    shard.write_bytes(data)
    ShardDataset(out)
    (out / "train_00001.idx").unlink()
    with pytest.raises(DataError, match="train_00001.idx listed in the manifest is missing"):
        ShardDataset(out)


def test_manifest_problems_and_tokenizer_mismatch(prepared, tmp_path):
    out, _ = prepared
    with pytest.raises(DataError, match="asks for 'gpt2'"):
        ShardDataset(out, tokenizer="gpt2")
    with pytest.raises(DataError, match="no split 'test'"):
        ShardDataset(out, split="test")
    m = json.loads((out / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["num_tokens"] += 1
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="truncated or corrupted"):
        ShardDataset(out)
    (tmp_path / "x").mkdir()
    with pytest.raises(DataError, match="manifest.json is missing"):
        ShardDataset(tmp_path / "x")
    with pytest.raises(DataError, match="does not exist"):
        ShardDataset(tmp_path / "y")


def test_batch_divisibility_error(prepared):
    out, _ = prepared
    with pytest.raises(DataError, match="micro_batch=3 x dp_world=2"):
        TokenLoader(ShardDataset(out), 8, global_batch=8, micro_batch=3, dp_world=2)


def test_interrupted_preparation_continues_cleanly(tmp_path):
    texts = corpus_texts(200, seed=2)
    out = tmp_path / "c"
    source = {"test": 1}

    def docs_then_crash():
        for i, t in enumerate(texts):
            if i == 150:
                raise KeyboardInterrupt  # killed mid-run
            yield t

    with pytest.raises(KeyboardInterrupt):
        prepare(docs_then_crash(), out, source, workers=1, val_fraction=0.1, shard_tokens=200, progress=False)
    assert not (out / "manifest.json").exists()
    prog = json.loads((out / "progress.json").read_text())
    assert 0 < prog["documents_read"] <= 150
    listed = {s["name"]: s for split in prog["shards"].values() for s in split}
    published = {p.stem for p in out.glob("*.bin")}
    assert published and published == set(listed)  # every visible shard is complete and recorded
    for name in published:
        assert (out / f"{name}.bin").stat().st_size == 4 * listed[name]["num_tokens"]
    m = prepare(iter(texts), out, source, workers=1, val_fraction=0.1, shard_tokens=200, progress=False)
    fresh = prepare(iter(texts), tmp_path / "fresh", source, workers=1, val_fraction=0.1, shard_tokens=200,
                    progress=False)
    assert m["num_tokens"] == fresh["num_tokens"] and m["num_documents"] == fresh["num_documents"] == 200
    a = ShardDataset(out)
    b = ShardDataset(tmp_path / "fresh")
    assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
    with pytest.raises(DataError, match="other settings"):
        prepare(iter(texts), out, {"test": 2}, workers=1, progress=False)


def test_hf_dataset_path_with_a_local_dataset(tmp_path, capsys):
    import datasets
    ds = datasets.Dataset.from_dict({"text": corpus_texts(20), "n": list(range(20))})
    ds.save_to_disk(str(tmp_path / "hf"))
    assert prepare_main(["--hf-dataset", str(tmp_path / "hf"), "--out", str(tmp_path / "o"), "--workers", "1"]) == 0
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["num_documents"] == 20
    code, err = run_prepare(["--hf-dataset", str(tmp_path / "hf"), "--text-field", "body", "--out",
                             str(tmp_path / "o2")], capsys)
    assert code == 2 and "no text field 'body'" in err


def test_embedded_default_corpus_builds_from_scratch(tmp_path):
    path = ensure_default_corpus(cache_dir=tmp_path, max_files=40, workers=2)
    m = json.loads((path / "manifest.json").read_text())
    assert m["num_documents"] > 40 and m["num_tokens"] > 50_000
    ds = ShardDataset(path)
    text = ENC.decode(ds.read(0, 2000).tolist())
    assert "<|endoftext|>" in text
    assert ensure_default_corpus(cache_dir=tmp_path, max_files=40) == path  # reused, not rebuilt
