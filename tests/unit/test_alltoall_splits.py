"""mpitrain.horovod's alltoall: the rows each rank is sent, and the splits refused (pure
logic; the exchange itself is checked under mpirun in tests/mpi/test_horovod_api.py)."""

import numpy as np
import pytest

from mpitrain.horovod.collectives import alltoall_splits


def test_without_splits_every_rank_gets_as_many_rows():
    assert alltoall_splits((6, 2), None, 3).tolist() == [2, 2, 2]
    assert alltoall_splits((0,), None, 4).tolist() == [0, 0, 0, 0]


def test_given_splits_may_leave_rows_unsent_but_not_ask_for_more():
    assert alltoall_splits((5,), np.array([1, 3], np.int32), 2).tolist() == [1, 3]
    assert alltoall_splits((5,), [0, 5], 2).dtype == np.int64


@pytest.mark.parametrize("shape, splits, size, says", [
    ((), None, 2, "at least one dimension"),
    ((7, 3), None, 2, "the first dimension is 7"),
    ((4,), [1, 1, 1], 2, "must be 2 counts"),
    ((4,), [5, -1], 2, "none negative"),
    ((4,), [3, 2], 2, "at most the first dimension (4)"),
])
def test_splits_that_cannot_be_are_refused(shape, splits, size, says):
    with pytest.raises(ValueError) as raised:
        alltoall_splits(shape, splits, size)
    assert says in str(raised.value)
