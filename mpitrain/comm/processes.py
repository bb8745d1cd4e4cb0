"""The processes of other ranks on this rank's host, seen directly (psutil handles, which
notice pid reuse): whether one is alive, and killing one. Ranks on other hosts can only
be judged by their silence.

Under ``mpirun --enable-recovery`` a dead rank does not end the job: the async server
drops a dead worker on its host as soon as its process is gone, and a worker on the
server's host stops as soon as the server's process is gone (:meth:`PeerProcesses.watch`)
instead of waiting out its reply bound (twice ``--timeout``: ten minutes by default).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ..errors import CommTimeout, RanksLost
from .pending import FAILED_RANKS, Pending

#: seconds to wait for a killed rank to be reaped, then for its death to reach mpirun
REAP_WAIT, REAP_SETTLE = 10.0, 1.0


class PeerProcesses:
    """The processes of ``ranks`` (default: every other rank) that run on this host."""

    def __init__(self, comm, ranks: Optional[Iterable[int]] = None):
        import psutil

        self._psutil, self._comm = psutil, comm
        self.local: Dict[int, Any] = {}  # psutil.Process by rank
        self.missing: List[int] = []  # ranks on this host with no process left to see
        wanted = range(comm.size) if ranks is None else ranks
        for rank in wanted:
            if rank != comm.rank and comm.hosts[rank] == comm.host:
                try:
                    self.local[rank] = psutil.Process(comm.pids[rank])
                except psutil.Error:
                    self.missing.append(rank)

    def alive(self, rank: int) -> bool:
        """False when MPI reported ``rank`` dead (ULFM, on any host), or when it is on this
        host and its process is gone or a zombie."""
        if self._comm.world_ranks[rank] in FAILED_RANKS:
            return False
        proc = self.local.get(rank)
        if proc is None:
            return True
        try:
            return proc.is_running() and proc.status() != self._psutil.STATUS_ZOMBIE
        except self._psutil.Error:
            return False

    def gone(self) -> List[int]:
        """The ranks on this host whose process has exited (or had, when this was made)."""
        return sorted(self.missing + [r for r in self.local if not self.alive(r)])

    def stopped(self, rank: int) -> bool:
        """Whether ``rank`` is a process on this host that is stopped (SIGSTOP, SIGTSTP or
        a debugger): it runs none of its own bounded waits until it is continued."""
        proc = self.local.get(rank)
        if proc is None:
            return False
        try:
            return proc.status() in (self._psutil.STATUS_STOPPED,
                                     self._psutil.STATUS_TRACING_STOP)
        except self._psutil.Error:
            return False

    def kill(self, rank: int) -> bool:
        """SIGKILL ``rank`` if it is a live process on this host and wait (bounded) until
        its parent, Open MPI's daemon, has reaped it; True if it was alive.

        Waiting matters: a rank that dies while the survivors enter MPI_Finalize's
        fence, before the daemon has noticed, can leave that fence waiting for it
        (seen once in three runs with the kill right before the end)."""
        if rank not in self.local or not self.alive(rank):
            return False
        try:
            self.local[rank].kill()
            self.local[rank].wait(timeout=REAP_WAIT)
        except self._psutil.TimeoutExpired:
            pass
        except self._psutil.Error:
            return False
        time.sleep(REAP_SETTLE)  # for the daemon to tell mpirun
        return True

    def watch(self, rank: int, role: str) -> Optional[Callable[[], None]]:
        """A check for :attr:`Comm.while_waiting` (called about once a second while this
        rank waits) that raises :class:`CommTimeout` once ``rank``'s process is gone;
        None when ``rank`` is not on this host (nothing to see)."""
        if rank not in self.local:
            return None
        comm = self._comm

        def check() -> None:
            if not self.alive(rank):
                raise CommTimeout(
                    f"{comm.name(comm.rank)} stops: {role}, {comm.name(rank)} (pid "
                    f"{comm.pids[rank]}), has died (mpitrain launch restarts the run from "
                    "its last checkpoint; by hand: mpitrain ... --resume RUN_DIR)")
        return check


#: seconds between two looks at whether the ranks on this host still run, in a collective
LOOK_EVERY = 1.0


def settles(pendings: Sequence[Pending], seconds: float = 0.5) -> bool:
    """True if every one of ``pendings`` completes within ``seconds`` of tests (each
    drives MPI's progress engine)."""
    deadline = time.monotonic() + seconds
    while not all(p.test() for p in pendings):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def rank_exited(pending: Pending, gone: Sequence[int], comm) -> RanksLost:
    """The error of a collective that ranks on this host (``gone``, ranks of ``comm``)
    left by exiting."""
    who = ", ".join(f"{comm.name(r)} (pid {comm.pids[r]})" for r in gone)
    return RanksLost(f"{comm.name(comm.rank)} stops: {who} exited while the job waited for "
                     f"{pending.what} (a rank was killed or crashed: see its output above)",
                     lost=gone)
