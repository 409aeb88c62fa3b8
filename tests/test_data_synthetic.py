"""The long-range synthetic tasks: determinism from (stream, index), held-out episodes apart from training ones,
answers where each task puts them and only recoverable from far back, valid and decodable token ids, and the
episode stream read through the loader's own rows and document offsets."""
import numpy as np
import pytest

from data.loader import rows_batch
from data.synthetic import (TASKS, ParamError, SyntheticParams, SyntheticStream, SyntheticTask, check_params,
                            heldout_stream, synthetic_vocab, train_stream)
from test_data_fixtures import ENC

GAP = 96
PARAMS = {"associative_recall": SyntheticParams("associative_recall", 256, GAP, pairs=12, queries=6),
          "needle_retrieval": SyntheticParams("needle_retrieval", 256, GAP, needles=3, distractors=6, value_len=3),
          "far_copy": SyntheticParams("far_copy", 256, GAP, span=10)}
V = synthetic_vocab("cl100k_base")
M = V.markers


@pytest.mark.parametrize("task", TASKS)
def test_episodes_are_determined_by_stream_and_index(task):
    t = SyntheticTask(PARAMS[task])
    s = train_stream(1234, "src")
    a, b = t.episode(7, s), SyntheticTask(PARAMS[task]).episode(7, s)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.answer_starts, b.answer_starts)
    assert not np.array_equal(a.tokens, t.episode(8, s).tokens)
    assert not np.array_equal(a.tokens, t.episode(7, train_stream(1234, "other")).tokens)  # the name is a seed word
    assert not np.array_equal(a.tokens, t.episode(7, train_stream(1235, "src")).tokens)
    batch = t.episodes([3, 7], s)
    assert batch.tokens.shape == (2, 256) and np.array_equal(batch.tokens[1], a.tokens)


@pytest.mark.parametrize("task", TASKS)
def test_heldout_episodes_are_not_training_episodes(task):
    t = SyntheticTask(PARAMS[task])
    train = {t.episode(i, train_stream(1234, task)).tokens.tobytes() for i in range(300)}
    held = {t.episode(i, heldout_stream(0)).tokens.tobytes() for i in range(300)}
    assert len(train) == len(held) == 300 and not train & held
    assert not held & {t.episode(i, heldout_stream(1)).tokens.tobytes() for i in range(300)}  # another seed


@pytest.mark.parametrize("task", TASKS)
def test_ids_are_valid_and_decodable(task):
    e = SyntheticTask(PARAMS[task]).episode(0, heldout_stream(0))
    assert e.tokens.dtype == np.int64 and e.tokens.shape == (256,)
    assert e.tokens[0] == M["begin"] and e.tokens[-1] == ENC.eot_token and ENC.eot_token not in e.tokens[:-1]
    assert e.tokens.max() < ENC.n_vocab
    text = ENC.decode(e.tokens[:-1].tolist())
    assert text.startswith(" Begin") and len(ENC.encode_ordinary(text)) == 255  # every token a whole word
    pools = [set(V.keys.tolist()), set(V.values.tolist()), set(V.filler.tolist()), set(M.values())]
    assert sum(len(p) for p in pools) == len(set().union(*pools))  # disjoint pools


def _first_index(tokens, value, before):
    hits = np.flatnonzero(tokens[:before] == value)
    return int(hits[0]) if hits.size else -1


def test_recall_answers_are_the_paired_values_far_back():
    p = PARAMS["associative_recall"]
    t = SyntheticTask(p)
    for i in range(50):
        e = t.episode(i, heldout_stream(3))
        tok = e.tokens
        assert t.answer_len == 1 and e.answer_starts.shape == (p.queries,)
        pairs = tok[1:1 + 2 * p.pairs].reshape(p.pairs, 2)
        assert len(set(pairs[:, 0].tolist())) == p.pairs and np.isin(pairs[:, 0], V.keys).all()
        for a in e.answer_starts:
            assert tok[a - 2] == M["query"] and tok[a - 1] in pairs[:, 0]
            given = 1 + 2 * int(np.flatnonzero(pairs[:, 0] == tok[a - 1])[0]) + 1  # the value in the pairs block
            assert tok[a] == tok[given] and a - given > p.gap
            assert _first_index(tok, tok[a - 1], a - 1) == given - 1  # the key appears nowhere in between
        assert np.array_equal(e.far_targets, e.answer_starts)


