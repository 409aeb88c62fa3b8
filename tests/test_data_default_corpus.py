"""The embedded default corpus, built from scratch in a temporary cache through the real builder."""
import json
import threading

from data.default_corpus import ensure_default_corpus, source_files
from data.loader import ShardDataset, TokenLoader
from test_data_fixtures import ENC


def test_embedded_default_corpus_builds_from_scratch_and_is_reused(tmp_path):
    paths = []
    builders = [threading.Thread(target=lambda: paths.append(ensure_default_corpus(cache_dir=tmp_path,
                                                                                    max_files=40, workers=2)))
                for _ in range(2)]  # concurrent callers: one builds, the other waits and reuses
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    assert len(paths) == 2 and paths[0] == paths[1]
    path = paths[0]
    m = json.loads((path / "manifest.json").read_text())
    assert m["source"]["files"] == 40 and m["tokenizer"]["name"] == "cl100k_base"
    assert m["num_documents"] + m["skipped"].get("empty_documents_skipped", 0) == 79 + 40  # topics + files
    ds = ShardDataset(path)
    text = ENC.decode(ds.read(0, ds.num_tokens).tolist())
    first_file = source_files(40)[0].read_text()
    assert "<|endoftext|>" in text and first_file in text  # code
    assert "assignment statement" in text.lower()  # prose from the language reference topics
    batch = TokenLoader(ds, 256, 4, 2).next_step()[0]
    assert batch.inputs.shape == (2, 256)
    mtime = (path / "manifest.json").stat().st_mtime_ns
    assert ensure_default_corpus(cache_dir=tmp_path, max_files=40) == path
    assert (path / "manifest.json").stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert ensure_default_corpus(cache_dir=tmp_path, max_files=41) != path  # other content, other key
