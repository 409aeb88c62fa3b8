"""The background-prefetching step loader gives exactly the synchronous loader's batches, its state is the
consumed position (so resume stays bitwise exact), and loader errors reach the main thread unchanged."""
import time

import pytest
import torch

from data.format import DataError
from data.loader import IGNORE_INDEX, ShardDataset, TokenLoader
from data.prefetch import StepLoader
from test_data_fixtures import corpus_texts, write_jsonl
from test_data_fixtures import prepared_fixture  # noqa: F401 (the fixture `prepared`)

T, G, M = 16, 8, 2


def same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.labels, y.labels) and torch.equal(x.valid, y.valid)
        assert (x.cu_seqlens is None) == (y.cu_seqlens is None)
        if x.cu_seqlens is not None:
            assert torch.equal(x.cu_seqlens, y.cu_seqlens)


def loaders(path, world=2, rank=1, **kw):
    ds = ShardDataset(path)
    return TokenLoader(ds, T, G, M, rank, world, seed=5, **kw), TokenLoader(ds, T, G, M, rank, world, seed=5, **kw)


@pytest.mark.parametrize("document_mask", [True, False])
def test_prefetch_gives_the_synchronous_batches(prepared, document_mask):
    out, _ = prepared
    sync, inner = loaders(out, document_mask=document_mask)
    steps = 2 * sync.batches_per_epoch + 3  # across two epoch boundaries (a new permutation each)
    pre = StepLoader(inner, prefetch=True, depth=3)
    try:
        for b in range(steps):
            want = sync.next_step()
            got = pre.next_step()
            same_batches(got.micro_batches, want)
            assert inner.batches_consumed == sync.batches_consumed == b + 1
    finally:
        pre.close()


def test_target_tokens_is_the_sum_over_ranks_of_the_local_counts(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    ranks = [TokenLoader(ds, T, G, M, r, 4, seed=1) for r in range(4)]
    for b in range(3):
        data = [ld.step_data(b) for ld in ranks]
        local = sum(int((mb.labels != IGNORE_INDEX).sum()) for d in data for mb in d.micro_batches)
        assert {d.target_tokens for d in data} == {local} and local == G * T  # training windows are full
    # the same formula counts padding rows and short windows (eval ids) as the labels do
    ld = ranks[0]
    last_eval_window = -(-(ds.num_tokens - 1) // T) - 1  # may be cut by the end of the stream
    ids = torch.tensor([last_eval_window, -1, 0]).numpy()
    batch = ld._make_batch(ids)
    assert int(ld._valid_lengths(ids).sum()) == int((batch.labels != IGNORE_INDEX).sum())


def test_state_is_the_consumed_position_and_resume_is_exact(prepared):
    out, _ = prepared
    straight, inner = loaders(out)
    want = [straight.next_step() for _ in range(9)]
    pre = StepLoader(inner, prefetch=True, depth=3)
    try:
        for b in range(4):
            same_batches(pre.next_step().micro_batches, want[b])
        deadline = time.time() + 30
        while pre._queue.qsize() < 3 and time.time() < deadline:  # the thread is 3 steps ahead
            time.sleep(0.01)
        assert pre._queue.qsize() == 3
        state = pre.state_dict()
    finally:
        pre.close()
    assert state["batches_consumed"] == 4
    _, fresh = loaders(out)
    resumed = StepLoader(fresh, prefetch=True)
    try:
        resumed.load_state_dict(state)
        for b in range(4, 9):
            same_batches(resumed.next_step().micro_batches, want[b])
        resumed.load_state_dict({**state, "batches_consumed": 1})  # a reload mid-run restarts the thread there
        same_batches(resumed.next_step().micro_batches, want[1])
    finally:
        resumed.close()


def test_prefetch_off_is_inline(prepared):
    out, _ = prepared
    sync, inner = loaders(out)
    pre = StepLoader(inner, prefetch=False)
    for _ in range(3):
        same_batches(pre.next_step().micro_batches, sync.next_step())
    assert pre._thread is None


def test_loader_errors_reach_the_main_thread(tmp_path):
    from data.prepare import main as prepare_main
    src = write_jsonl(tmp_path / "a.jsonl", corpus_texts(3))
    assert prepare_main([str(src), "--out", str(tmp_path / "c"), "--val-fraction", "0"]) == 0
    ds = ShardDataset(tmp_path / "c")
    loader = TokenLoader(ds, seq_len=512, global_batch=64, micro_batch=8)  # more than the whole split
    pre = StepLoader(loader, prefetch=True)
    with pytest.raises(DataError, match="fewer than one global batch"):
        pre.next_step()
    assert loader.batches_consumed == 0 and pre._thread is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_batches_on_cuda(prepared):
    out, _ = prepared
    sync, inner = loaders(out)
    pre = StepLoader(inner, prefetch=True, pin_memory=True, device=torch.device("cuda"))
    try:
        got = pre.next_step().micro_batches
        assert all(mb.inputs.is_pinned() and mb.cu_seqlens.is_pinned() for mb in got)
        same_batches([mb.to("cuda") for mb in got], [mb.to("cuda") for mb in sync.next_step()])
    finally:
        pre.close()


def test_doc_buckets_pad_only_the_offsets(prepared):
    """doc_buckets (the trainer's setting under CUDA graphs): every micro-batch's document offsets padded to a
    power-of-two length with copies of the last offset; tokens, labels, validity and the loader's position as
    without it, and batches without documents inside their rows left as they are."""
    from data.loader import bucket_doc_offsets
    out, _ = prepared
    plain, inner = loaders(out, document_mask=True)
    bucketed = StepLoader(inner, prefetch=False, doc_buckets=True)
    padded = 0
    for _ in range(6):
        want, got = plain.next_step(), bucketed.next_step().micro_batches
        for x, y in zip(want, got):
            assert torch.equal(x.inputs, y.inputs) and torch.equal(x.labels, y.labels)
            assert torch.equal(x.valid, y.valid)
            n = x.cu_seqlens.shape[0]
            assert torch.equal(y.cu_seqlens[:n], x.cu_seqlens) and (y.cu_seqlens[n:] == M * T).all()
            size = y.cu_seqlens.shape[0]
            assert size == n if n == M + 1 else (size >= max(n, 16) and size & (size - 1) == 0)
            padded += size > n
    assert padded  # the corpus has documents shorter than a row
    assert inner.batches_consumed == plain.batches_consumed == 6
    rows = torch.tensor([0, T, 2 * T], dtype=torch.int32)  # documents never inside a row: plain rows
    assert bucket_doc_offsets(rows, rows=2) is rows
    exact = torch.arange(0, 16 * 4, 4, dtype=torch.int32)  # already a bucket's length
    assert bucket_doc_offsets(exact, rows=1) is exact
    assert bucket_doc_offsets(torch.arange(0, 17 * 4, 4, dtype=torch.int32), rows=1).shape == (32,)