def test_needle_answers_are_the_needles_values_with_decoys_of_the_same_keys():
    p = PARAMS["needle_retrieval"]
    t = SyntheticTask(p)
    item = p.value_len + 2
    for i in range(50):
        e = t.episode(i, heldout_stream(4))
        tok = e.tokens
        q0 = 256 - 1 - p.needles * item
        needles = np.flatnonzero(tok[:q0] == M["needle"])
        decoys = np.flatnonzero(tok[:q0] == M["decoy"])
        assert needles.size == p.needles and decoys.size == p.distractors
        needle_keys = tok[needles + 1]
        assert sorted(tok[e.answer_starts - 1].tolist()) == sorted(needle_keys.tolist())  # every needle asked once
        assert (np.isin(tok[decoys + 1], needle_keys)).sum() >= p.distractors // 2  # confusable decoys
        for a in e.answer_starts:
            assert tok[a - 2] == M["query"]
            n = needles[np.flatnonzero(needle_keys == tok[a - 1])[0]]
            value = tok[n + 2:n + item]
            assert np.array_equal(tok[a:a + p.value_len], value) and a - (n + item) > p.gap
            for d in decoys[tok[decoys + 1] == tok[a - 1]]:  # a decoy of the same key holds another value
                assert not np.array_equal(tok[d + 2:d + item], value)
        assert e.far_targets.size == p.needles * p.value_len


def test_copy_answer_is_the_span_far_back():
    p = PARAMS["far_copy"]
    t = SyntheticTask(p)
    for i in range(50):
        e = t.episode(i, heldout_stream(5))
        tok = e.tokens
        (c,) = np.flatnonzero(tok == M["copy"])
        (a,) = e.answer_starts
        assert tok[a - 1] == M["paste"] and a + p.span == 255
        assert np.array_equal(tok[a:a + p.span], tok[c + 1:c + 1 + p.span]) and a - (c + 1) > p.gap
        assert np.array_equal(e.far_targets, np.arange(a, a + p.span))


@pytest.mark.parametrize("change,field", [
    (dict(task="sorting"), "task"), (dict(pairs=0), "pairs"), (dict(queries=13), "queries"),
    (dict(length=100), "length"), (dict(gap=0), "gap"), (dict(pairs=5000, queries=1, length=20000), "pairs"),
    (dict(pool=8), "pool"), (dict(pool=10 ** 6), "pool"), (dict(pool=-1), "pool"),
])
def test_params_that_cannot_work_name_the_field(change, field):
    from dataclasses import replace
    with pytest.raises(ParamError) as e:
        check_params(replace(PARAMS["associative_recall"], **change), V)
    assert e.value.field == field and str(e.value).startswith(f"{field}=")


@pytest.mark.parametrize("task", TASKS)
def test_a_pool_draws_keys_values_and_filler_from_its_first_words_and_names_itself(task):
    """pool=n: every key, value and filler token of every episode is one of the first n words of its pool (markers
    and EOS aside); pool=0 (the whole pools) keeps the fingerprint of a task without the parameter."""
    from dataclasses import replace
    n = 24
    pooled = SyntheticTask(replace(PARAMS[task], pool=n))
    allowed = set(V.keys[:n].tolist()) | set(V.values[:n].tolist())
    fillers = set(V.filler[:n].tolist())
    structure = set(V.markers.values()) | {V.eos}
    for i in range(6):
        e = pooled.episode(i, train_stream(0, "s"))
        answers = e.tokens[e.far_targets]
        assert set(answers.tolist()) <= allowed
        keys_and_values = np.isin(e.tokens, np.concatenate((V.keys, V.values)))
        assert set(e.tokens[keys_and_values].tolist()) <= allowed
        rest = set(e.tokens[~keys_and_values].tolist()) - structure
        assert rest and rest <= fillers
    whole = SyntheticTask(PARAMS[task])
    assert pooled.describe()["pool"] == n and "pool" not in whole.describe()
    assert SyntheticTask(replace(PARAMS[task], pool=0)).fingerprint == whole.fingerprint != pooled.fingerprint


@pytest.mark.parametrize("length", [64, 128])
def test_stream_rows_are_episodes_with_document_offsets(length):
    """Rows of 128 tokens from the stream (the loader's own row builder): whole episodes, a document each."""
    p = SyntheticParams("far_copy", length, 16, span=4)
    t = SyntheticTask(p)
    s = SyntheticStream(t, train_stream(0, "copy"))
    T = 128
    b = rows_batch(s, np.array([0, 1, 2]), T)
    per_row = T // length
    for r in range(3):
        want = np.concatenate([t.episode(r * per_row + k, s.stream).tokens for k in range(per_row)])
        assert np.array_equal(b.inputs[r].numpy(), want)
        assert b.labels[r, -1] == M["begin"]  # the last label: the next episode's first token
    assert b.cu_seqlens.tolist() == list(range(0, 3 * T + 1, length))
    assert np.array_equal(s.read(length - 3, 6), np.concatenate([t.episode(0, s.stream).tokens[-3:],
                                                                  t.episode(1, s.stream).tokens[:3]]))
