"""The loader: round trip to batches, document boundaries, rank-count independence, exact resume, eval mode."""
import numpy as np
import pytest
import torch

from data.format import DataError
from data.loader import IGNORE_INDEX, ShardDataset, TokenLoader
from data.prepare import main as prepare_main
from test_data_fixtures import ENC, corpus_texts, write_jsonl
from test_data_fixtures import prepared_fixture  # noqa: F401 (the fixture `prepared`)


def rows_with_boundaries(batches, T):
    """[(row tokens, row labels, document starts inside the row)] from micro-batches, rank-layout free."""
    out = []
    for b in batches:
        cu = b.cu_seqlens.tolist()
        for r in range(b.inputs.shape[0]):
            starts = tuple(c - r * T for c in cu if r * T < c < (r + 1) * T)
            out.append((tuple(b.inputs[r].tolist()), tuple(b.labels[r].tolist()), starts))
    return out


def test_round_trip_text_to_batches_to_text(prepared):
    out, texts = prepared
    ds = ShardDataset(out, "train")
    T = 16
    loader = TokenLoader(ds, seq_len=T, global_batch=1, micro_batch=1, seed=3)  # an epoch = every instance
    rows = {}
    for _ in range(loader.batches_per_epoch):
        (inst,) = loader.global_batch_instances(loader.batches_consumed).tolist()
        (b,) = loader.next_step()
        assert b.inputs.dtype == b.labels.dtype == torch.int64 and b.valid.dtype == torch.bool
        assert b.inputs.shape == b.labels.shape == b.valid.shape == (1, T) and b.valid.all()
        assert torch.equal(b.inputs[:, 1:], b.labels[:, :-1])
        rows[inst] = b
    n = loader.num_instances
    assert sorted(rows) == list(range(n)) and list(rows) != list(range(n))  # all of them, shuffled
    tokens = [t for i in range(n) for t in rows[i].inputs[0].tolist()] + [int(rows[n - 1].labels[0, -1])]
    tail = ds.read(n * T + 1, ds.num_tokens - n * T - 1).tolist()  # the last partial window: not trained on
    assert len(tail) < T
    train_docs = [t for i, t in enumerate(texts) if i % 10 != 9]
    assert ENC.decode(tokens + tail) == "".join(t + "<|endoftext|>" for t in train_docs)


