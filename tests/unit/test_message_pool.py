"""The async server's pooled message memory (mpitrain/train/asynchronous/pool.py): when it
pools, how its receive and reply pools lend, reuse, bound and lose buffers. Pure
bookkeeping, with a fake communicator whose sends complete when a test says so; the
pools under real MPI are in tests/mpi/test_async_protocol.py (pool_everything), their
memory against the number of workers in tests/e2e/test_server_memory.py."""

import numpy as np
import pytest

from mpitrain.errors import CommTimeout
from mpitrain.train.asynchronous import pool
from mpitrain.train.asynchronous.pool import Pools, ReceivePool, ReplyPool, pooled


class FakeSend:
    """A pending send that completes when ``done`` is set (by the test, or on the
    ``complete_after``-th test)."""

    def __init__(self, rank: int, complete_after=None):
        self.peer, self.done, self.failed = rank, False, False
        self.tests, self.complete_after = 0, complete_after

    def test(self) -> bool:
        self.tests += 1
        if self.complete_after is not None and self.tests >= self.complete_after:
            self.done = True
        return self.done


class FakeComm:
    """The two verbs a reply pool uses: ``isend`` (a FakeSend, recorded) and ``wait_any``
    (polls the sends until one completes, as Comm.wait_any does, bounded)."""

    def __init__(self, complete_after=None):
        self.sent, self.complete_after, self.waits = [], complete_after, 0

    def isend(self, buf, rank, tag, kind, what):
        send = FakeSend(rank, self.complete_after)
        self.sent.append((buf, rank, send))
        return send

    def wait_any(self, pendings, backoff=None, timeout=None):
        self.waits += 1
        for _ in range(100):
            for i, p in enumerate(pendings):
                if p is not None and p.test():
                    return i
        raise CommTimeout("no send completed")


def test_a_server_pools_once_every_workers_own_buffers_exceed_the_budget():
    budget = pool.RESIDENT_BUDGET
    lr = 8 + 7850  # LR's push and lease, float32
    assert not pooled(lr, lr, n_workers=64)  # 6 MB in all: each worker keeps its own
    alexnet = 8 + 61_100_840
    assert pooled(alexnet, alexnet, n_workers=1)  # one worker's three messages: 0.7 GB
    # the boundary: three messages a worker, summed over the workers
    per_worker = budget // 4 // 3
    assert not pooled(per_worker, per_worker, n_workers=1)
    assert pooled(per_worker, per_worker, n_workers=2)
    assert Pools.of(FakeComm(), lr, lr, 64) is None
    assert isinstance(Pools.of(FakeComm(), alexnet, alexnet, 2), Pools)


def test_the_receive_pool_lends_at_most_its_count_and_reuses_what_comes_back():
    made = []
    receives = ReceivePool(10, count=2, new=lambda n: made.append(n) or np.zeros(n, np.float32))
    a, b = receives.lend(), receives.lend()
    assert a is not None and b is not None and a is not b and made == [10, 10]
    assert receives.lend() is None  # both lent: the third push waits with its worker
    receives.give_back(a)
    assert receives.lend() is a and len(made) == 2  # reused, not made again


def test_a_receive_abandoned_with_a_lost_worker_takes_its_buffer_out_of_the_pool():
    receives = ReceivePool(4, count=1)
    lent = receives.lend()
    receives.lose(lent)  # MPI may still write into it: never lent again
    again = receives.lend()
    assert again is not None and again is not lent
    assert receives.lost == [lent] and receives.made == 1


def written(value):
    def write(buffer):
        buffer[:] = value
    return write


def test_replies_reuse_a_buffer_once_its_send_completed():
    comm = FakeComm()
    replies = ReplyPool(comm, 3, most=4)
    first = replies.send(1, "rank 1 to take its weights", written(1.0))
    first.done = True  # rank 1 took it
    replies.send(2, "rank 2 to take its weights", written(2.0))
    assert len(replies.buffers) == 1  # one buffer, reused
    assert comm.sent[0][0] is comm.sent[1][0] and (comm.sent[1][0] == 2.0).all()
    assert replies.to == [2]


def test_replies_in_flight_get_a_buffer_each_up_to_the_bound():
    comm = FakeComm()
    replies = ReplyPool(comm, 3, most=3)
    for rank in (1, 2, 3):
        replies.send(rank, "w", written(float(rank)))
    assert len(replies.buffers) == 3 and comm.waits == 0
    # each buffer holds its own reply while it is in flight
    assert [float(b[0]) for b in replies.buffers] == [1.0, 2.0, 3.0]


def test_with_every_buffer_in_flight_the_pool_waits_for_the_first_send_to_complete():
    comm = FakeComm()
    replies = ReplyPool(comm, 3, most=2)
    sends = [replies.send(rank, "w", written(float(rank))) for rank in (1, 2)]
    sends[1].complete_after = sends[1].tests + 3  # rank 2 takes its reply soon
    replies.send(3, "w", written(3.0))
    assert comm.waits == 1 and len(replies.buffers) == 2  # not a third buffer
    assert replies.to == [1, 3] and (replies.buffers[1] == 3.0).all()
    assert not sends[0].done  # (rank 1's buffer was never touched)
    assert (replies.buffers[0] == 1.0).all()


def test_a_reply_pool_that_nobody_empties_names_it_within_the_bound():
    replies = ReplyPool(FakeComm(), 3, most=2)
    for rank in (1, 2):
        replies.send(rank, "w", written(0.0))
    with pytest.raises(CommTimeout):
        replies.send(3, "w", written(0.0))


def test_a_reply_pool_holds_two_buffers_at_least_and_its_budget_at_most():
    comm = FakeComm()
    assert ReplyPool.of(comm, 1000, budget=0).most == 2
    assert ReplyPool.of(comm, 1000, budget=40_000).most == 10
    assert ReplyPool.of(comm, 1000, budget=40_003).most == 10


def test_a_lost_workers_pending_replies_leave_the_pool_and_others_are_kept():
    comm = FakeComm()
    replies = ReplyPool(comm, 3, most=3)
    lost = replies.send(1, "w", written(1.0))
    kept = replies.send(2, "w", written(2.0))
    taken = replies.send(1, "w", written(3.0))
    taken.done = True  # (its older reply; this one it took)
    assert replies.pending_to(1) == [lost] and replies.pending_to(2) == [kept]
    replies.forget(1)
    assert len(replies.buffers) == 2 and replies.to == [2, 1]
    assert len(replies.lost) == 1 and replies.lost[0][1] is lost  # (kept alive: MPI reads it)
    assert replies.pending_to(1) == []
    # the pool may make a replacement: the bound counts the buffers it still has
    replies.send(3, "w", written(0.0))
    replies.send(4, "w", written(0.0))
    assert len(replies.buffers) == 3


def test_a_send_mpi_says_failed_frees_its_place_at_once():
    comm = FakeComm()
    replies = ReplyPool(comm, 3, most=1)
    dead = replies.send(1, "w", written(1.0))
    dead.failed = True  # ULFM: its worker died; it never completes
    replies.send(2, "w", written(2.0))
    assert comm.waits == 0 and len(replies.buffers) == 1 and replies.to == [2]
    assert replies.lost[0][1] is dead
