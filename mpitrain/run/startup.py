"""The job's start-up, begun again without a worker lost in it.

Async training under ``mpirun --enable-recovery`` goes on without a worker that dies
while it trains (:mod:`mpitrain.train.asynchronous.recovery`). Before its first push,
the job is still in its start-up: collectives over every rank (the data's shape, the
model, the results directory, the message memory), which a dead rank leaves incomplete.
From the moment the run's mode is known until the trainer has its mailboxes, a loss
there is survived as the async promise says: the ranks that go on agree on it with rank 0
and make a communicator of their own (:mod:`mpitrain.comm.regroup`), and the session
starts again in it, the run's configuration and directory kept, the worker recorded as
lost (``lost_workers`` in runs.csv and status.json). Where the run cannot go on (sync,
no recovery, rank 0 or a parameter server lost, no worker left) the loss ends the job,
named, as before.
"""

from __future__ import annotations

from typing import List, Optional

from ..comm import Comm, StartupWatch, go_on_without, recovery_enabled
from ..config import Config
from ..errors import MpitrainError, RanksLost
from ..train.asynchronous.recovery import lost_worker

#: the reason recorded for a worker lost during start-up (runs.csv's lost_workers)
REASON = "its process died while the job started"


class StartAgain(Exception):
    """Out of a start-up that lost workers the run goes on without: every rank that goes on
    starts again in ``comm``, keeping the ``lost`` records (rank 0's: dicts as in
    ``lost`` of :class:`mpitrain.train.Context`) and the run directory rank 0 opened, if any."""

    def __init__(self, comm: Comm, lost: List[dict], run_dir: Optional[str]):
        super().__init__("start again without a lost worker")
        self.comm, self.lost, self.run_dir = comm, lost, run_dir


class Startup:
    """One start-up attempt of the session on ``comm`` (``before``: the attempt that lost a
    worker, else None). Watches for losses it may survive from now on, until :meth:`end`.
    Collective: every rank makes it at the same point, with the same ``cfg``."""

    def __init__(self, cfg: Config, comm: Comm, before: Optional[StartAgain] = None):
        self.comm, self.servers = comm, cfg.asynchronous.servers
        self.lost: List[dict] = list(before.lost) if before else []
        self.run_dir: Optional[str] = before.run_dir if before else None
        survivable = cfg.async_mode and recovery_enabled() and comm.size > self.servers + 1
        self.watch: Optional[StartupWatch] = StartupWatch(comm) if survivable else None
        comm.startup_check = self.watch.check if self.watch else None

    def end(self) -> None:
        """The trainer has what it needs from the others: a loss is the trainer's now."""
        if self.watch is not None:
            self.comm.startup_check = None
            self.watch.close()
            self.watch = None

    def survive(self, error: MpitrainError) -> None:
        """Raise :class:`StartAgain` when ``error`` is a loss during this start-up that the
        run goes on without (agreed with the others: collective over the ranks not lost);
        else return, and the caller raises ``error`` as it would have. The next attempt
        keeps :attr:`run_dir`, the directory rank 0 opened (the session sets it)."""
        if self.watch is None or not isinstance(error, RanksLost):
            return
        watch, self.watch = self.watch, None
        comm = go_on_without(self.comm, watch, error, self.servers)
        if comm is None:
            return
        old = self.comm
        going_on = set(comm.world_ranks)
        lost = [lost_worker(world, old.hosts[r], old.pids[r], REASON)
                for r, world in enumerate(old.world_ranks) if world not in going_on]
        raise StartAgain(comm, self.lost + lost, self.run_dir)

    def note(self) -> str:
        """The console's line about the workers lost so far at start-up ('' if none)."""
        if not self.lost:
            return ""
        names = ", ".join(f"rank {w['rank']} on {w['host']}" for w in self.lost)
        workers = self.comm.size - self.servers
        return (f"lost {names}: {REASON}; the job started again without it, on "
                f"{self.comm.size} rank(s) ({workers} worker(s))")
