"""A worker lost while the job starts, survived: the ranks that go on agree with rank 0 on
who is gone and start again in a communicator of their own.

Where a run can go on without a worker (async training under ``--enable-recovery``),
a worker that dies during start-up leaves every other rank waiting in a collective
that cannot complete. Each rank notices what it can see: the ranks on its host whose
process has gone (every collective wait looks once a second) and the ranks MPI reported
dead (ULFM). Then:

1. A rank that noticed a loss tells rank 0 (a *report*: the ranks it saw lost).
2. Rank 0, once it noticed one or got a report, waits :data:`SETTLE` seconds for more
   reports and deaths, then decides: every rank not lost goes on, if rank 0 and a
   worker are among them and no parameter server is lost; else none does. It sends the
   *decision* to every rank not lost.
3. The ranks that go on make a communicator of their own, ``MPI_Comm_create_group``
   (collective over them alone: the dead take no part), and start again in it.

Every wait of the start-up also listens for rank 0's decision (:class:`StartupWatch`),
so a rank that could see nothing (the loss was on another host) hears of it there.
Under ULFM (Open MPI 5's ``--with-ft ulfm``) MPI agrees itself: the rank that noticed
revokes the communicator, which ends every rank's pending operation on it, and the
ranks alive shrink it (MPIX_Comm_revoke, MPIX_Comm_shrink).

The collective left incomplete on the old communicator is abandoned, never completed:
the new one has a context of its own, so nothing of the old one matches it.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import numpy as np

from ..errors import RanksLost
from .communicator import Comm
from .pending import FAILED_RANKS, Pending, note_process_failure
from .processes import PeerProcesses
from .runtime import _load_mpi, ulfm
from .waiting import IDLE, blocking_call_bound

#: tags of a rank's report of a loss to rank 0, of rank 0's decision, of the new group
TAG_LOSS, TAG_DECISION, TAG_REGROUP = 90, 91, 92
#: seconds rank 0 waits after the first loss it knows of for the other ranks' reports
SETTLE = 2.0


class StartupWatch:
    """While the job starts, on every rank of ``comm``: rank 0 listens for a report of a
    loss, every other rank for rank 0's decision. :meth:`check`, which every wait of the
    communicator calls, raises :class:`RanksLost` when one came. Local."""

    def __init__(self, comm):
        self.comm = comm
        self._message = np.full(comm.size + 1, -1, np.int64)  # ranks, -1 after the last
        self.pending: Optional[Pending] = None
        self._listen()

    def _listen(self) -> None:
        # (rank 0's decision is awaited as a point-to-point wait: from rank 0, not from
        # every rank, so the loss that caused it is not raised again while waiting)
        source, tag, what, peer = ((_load_mpi().ANY_SOURCE, TAG_LOSS, "a report of a lost rank",
                                    None) if self.comm.rank == 0 else
                                   (0, TAG_DECISION, "rank 0's decision", 0))
        self._message.fill(-1)
        self.pending = Pending(self.comm.mpi4py_comm.Irecv(self._message, source=source,
                                                           tag=tag), what, peer, "control")

    def ranks(self) -> List[int]:
        return [int(r) for r in self._message if r >= 0]

    def check(self) -> None:
        if self.pending is None or not self.pending.test():
            return
        ranks, me = self.ranks(), self.comm.name(self.comm.rank)
        if self.comm.rank == 0:
            self._listen()  # (more reports may come: taken while rank 0 settles)
            raise RanksLost(f"{me} stops: {self._names(ranks)} lost while the job started",
                            lost=ranks)
        self.pending = None
        raise RanksLost(f"{me} stops: rank 0 ended the start-up after a loss", decided=ranks)

    def _names(self, ranks: Sequence[int]) -> str:
        return ", ".join(self.comm.name(r) for r in ranks) or "a rank"

    def close(self) -> None:
        """The start-up is over (or given up): stop listening."""
        self.comm.cancel(self.pending)
        self.pending = None


def go_on_without(comm, watch: StartupWatch, lost: RanksLost, servers: int):
    """The communicator of the ranks that go on after ``lost`` (a new :class:`Comm`), or
    None when the run cannot go on without them: rank 0 or a parameter server (ranks
    below ``servers``) lost, or no worker left; then every rank raises its own error as
    it would have. Collective over the ranks not lost (see the module's steps)."""
    comm.startup_check = None  # (the waits below must not raise what they wait for)
    if ulfm():
        watch.pending = None  # (revoked with the communicator: nothing to cancel)
        mpi_comm, going_on = _shrunk(comm)
        if not survivable(going_on, servers):
            return None
    else:
        try:
            if comm.rank == 0:
                going_on = _decide(comm, watch, set(lost.lost), servers)
            else:
                going_on = lost.decided if lost.decided is not None else _ask(comm, watch, lost)
        finally:
            watch.close()
        if comm.rank not in going_on:
            return None
        mpi_comm = _created(comm, going_on)
    return Comm.over(mpi_comm, [comm.world_ranks[r] for r in going_on], comm.timeout,
                     comm.allreduce_wait, comm.traffic)


def survivable(going_on: Sequence[int], servers: int) -> bool:
    """Whether a run whose ranks 0..``servers``-1 are its parameter servers can go on with
    the ranks ``going_on``: every server among them and a worker."""
    return all(r in going_on for r in range(servers)) and any(r >= servers for r in going_on)


def _shrunk(comm):
    """ULFM's agreement: the communicator revoked (every rank's pending operation on it
    fails at once, also where no loss was seen), then MPIX_Comm_shrink, collective over
    the ranks alive (whom it agrees on itself): (the new communicator, its ranks in
    ``comm``). (Its point-to-point messages after a loss were not reliable enough to
    carry rank 0's decision there, and its communicator creation fails on a
    communicator with a dead rank.)"""
    c, MPI = comm.mpi4py_comm, _load_mpi()
    with blocking_call_bound(comm.timeout, "the ranks that go on after a loss "
                             "(MPIX_Comm_shrink)", comm.name(comm.rank)):
        try:
            c.Revoke()
        except MPI.Exception:
            pass  # (revoked already by another rank)
        note_process_failure()
        made = c.Shrink()
    members = MPI.Group.Translate_ranks(made.Get_group(), list(range(made.Get_size())),
                                        c.Get_group())
    return made, [int(r) for r in members]


def _created(comm, going_on: List[int]):
    """MPI_Comm_create_group of ``going_on`` (ranks of ``comm``; collective over them
    alone), bounded."""
    c = comm.mpi4py_comm
    group = c.Get_group().Incl(going_on)
    try:
        with blocking_call_bound(comm.timeout, "the ranks that go on after a loss "
                                 "(MPI_Comm_create_group)", comm.name(comm.rank)):
            return c.Create_group(group, tag=TAG_REGROUP)
    finally:
        group.Free()


def _decide(comm, watch: StartupWatch, lost: set, servers: int) -> List[int]:
    """Rank 0: every rank lost that it hears of or sees within SETTLE seconds, then the
    decision, sent to every rank not lost."""
    peers = PeerProcesses(comm)
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        if watch.pending is not None and watch.pending.test():
            lost.update(watch.ranks())
            watch._listen()
        lost.update(peers.gone())
        lost.update(r for r, world in enumerate(comm.world_ranks) if world in FAILED_RANKS)
        time.sleep(0.05)
    left = [r for r in range(comm.size) if r not in lost]
    if not survivable(left, servers):
        left = []
    decision = np.full(comm.size + 1, -1, np.int64)
    decision[:len(left)] = left
    comm.wait_all([comm.isend(decision, r, TAG_DECISION, "control", f"{comm.name(r)} to take "
                              "rank 0's decision") for r in range(1, comm.size) if r not in lost],
                  IDLE)
    return left


def _ask(comm, watch: StartupWatch, lost: RanksLost) -> List[int]:
    """A rank that saw the loss itself: its report to rank 0, then rank 0's decision."""
    report = np.full(comm.size + 1, -1, np.int64)
    report[:len(lost.lost)] = lost.lost
    comm.wait(comm.isend(report, 0, TAG_LOSS, "control", "rank 0 to take a report of a loss"),
              IDLE)
    comm.wait(watch.pending, IDLE)
    return watch.ranks()
