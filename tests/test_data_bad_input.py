"""Bad input: every case gives a DataError naming the file and the problem, or is skipped and counted."""
import json
import logging

import pytest

from data.format import DataError
from data.loader import ShardDataset
from data.prepare import main as prepare_main
from test_data_fixtures import ENC, run_prepare, write_jsonl
from test_data_fixtures import prepared_fixture  # noqa: F401 (the fixture `prepared`)


def test_missing_and_empty_files(tmp_path, capsys):
    code, err = run_prepare([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "nope.jsonl does not exist" in err
    code, err = run_prepare([str(tmp_path / "*.parquet"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "matched no file" in err
    (tmp_path / "empty.jsonl").write_text("")
    code, err = run_prepare([str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "empty.jsonl is empty" in err
    (tmp_path / "x.csv").write_text("a,b\n")
    code, err = run_prepare([str(tmp_path / "x.csv"), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "x.csv has an unsupported type" in err
    code, err = run_prepare(["--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "no input" in err


def test_missing_text_field_and_invalid_json(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", ["hello"], field="content")
    code, err = run_prepare([str(src), "--out", str(tmp_path / "o"), "--workers", "1"], capsys)
    assert code == 2 and "a.jsonl:1: no text field 'text'" in err and "content" in err
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x y z"]}), tmp_path / "p.parquet")
    code, err = run_prepare([str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o2")], capsys)
    assert code == 2 and "p.parquet: no text field 'text'" in err and "body" in err
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    code, err = run_prepare([str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "o3")], capsys)
    assert code == 2 and "b.jsonl:2: not valid JSON" in err
    # the failed run finished nothing: fixing the argument and re-running just works
    assert prepare_main([str(src), "--text-field", "content", "--out", str(tmp_path / "o"), "--workers", "1",
                         "--val-fraction", "0"]) == 0


def test_bad_bytes_and_empty_documents_are_skipped_with_counts(tmp_path, caplog):
    src = tmp_path / "a.jsonl"
    with open(src, "wb") as f:
        f.write(b'{"text": "good one"}\n')
        f.write(b'{"text": "bad \xff\xfe bytes"}\n')
        f.write(b'{"text": ""}\n')
        f.write(b'{"text": "lone \\ud800 surrogate"}\n')
        f.write(b'{"text": "good two"}\n')
    with caplog.at_level(logging.INFO, logger="logo.data"):
        assert prepare_main([str(src), "--out", str(tmp_path / "o"), "--workers", "1", "--val-fraction", "0"]) == 0
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["skipped"] == {"documents_with_bad_bytes": 2, "empty_documents_skipped": 1}
    assert m["num_documents"] == 4
    assert "empty documents skipped: 1" in caplog.text and "documents with bad bytes: 2" in caplog.text
    text = ENC.decode(ShardDataset(tmp_path / "o").read(0, m["num_tokens"]).tolist())
    assert text == "good one<|endoftext|>bad  bytes<|endoftext|>lone  surrogate<|endoftext|>good two<|endoftext|>"


def test_only_empty_documents(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    code, err = run_prepare([str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o"), "--workers", "1"], capsys)
    assert code == 2 and "no training tokens" in err


def test_truncated_and_corrupted_shards(prepared):
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
    idx = out / "train_00001.idx"
    raw = idx.read_bytes()
    idx.write_bytes(raw[:-8])
    with pytest.raises(DataError, match="train_00001.idx has .* bytes"):
        ShardDataset(out)
    idx.write_bytes(bytes([raw[0] ^ 1]) + raw[1:])
    with pytest.raises(DataError, match="train_00001.idx is corrupted"):
        ShardDataset(out)
    idx.write_bytes(raw[:-8] + bytes([raw[-8] ^ 1]) + raw[-7:])  # the last document end is wrong
    with pytest.raises(DataError, match="train_00001.idx does not match its shard"):  # caught even unchecksummed
        ShardDataset(out, verify_checksums=False)
    idx.unlink()
    with pytest.raises(DataError, match="train_00001.idx listed in the manifest is missing"):
        ShardDataset(out)


def test_manifest_problems_and_tokenizer_mismatch(prepared, tmp_path):
    out, _ = prepared
    with pytest.raises(DataError, match="tokenized with 'cl100k_base' but the config asks for 'gpt2'"):
        ShardDataset(out, tokenizer="gpt2")
    with pytest.raises(DataError, match="no split 'test'"):
        ShardDataset(out, split="test")
    good = (out / "manifest.json").read_text()
    m = json.loads(good)
    m["splits"]["train"]["shards"][0]["num_tokens"] += 1
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="train_00000.bin is truncated or corrupted"):
        ShardDataset(out)
    m = json.loads(good)
    m["splits"]["train"]["num_tokens"] += 5
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="the manifest says"):
        ShardDataset(out)
    m["format"] = 1
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="has format 1"):
        ShardDataset(out)
    (out / "manifest.json").write_text(good[: len(good) // 2])
    with pytest.raises(DataError, match="manifest.json is not valid JSON"):
        ShardDataset(out)
    (tmp_path / "x").mkdir()
    with pytest.raises(DataError, match="manifest.json is missing"):
        ShardDataset(tmp_path / "x")
    with pytest.raises(DataError, match="does not exist"):
        ShardDataset(tmp_path / "y")


def test_token_id_outside_the_vocabulary_names_shard_and_offset(prepared):
    """Sizes-only verification (large corpora) does not read the tokens; the loader's range check does."""
    import numpy as np
    out, _ = prepared
    shard = out / "train_00001.bin"
    tokens = np.fromfile(shard, dtype=np.uint32)
    ds = ShardDataset(out, verify_checksums=False)
    tokens[7] = ds.vocab_size + 5
    tokens.tofile(shard)
    ds = ShardDataset(out, verify_checksums=False)
    start = int(ds.shard_starts[1])
    ds.read(0, start)  # shard 0 is fine
    with pytest.raises(DataError, match=rf"token id {ds.vocab_size + 5} at token offset 7 of shard .*train_00001.bin "
                                        rf"is outside the vocabulary \({ds.vocab_size} ids\)"):
        ds.read(start - 3, 20)