def test_document_boundaries(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    T = 32
    loader = TokenLoader(ds, seq_len=T, global_batch=8, micro_batch=4, seed=0)
    for _ in range(loader.batches_per_epoch):
        for b in loader.next_step():
            cu = b.cu_seqlens.tolist()
            assert b.cu_seqlens.dtype == torch.int32 and cu == sorted(set(cu))
            assert cu[0] == 0 and cu[-1] == 4 * T and all(r * T in cu for r in range(5))
            flat = b.inputs.flatten().tolist()
            for start, end in zip(cu[:-1], cu[1:]):
                seg = flat[start:end]
                assert ENC.eot_token not in seg[:-1]  # no document crosses a segment
                if end % T:  # a segment cut inside a row ends with its document's EOS
                    assert seg[-1] == ENC.eot_token
    assert TokenLoader(ds, T, 4, 4, document_mask=False).next_step()[0].cu_seqlens is None


def test_document_boundaries_across_shard_edges(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    assert len(ds.tokens) > 2
    stream = ds.read(0, ds.num_tokens)
    want = np.flatnonzero(stream == ENC.eot_token) + 1  # a document starts after every EOS
    for start in range(0, ds.num_tokens - 50, 7):
        got = ds.doc_boundaries(start, 50)
        exp = want[(want > start) & (want < start + 50)] - start
        assert np.array_equal(got, exp), start


@pytest.mark.parametrize("world", [2, 4])
def test_rank_count_independence(prepared, world):
    out, _ = prepared
    ds = ShardDataset(out)
    single = TokenLoader(ds, 8, global_batch=8, micro_batch=2, seed=7)
    ranks = [TokenLoader(ds, 8, global_batch=8, micro_batch=8 // world // 2 or 1, dp_rank=r, dp_world=world, seed=7)
             for r in range(world)]
    for _ in range(single.batches_per_epoch + 2):  # crosses into the next epoch
        want = rows_with_boundaries(single.next_step(), 8)
        got = [row for r in ranks for row in rows_with_boundaries(r.next_step(), 8)]
        assert got == want  # same rows, same order: rank r holds slice r of the global batch


def test_epochs_reshuffle_and_seeds_differ(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    a = TokenLoader(ds, 8, 4, 4, seed=0)
    e0 = [a.global_batch_instances(b).tolist() for b in range(a.batches_per_epoch)]
    e1 = [a.global_batch_instances(a.batches_per_epoch + b).tolist() for b in range(a.batches_per_epoch)]
    for e in (e0, e1):  # each instance at most once an epoch (the tail past the last whole batch waits)
        flat = sum(e, [])
        assert len(set(flat)) == len(flat) == a.batches_per_epoch * 4 and max(flat) < a.num_instances
    assert e0 != e1
    assert TokenLoader(ds, 8, 4, 4, seed=1).global_batch_instances(0).tolist() != e0[0]


def test_exact_resume_mid_epoch_with_any_world_size(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    a = TokenLoader(ds, 8, 4, 2, seed=1)
    for _ in range(3):
        a.next_step()
    state = a.state_dict()
    assert state["batches_consumed"] == 3 and state["epoch"] == 0 and state["seed"] == 1
    steps = a.batches_per_epoch + 1  # runs over the epoch boundary
    rest_a = [rows_with_boundaries(a.next_step(), 8) for _ in range(steps)]
    b = TokenLoader(ds, 8, 4, 2, seed=1)
    b.load_state_dict(state)
    assert [rows_with_boundaries(b.next_step(), 8) for _ in range(steps)] == rest_a
    ranks = [TokenLoader(ds, 8, 4, 1, dp_rank=r, dp_world=2, seed=1) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    assert [[row for r in ranks for row in rows_with_boundaries(r.next_step(), 8)] for _ in range(steps)] == rest_a
    with pytest.raises(DataError, match="seq_len"):
        TokenLoader(ds, 16, 4, 2, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        TokenLoader(ds, 8, 4, 2, seed=2).load_state_dict(state)


def test_state_against_another_dataset_fails(prepared, tmp_path):
    out, _ = prepared
    src = write_jsonl(tmp_path / "b.jsonl", corpus_texts(seed=5))
    other = tmp_path / "other"
    assert prepare_main([str(src), "--out", str(other), "--workers", "1", "--val-fraction", "0.1"]) == 0
    state = TokenLoader(ShardDataset(out), 8, 4, 2).state_dict()
    with pytest.raises(DataError, match="fingerprint.*dataset"):
        TokenLoader(ShardDataset(other), 8, 4, 2).load_state_dict(state)
    with pytest.raises(DataError, match="fingerprint"):  # same corpus, other split
        TokenLoader(ShardDataset(out, "val"), 8, 1, 1).load_state_dict(state)


@pytest.mark.parametrize("world,micro", [(1, 1), (1, 3), (2, 2), (3, 4)])
def test_eval_iteration_predicts_every_token_once(prepared, world, micro):
    out, _ = prepared
    ds = ShardDataset(out, "val")
    stream = ds.read(0, ds.num_tokens)
    T = 8
    loaders = [TokenLoader(ds, T, micro * world, micro, dp_rank=r, dp_world=world) for r in range(world)]
    per_rank = [list(ld.iter_eval()) for ld in loaders]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == loaders[0].num_eval_batches()
    predicted = {}  # stream position of the label -> label
    for r, batches in enumerate(per_rank):
        for j, b in enumerate(batches):
            assert b.inputs.shape == (micro, T)
            assert torch.equal(b.labels == IGNORE_INDEX, ~b.valid)
            cu = b.cu_seqlens.tolist()
            assert cu[0] == 0 and cu[-1] == micro * T and all(k * T in cu for k in range(micro + 1))
            for k in range(micro):
                inst = (j * micro + k) * world + r
                for t in torch.nonzero(b.valid[k]).flatten().tolist():
                    pos = inst * T + t + 1
                    assert pos not in predicted and b.inputs[k, t] == stream[pos - 1]
                    predicted[pos] = int(b.labels[k, t])
    assert predicted == {p: int(stream[p]) for p in range(1, ds.num_tokens)}
    assert len(list(loaders[0].iter_eval(max_batches=1))) == 1


def test_batch_divisibility_error(prepared):
    out, _ = prepared
    with pytest.raises(DataError, match="global batch of 8 .* micro_batch=3 x dp_world=2"):
        TokenLoader(ShardDataset(out), 8, global_batch=8, micro_batch=3, dp_world=2)


def test_split_smaller_than_a_global_batch(prepared):
    out, _ = prepared
    loader = TokenLoader(ShardDataset(out, "val"), 64, global_batch=64, micro_batch=8)
    with pytest.raises(DataError, match="fewer than one global batch of 64 x 65 tokens"):
        loader.next_step()
    assert sum(b.valid.sum().item() for b in loader.iter_eval()) == loader.ds.num_tokens - 1
