"""The order a streamed shard set is trained in (mpitrain/data/order.py): every example
at most once an epoch and all but N mod W exactly once, at 1 to 17 workers and files of
uneven sizes; the same ids on every call (a resumed run starts where it left off); and
resuming onto another number of workers repeats or leaves out less than one step."""

import numpy as np
import pytest

from mpitrain.data.order import Deal, EpochOrder, resume_overlap

UNEVEN = (1000, 3, 517, 0, 2048, 77, 1)  # one empty file, one of a single example


def epoch_ids(order: EpochOrder, deal: Deal, epoch: int):
    """{worker: [ids of each of its batches]} of one epoch."""
    return {w: [order.ids(epoch, *deal.positions(w, b)) for b in range(deal.batches)]
            for w in range(deal.workers)}


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("batch_size", [1, 32, 100])
def test_every_example_once_an_epoch_and_the_remainder_left_out(workers, batch_size):
    order = EpochOrder(UNEVEN, seed=5, window=700)
    n = order.size
    deal = Deal(n, workers, batch_size)
    ids = epoch_ids(order, deal, epoch=3)
    taken = np.concatenate([np.concatenate(b) for b in ids.values()])
    assert len(taken) == workers * (n // workers)  # N mod W left out
    assert len(np.unique(taken)) == len(taken)  # none twice
    assert taken.min() >= 0 and taken.max() < n
    for batches in ids.values():  # every worker: the same number of steps, as sync needs
        assert len(batches) == deal.batches == -(-(n // workers) // batch_size)
        assert sum(len(b) for b in batches) == n // workers
        assert all(len(b) == batch_size for b in batches[:-1])


def test_positions_tile_the_epoch_round_robin():
    deal = Deal(examples=1003, workers=3, batch_size=40)  # 334 each: 8 full batches + 14
    spans = sorted(deal.positions(w, b) for w in range(3) for b in range(deal.batches))
    assert spans[0][0] == 0 and spans[-1][1] == 1002
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gap, no overlap
    assert deal.positions(1, 0) == (40, 80) and deal.positions(0, 1) == (120, 160)
    assert deal.positions(2, 8) == (960 + 28, 960 + 42)
    with pytest.raises(IndexError):
        deal.positions(0, deal.batches)


def test_after_i_steps_the_examples_trained_on_are_a_prefix():
    """Whatever W: what every worker's first i batches took is the first i*W*B positions."""
    for workers in (1, 2, 5, 16):
        deal = Deal(5000, workers, 25)
        for i in (0, 1, 7, deal.batches - 1):
            taken = sorted(p for w in range(workers) for b in range(i)
                           for p in range(*deal.positions(w, b)))
            assert taken == list(range(i * workers * 25))


def test_ids_are_a_pure_function_of_seed_epoch_and_position():
    a, b = EpochOrder(UNEVEN, 9, 500), EpochOrder(UNEVEN, 9, 500)
    assert np.array_equal(a.ids(2, 100, 900), b.ids(2, 100, 900))
    # a run of positions read in pieces (a resumed run) gives the same ids as at once
    assert np.array_equal(a.ids(2, 0, 3000),
                          np.concatenate([a.ids(2, 0, 1234), a.ids(2, 1234, 3000)]))
    assert not np.array_equal(a.ids(2, 0, 3000), a.ids(3, 0, 3000))  # reshuffled an epoch
    assert not np.array_equal(a.ids(2, 0, 3000), EpochOrder(UNEVEN, 10, 500).ids(2, 0, 3000))


def test_the_shuffle_mixes_files_and_stays_within_windows():
    order = EpochOrder((100,) * 50, seed=1, window=1000)
    epoch = order.ids(0, 0, 5000)
    assert sorted(epoch.tolist()) == list(range(5000))
    files_of_first_window = np.unique(epoch[:1000] // 100)
    assert len(files_of_first_window) == 10  # a window: 10 whole files, in a shuffled order
    assert not np.array_equal(files_of_first_window, np.arange(10))
    first = epoch[:100] // 100
    assert len(np.unique(first)) > 5  # the first batch draws on many files


def test_locate_gives_file_and_row():
    order = EpochOrder((3, 0, 2, 4))
    files, rows = order.locate(np.arange(9))
    assert files.tolist() == [0, 0, 0, 2, 2, 3, 3, 3, 3]
    assert rows.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_a_resume_on_as_many_workers_is_exact():
    deal = Deal(10_000, 4, 32)
    assert resume_overlap(10_000, deal, 30, deal, 30) == {"repeated": 0, "left_out": 0}


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2), (4, 16), (16, 5), (1, 17)])
def test_a_resume_on_other_workers_repeats_or_skips_less_than_a_step(before, after):
    """The step is remapped to where as many examples were trained on (as remap_position
    does for sync); what is repeated is less than one step of the new workers."""
    n, batch = 20_000, 50
    old, new = Deal(n, before, batch), Deal(n, after, batch)
    for done in (1, old.batches // 3, old.batches - 1):
        resumed_at = done * before * batch // (after * batch)
        moved = resume_overlap(n, old, done, new, resumed_at)
        assert moved["repeated"] < after * batch and moved["left_out"] == 0, moved
