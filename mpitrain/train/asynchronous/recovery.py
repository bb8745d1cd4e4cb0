"""Lost workers: found, dropped and fenced, under ``mpirun --enable-recovery``.

Only there does a rank's death leave the others running; elsewhere mpirun ends the
job when a rank dies, and a silent worker is a CommTimeout naming it.

A lease holder whose process is gone (seen directly on the server's host) or that
stays silent past its liveness bound (:class:`..leases.Liveness`: 20x its usual
interval between lease and push, at least ``--liveness-floor``, at most
``--timeout``) is dropped: its pending receive is cancelled, it gets a FINAL|DROPPED
reply in case it comes back (it then exits with a message), and its remaining steps
are reassigned (:class:`..leases.Quotas`) to the workers still training, who run
extra passes over their own shards, so the run still makes its planned number of
updates; the lost worker's shard is not visited after its loss (recorded as
``lost_workers`` in runs.csv and status.json). A lost worker on the server's host
still alive FENCE_GRACE after it was dropped is killed (a SIGSTOPped one would keep
mpirun waiting); on another host it is named.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ...comm import PeerProcesses, recovery_enabled
from ..leases import Liveness

#: seconds between the server's checks of its silent workers
LIVENESS_CHECK_EVERY = 1.0
#: seconds a dropped worker on the server's host gets to come back and leave by itself
#: before the server kills it (a SIGSTOPped rank never woken would hold mpirun forever)
FENCE_GRACE = 5.0


@dataclass
class _Fence:
    """A dropped worker, until it is gone or killed."""

    at: float  # when the server kills it if it is still alive (its host only)
    dismissal: object = None  # the pending FINAL|DROPPED reply (its buffer kept with it)
    done: bool = False


class Recovery:
    """The server's watch over its lease holders, and what happens to those it loses.
    Disabled (every method a no-op, :meth:`lost` None) without ``--enable-recovery``
    or with one worker (no one would be left to take its steps)."""

    def __init__(self, ctx, clock, workers: int):
        self.ctx, self.comm, self.clock = ctx, ctx.comm, clock
        self.enabled = recovery_enabled() and workers > 1
        self.liveness = Liveness(self.comm.timeout, floor=ctx.cfg.liveness_floor)
        self.processes = PeerProcesses(self.comm) if self.enabled else None
        #: how long the server may wait for a push before it looks again (None: timeout)
        self.wake_every = LIVENESS_CHECK_EVERY if self.enabled else None
        self.next_check = 0.0
        self.fences: Dict[int, _Fence] = {}

    def due(self) -> bool:
        """Whether it is time to check the lease holders (once every
        LIVENESS_CHECK_EVERY, also while the others push: one silent worker among busy
        ones is the case)."""
        return self.enabled and time.monotonic() >= self.next_check

    def lost(self, silence, posted: Dict[int, object]) -> Optional[Tuple[int, str]]:
        """(rank, why) of the first lease holder of ``posted`` (rank -> its pending
        receive) to count as lost, if any (:meth:`due` says when to ask); fences the
        dropped workers whose grace is over."""
        self.next_check = time.monotonic() + LIVENESS_CHECK_EVERY
        self.fence()
        return silence.lost(posted, self.liveness, self.processes.alive)

    def drop(self, end) -> None:
        """Hang up on ``end``'s worker (its :class:`.mailbox.ServerEnd`) and fence it."""
        fence = self.fences[end.rank] = _Fence(time.monotonic() + FENCE_GRACE)
        fence.dismissal = end.hang_up(tell=self.processes.alive(end.rank))

    def record(self, rank: int, update: int, step: int, why: str, gained: Dict[int, int],
               short: int, active: int) -> None:
        """Note the loss of ``rank`` at ``update`` (its step ``step``) in the run's records
        and on the console: who took its steps (``gained``), or how short the run is."""
        ctx = self.ctx
        ctx.lost.append({"rank": rank, "host": self.comm.hosts[rank], "update": update,
                         "step": step, "wall_time_s": round(self.clock(), 3), "reason": why})
        moved = (f"its {sum(gained.values())} remaining steps go to "
                 + ", ".join(f"rank {r}" for r in gained) if gained else
                 f"{short} planned updates will not be made")
        going_on = (f"training continues with {active} worker(s)" if active else
                    "the other workers have finished")
        ctx.console.note(f"lost {self.comm.name(rank)} at update {update}: {why}; {moved}; "
                         + going_on)
        ctx.results.set_status("running", lost_workers=ctx.lost)

    def fence(self, at_end: bool = False) -> None:
        """Kill lost workers still alive on this host FENCE_GRACE seconds after they were
        dropped, or at the end (stopped ones would keep mpirun waiting for them
        forever); name those on other hosts."""
        now = time.monotonic()
        for rank, fence in self.fences.items():
            if fence.done or not (at_end or now >= fence.at):
                continue
            fence.done = True
            if not self.processes.alive(rank):
                continue
            name, pid = self.comm.name(rank), self.comm.pids[rank]
            if self.processes.kill(rank):
                self.ctx.console.note(f"killed lost {name} (pid {pid}): it was still alive "
                                      f"{FENCE_GRACE:g} s after it was dropped")
            else:
                self.ctx.console.note(f"lost {name} may still be alive (pid {pid} there): "
                                      f"if the job does not end, kill it")
