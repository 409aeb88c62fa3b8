"""Work balancing of data-parallel ranks: the rows' work is their documents' causal attention, the assignment
deals every row once with equal counts per rank (optimal for two rows a rank), and a balanced loader (plain and
mixture) gives the ranks the same global batch as slices do, with the heaviest rank's work no larger."""
import itertools

import numpy as np
import pytest

from data.balance import assign_rows, rank_rows, row_work, segment_work
from data.loader import ShardDataset, TokenLoader, rows_batch
from test_data_fixtures import prepared_fixture  # noqa: F401 (the fixture `prepared`)
from test_data_loader import rows_with_boundaries
from test_data_mix import sources
from data.mix import MixLoader

T = 32


def test_segment_work_is_causal_pairs_inside_segments():
    assert segment_work(np.array([0, 32])) == 32 * 33 / 2
    assert segment_work(np.array([0, 1, 5, 32])) == 1 + 4 * 5 / 2 + 27 * 28 / 2


@pytest.mark.parametrize("G,world", [(8, 2), (8, 4), (12, 3), (16, 8), (7, 1)])
def test_every_row_once_with_equal_counts_and_the_same_answer_twice(G, world):
    work = np.random.default_rng(G * world).random(G) ** 3
    rows = assign_rows(work, world)
    assert rows.shape == (world, G // world)
    assert sorted(rows.flatten().tolist()) == list(range(G))
    assert (np.diff(rows, axis=1) > 0).all()  # ascending within a rank
    assert np.array_equal(assign_rows(work.copy(), world), rows)
    assert all(np.array_equal(rank_rows(G, r, world, work), rows[r]) for r in range(world))
    assert rank_rows(G, 1, world).tolist() == list(range(G // world, 2 * G // world)) if world > 1 else True


def _best_max_load(work, world):
    """Brute force: the least possible heaviest rank over every way to deal the rows in equal counts."""
    G, per = len(work), len(work) // world
    best = np.inf

    def deal(left, loads):
        nonlocal best
        if not left:
            best = min(best, max(loads))
            return
        first = left[0]  # the first remaining row opens the next rank (ranks are interchangeable)
        for rest in itertools.combinations(left[1:], per - 1):
            group = (first, *rest)
            deal([i for i in left if i not in group], loads + [work[list(group)].sum()])
    deal(list(range(G)), [])
    return best


@pytest.mark.parametrize("seed", range(20))
def test_two_rows_a_rank_is_optimal_and_never_worse_than_slices(seed):
    rng = np.random.default_rng(seed)
    work = rng.random(8) ** 4 * 100
    rows = assign_rows(work, 4)
    heaviest = work[rows].sum(1).max()
    assert heaviest == pytest.approx(_best_max_load(work, 4))
    assert heaviest <= work.reshape(4, 2).sum(1).max() + 1e-12


def test_uneven_work_is_dealt_to_equal_loads():
    work = np.array([8.0, 1, 1, 8, 5, 5, 2, 2])
    rows = assign_rows(work, 2)
    assert work[rows].sum(1).tolist() == [16.0, 16.0]
    with pytest.raises(ValueError, match="8 rows does not split over 3 ranks"):
        assign_rows(work, 3)


def test_row_work_matches_the_batch_document_offsets(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    for inst in range(0, 40, 3):
        cu = rows_batch(ds, np.array([inst]), T).cu_seqlens.numpy()
        assert row_work(ds, inst, T, T) == segment_work(cu)
    assert row_work(ds, -1, T, 0) == 0.0


def _work_of(batches, ds_work):
    return sum(ds_work(tuple(b.inputs[r].tolist())) for b in batches for r in range(b.inputs.shape[0]))


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_ranks_hold_the_global_batch_and_wait_less(prepared, world):
    out, _ = prepared
    ds = ShardDataset(out)
    single = TokenLoader(ds, T, global_batch=8, micro_batch=2, seed=7)
    ranks = [TokenLoader(ds, T, 8, 8 // world // 2 or 1, dp_rank=r, dp_world=world, seed=7, balance=True)
             for r in range(world)]
    slices = [TokenLoader(ds, T, 8, 8 // world // 2 or 1, dp_rank=r, dp_world=world, seed=7) for r in range(world)]
    worse = better = 0
    for b in range(single.batches_per_epoch):
        want = single.step_data(b)
        got = [r.step_data(b) for r in ranks]
        assert sorted(row for g in got for row in rows_with_boundaries(g.micro_batches, T)) == \
            sorted(rows_with_boundaries(want.micro_batches, T))
        assert all(g.target_tokens == want.target_tokens for g in got)
        assert len({sum(m.inputs.shape[0] for m in g.micro_batches) for g in got}) == 1

        def heaviest(loaders):
            return max(sum(segment_work(m.cu_seqlens.numpy()) for m in ld.step_data(b).micro_batches)
                       for ld in loaders)
        balanced, sliced = heaviest(ranks), heaviest(slices)
        worse += balanced > sliced
        better += balanced < sliced
    assert worse == 0 and better > 0


def test_balancing_is_off_for_one_rank_and_without_document_masks(prepared):
    out, _ = prepared
    ds = ShardDataset(out)
    assert not TokenLoader(ds, T, 8, 4, seed=7, balance=True).balance
    assert not TokenLoader(ds, T, 8, 4, dp_world=2, seed=7, document_mask=False, balance=True).balance
    assert TokenLoader(ds, T, 8, 4, dp_world=2, seed=7, balance=True).balance


def test_a_balanced_mixture_holds_the_global_batch(prepared):
    out, _ = prepared
    single = MixLoader(sources(out), T, 8, 2, seed=11)
    ranks = [MixLoader(sources(out), T, 8, 1, r, 4, seed=11, balance=True) for r in range(4)]
    moved = False
    for b in range(12):
        want = rows_with_boundaries(single.step_data(b).micro_batches, T)
        got = [row for r in ranks for row in rows_with_boundaries(r.step_data(b).micro_batches, T)]
        assert sorted(got) == sorted(want)
        moved |= got != want
    assert moved  # the synthetic rows' short episodes and the text rows' documents differ in work
