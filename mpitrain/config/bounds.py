"""Every wait of a run derived from ``--timeout``, and the one rule that orders them.

The rule: **the rank that can name the culprit gives up first.** Rank 0 hears from
every rank, so its bound on any one peer (``peer``: ``--timeout``, the world
communicator's timeout) is the shortest wait on a peer, and every wait of a worker on
other ranks outlasts it: the workers' own communicator (``workers``: the sync
allreduce, and Horovod's stall shutdown, which stands in for it; a share-server's wait
on its workers under ``--servers K`` too) and an async worker's
wait for the server's reply (``reply``). So a rank that stalls or dies is reported by
rank 0, which names it, instead of by a worker that could only say it was left
waiting. Around those: rank 0 counts a silent worker as lost at its liveness bound,
at most ``peer`` (:class:`mpitrain.train.leases.Liveness`); a parked async worker hears
from the server again well within its ``reply`` bound (``keepalive``); a thread that
makes several bounded calls is watched for longer than all of them together
(``bucket_thread``); ``mpitrain check``'s whole job gets its start and one ``peer``
wait (``check_job``). In order::

    liveness <= peer < workers < bucket_thread(n)
    keepalive < peer < reply
    horovod_stall_check == peer < horovod_stall_shutdown == workers
    start, peer < check_job

(``tests/unit/test_config.py`` holds every bound to it). The constants stand for what
MPI and Python need beyond the bounded waits (a thread's start, a context switch on a
loaded host), not for measurements. A leaf: the communication package imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: how much longer than rank 0 the workers wait for each other: a multiple, so that the
#: margin grows with the bound, and a constant, for the smallest bounds
WORKERS_FACTOR, WORKERS_MARGIN = 1.5, 2.0
#: what a thread that makes bounded calls is given beyond their bounds together
THREAD_SLACK = 10.0


@dataclass(frozen=True)
class Bounds:
    """The waits of a run, in seconds, from ``peer`` (``--timeout``) and ``start``
    (``--start-timeout``)."""

    peer: float
    start: float = 120.0

    @property
    def workers(self) -> float:
        """A worker's wait on the other workers (their communicator's bound)."""
        return WORKERS_FACTOR * self.peer + WORKERS_MARGIN

    @property
    def reply(self) -> float:
        """An async worker's wait for the server's reply to its push."""
        return 2.0 * self.peer

    @property
    def keepalive(self) -> float:
        """How often the async server answers a parked worker again (see
        :mod:`mpitrain.train.asynchronous.recovery`)."""
        return self.peer / 2.0

    def bucket_thread(self, buckets: int) -> float:
        """The watch on a thread that makes ``buckets`` allreduces of the workers'
        bound, and one more (the overlapped sync exchange's)."""
        return self.workers * (buckets + 1) + THREAD_SLACK

    @property
    def horovod_stall_check(self) -> float:
        """When Horovod warns of a rank that has not joined a collective."""
        return self.peer

    @property
    def horovod_stall_shutdown(self) -> float:
        """When Horovod gives up on it: the workers' bound, which it stands in for."""
        return self.workers

    @property
    def check_job(self) -> float:
        """``mpitrain check``'s whole job: its ranks' start and one wait on a peer."""
        return self.start + self.peer
