"""Weighted mixtures: rows per source follow the weights, the global batch does not depend on the number of
data-parallel ranks, a loader restored from its state continues with identical batches (with and without the
prefetch thread), each row is its source's own row, and a state of another data setting is refused."""
import numpy as np
import pytest
import torch

from data.format import DataError
from data.loader import ShardDataset, TokenLoader, rows_batch
from data.mix import MixLoader, MixSource
from data.prefetch import StepLoader
from data.synthetic import SyntheticParams, SyntheticStream, SyntheticTask, train_stream
from test_data_fixtures import prepared_fixture  # noqa: F401 (the fixture `prepared`)
from test_data_loader import rows_with_boundaries
from test_data_prefetch import same_batches

T = 32


def sources(corpus, weights=(0.5, 0.3, 0.2)):
    """A prepared corpus and two synthetic tasks (episodes of 32 and 16 tokens)."""
    recall = SyntheticTask(SyntheticParams("associative_recall", 32, 8, pairs=4, queries=2))
    copy = SyntheticTask(SyntheticParams("far_copy", 16, 4, span=2))
    return [MixSource("text", "shards", weights[0], ShardDataset(corpus), seed=3),
            MixSource("recall", "synthetic", weights[1], SyntheticStream(recall, train_stream(0, "recall"))),
            MixSource("copy", "synthetic", weights[2], SyntheticStream(copy, train_stream(0, "copy")))]


def mix(corpus, G=8, micro=2, rank=0, world=1, seed=11, weights=(0.5, 0.3, 0.2)):
    return MixLoader(sources(corpus, weights), T, G, micro, rank, world, seed=seed)


def test_rows_per_source_follow_the_weights(prepared):
    out, _ = prepared
    G, n = 8, 500
    m = mix(out, G=G)
    counts = np.stack([np.bincount(m.batch_sources(b), minlength=3) for b in range(n)])  # (n, 3)
    w = np.array([0.5, 0.3, 0.2])
    assert ((counts == np.floor(G * w)) | (counts == np.ceil(G * w))).all()  # each batch: floor or ceil of G x w
    assert np.abs(counts.sum(0) / (n * G) - w).max() < 0.01
    assert not (counts == counts[0]).all()  # the fractional rows move between batches
    assert np.array_equal(m.rows_before(n), counts.sum(0))
    assert m.source_tokens(n) == {name: int(c) * T for name, c in zip(("text", "recall", "copy"), counts.sum(0))}
    assert np.array_equal(mix(out, G=G).batch_sources(7), m.batch_sources(7))  # (seed, step) alone
    assert not np.array_equal(mix(out, G=G, seed=12).batch_sources(7), m.batch_sources(7))


def test_each_row_is_its_sources_own_next_row(prepared):
    out, _ = prepared
    m = mix(out, G=4, micro=4)
    text = TokenLoader(ShardDataset(out), T, 1, 1, seed=3)  # the corpus's own shuffled order
    seen = [0, 0, 0]
    for b in range(6):
        (batch,) = m.next_step()
        for r, s in enumerate(m.batch_sources(b).tolist()):
            src = m.sources[s]
            inst = text.global_batch_instances(seen[s]) if s == 0 else np.array([seen[s]])
            want = rows_batch(src.ds, inst, T)
            assert torch.equal(batch.inputs[r], want.inputs[0]) and torch.equal(batch.labels[r], want.labels[0])
            seen[s] += 1
    assert m.rows_before(6).tolist() == seen


def test_synthetic_rows_hold_whole_episodes_as_documents(prepared):
    out, _ = prepared
    m = mix(out, G=8, micro=8, weights=(1e-9, 1e-9, 1.0))  # copy rows only: two 16-token episodes a row
    (batch,) = m.next_step()
    assert batch.cu_seqlens.tolist() == list(range(0, 8 * T + 1, 16))
    assert (batch.inputs[:, 0] == batch.inputs[0, 0]).all() and (batch.inputs[:, 16] == batch.inputs[0, 0]).all()


@pytest.mark.parametrize("world", [2, 4])
def test_the_global_batch_does_not_depend_on_the_number_of_ranks(prepared, world):
    out, _ = prepared
    single = mix(out, G=8, micro=2)
    ranks = [mix(out, G=8, micro=2 if world == 2 else 1, rank=r, world=world) for r in range(world)]
    for b in range(12):
        want = single.step_data(b)
        got = [r.step_data(b) for r in ranks]
        assert [row for g in got for row in rows_with_boundaries(g.micro_batches, T)] == \
            rows_with_boundaries(want.micro_batches, T)
        assert all(g.target_tokens == want.target_tokens == 8 * T for g in got)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_restored_loader_continues_exactly(prepared, prefetch):
    out, _ = prepared
    a = StepLoader(mix(out), prefetch=prefetch, depth=3)
    try:
        for _ in range(5):
            a.next_step()
        state = a.state_dict()  # the consumed position, whatever the thread prepared ahead
        assert state["batches_consumed"] == 5 and sum(s["rows"] for s in state["sources"]) == 5 * 8
        rest = [a.next_step().micro_batches for _ in range(30)]  # past the corpus's epoch: a new permutation
    finally:
        a.close()
    assert a.loader.rows_before(35)[0] > (ShardDataset(out).num_tokens - 1) // T  # the corpus's rows: 2 epochs
    for world in (1, 2):
        ranks = [StepLoader(mix(out, micro=2, rank=r, world=world), prefetch=prefetch) for r in range(world)]
        try:
            for r in ranks:
                r.load_state_dict(state)
            for want in rest:
                got = [mb for r in ranks for mb in r.next_step().micro_batches]
                if world == 1:
                    same_batches(got, want)
                else:
                    assert rows_with_boundaries(got, T) == rows_with_boundaries(want, T)
        finally:
            for r in ranks:
                r.close()


def test_a_state_of_other_data_is_refused(prepared):
    out, _ = prepared
    m = mix(out)
    m.next_step()
    state = m.state_dict()
    with pytest.raises(DataError, match="mixture is"):
        mix(out, weights=(0.5, 0.25, 0.25)).load_state_dict(state)
    with pytest.raises(DataError, match="seed=11"):
        mix(out, seed=5).load_state_dict(state)
    single = TokenLoader(ShardDataset(out), T, 8, 2).state_dict()
    with pytest.raises(DataError, match="single-corpus run"):
        mix(out).load_state_dict(single)
    with pytest.raises(DataError, match="positive weights"):
        mix(out, weights=(0.5, 0.0, 0.5))
    with pytest.raises(DataError, match="comes before"):
        restored = mix(out)
        restored.load_state_dict(state)
        restored.step_data(0)
