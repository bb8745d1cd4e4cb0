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

A worker that finishes its steps while others still train is *parked* (PARKED, in
the states of :mod:`.worker_states`): its FINAL push is answered with PARKED (a
header alone) and again every half ``--timeout`` (it waits for the server's word
twice that long), so it stays, idle, until the run ends (a FINAL reply) or a worker
is lost: then it takes a share of the lost steps (it is recalled: its reply is a
lease carrying them). So a loss after the others finished their
shards still ends with the planned updates. A run that ends short anyway (nobody
was left to take the steps) fails with a line saying by how much. No liveness check
covers a parked worker (it holds no lease): one stopped (SIGSTOP) on the server's
host as the run ends, and still stopped FENCE_GRACE later, is counted lost and
killed, since it could neither take its last reply nor leave.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ...comm import PeerProcesses, Pending, recovery_enabled
from ...errors import MpitrainError
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
    #: the pending FINAL|DROPPED reply (its buffer kept with it)
    dismissal: Optional[Pending] = None
    done: bool = False
    #: why it is killed then, for the console
    why: str = f"it was still alive {FENCE_GRACE:g} s after it was dropped"


class Recovery:
    """The server's watch over its lease holders, and what happens to those it loses.
    Disabled (every method a no-op, :meth:`lost` None) without ``--enable-recovery``
    or with one worker (no one would be left to take its steps)."""

    def __init__(self, ctx, clock, n_workers: int):
        self.ctx, self.comm, self.clock = ctx, ctx.comm, clock
        self.enabled = recovery_enabled() and n_workers > 1
        self.liveness = Liveness(self.comm.timeout, floor=ctx.cfg.faults.liveness_floor)
        self.processes = PeerProcesses(self.comm) if self.enabled else None
        #: how long the server may wait for a push before it looks again (None: timeout)
        self.wake_every = LIVENESS_CHECK_EVERY if self.enabled else None
        self.next_check = 0.0
        self.fences: Dict[int, _Fence] = {}
        #: parked workers -> when their next PARKED reply is due (when to speak to them;
        #: who is parked is the server's .worker_states.WorkerStates, moved with these)
        self.parked: Dict[int, float] = {}
        self.keepalive_every = self.comm.bounds.keepalive

    def _processes(self) -> PeerProcesses:
        """The workers' processes, watched only when :attr:`enabled`: what asks for them
        runs only then (a drop follows a loss :meth:`lost` found, a fence a drop)."""
        assert self.processes is not None, "recovery is not enabled"
        return self.processes

    def due(self) -> bool:
        """Whether it is time to check the lease holders (once every
        LIVENESS_CHECK_EVERY, also while the others push: one silent worker among busy
        ones is the case); ask only if :attr:`enabled`."""
        return time.monotonic() >= self.next_check

    def lost(self, silence, posted: Dict[int, object]) -> Optional[Tuple[int, str]]:
        """(rank, why) of the first lease holder of ``posted`` (rank -> its pending
        receive) to count as lost, if any (:meth:`due` says when to ask); fences the
        dropped workers whose grace is over."""
        self.next_check = time.monotonic() + LIVENESS_CHECK_EVERY
        self.fence()
        return silence.lost(posted, self.liveness, self._processes().alive)

    def drop(self, end, why_kill: Optional[str] = None) -> None:
        """Hang up on ``end``'s worker (its :class:`.mailbox.ServerEnd`) and fence it
        (``why_kill``: what the console says if it is killed)."""
        fence = self.fences[end.rank] = _Fence(time.monotonic() + FENCE_GRACE)
        if why_kill:
            fence.why = why_kill
        fence.dismissal = end.hang_up(tell=self._processes().alive(end.rank))

    def park(self, rank: int) -> None:
        """``rank`` finished its steps while others train (it was sent PARKED)."""
        self.parked[rank] = time.monotonic() + self.keepalive_every

    def keepalives(self) -> List[int]:
        """The parked workers due for another PARKED reply now."""
        now = time.monotonic()
        due = [rank for rank, at in self.parked.items() if now >= at]
        for rank in due:
            self.parked[rank] = now + self.keepalive_every
        return due

    def unpark(self, rank: int) -> bool:
        """Take ``rank`` back to train (given a lost worker's steps); False if it was not
        parked."""
        return self.parked.pop(rank, None) is not None

    def release(self) -> List[int]:
        """Every parked worker, no longer parked: the run is over."""
        ranks, self.parked = list(self.parked), {}
        return ranks

    def stopped_at_end(self, ranks) -> List[Tuple[int, str]]:
        """(rank, why) of the workers of ``ranks`` on this host that are stopped (SIGSTOP)
        as the run ends and still are FENCE_GRACE later. Every wait of a running worker
        is bounded, but a stopped one can neither take its last reply nor leave: it
        would keep mpirun (and the telemetry's gather) waiting for ever. Waits only
        when one is stopped."""
        processes = self.processes
        if processes is None:  # (not enabled)
            return []
        stopped = [rank for rank in ranks if processes.stopped(rank)]
        deadline = time.monotonic() + FENCE_GRACE
        while stopped and time.monotonic() < deadline:
            time.sleep(0.2)
            stopped = [rank for rank in stopped if processes.stopped(rank)]
        return [(rank, f"stopped as the run ended, still stopped {FENCE_GRACE:g} s later")
                for rank in stopped]

    def record(self, rank: int, update: int, step: int, why: str, gained: Dict[int, int],
               short: int, active: int, woken: int) -> None:
        """Note the loss of ``rank`` at ``update`` (its step ``step``) in the run's records
        and on the console: who took its steps (``gained``; ``woken`` of the ``active``
        workers were parked), or how short the run is."""
        ctx = self.ctx
        ctx.lost.append(lost_worker(rank, self.comm.hosts[rank], self.comm.pids[rank], why,
                                    update, step, round(self.clock(), 3)))
        moved = (f"its {sum(gained.values())} remaining steps go to "
                 + ", ".join(f"rank {r}" for r in gained) if gained else
                 f"{short} planned updates will not be made" if short else
                 "it had made its steps")
        going_on = (f"training continues with {active} worker(s)" if active else
                    "the other workers have finished")
        if woken:
            going_on += f" ({woken} of them had finished their own steps and waited)"
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
            processes = self._processes()
            if not processes.alive(rank):
                continue
            name, pid = self.comm.name(rank), self.comm.pids[rank]
            if processes.kill(rank):
                self.ctx.console.note(f"killed lost {name} (pid {pid}): {fence.why}")
            else:
                self.ctx.console.note(f"lost {name} may still be alive (pid {pid} there): "
                                      f"if the job does not end, kill it")


def lost_worker(rank: int, host: str, pid: int, reason: str, update: int = 0, step: int = 0,
                wall_time_s: float = 0.0) -> dict:
    """A lost worker's record (:attr:`Context.lost`, status.json's and a checkpoint's
    ``lost_workers``): lost at ``update`` of the server, its step ``step``."""
    return {"rank": rank, "host": host, "update": update, "step": step,
            "wall_time_s": wall_time_s, "reason": reason, "pid": pid}


def lost_in_this_job(lost: List[dict], pids: Sequence[int]) -> List[int]:
    """The ranks of ``lost`` (a run's lost workers, those of its earlier sessions too:
    ``Context.lost``) that were lost in this job: whose process (``pid``) is this job's
    at that rank. A resumed run's ranks are new processes, and a rank lost in an earlier
    session is a live worker now, whose part of the telemetry must be gathered (skipped
    like a lost one, it was missing, and its report was left unreceived)."""
    return [w["rank"] for w in lost
            if w["rank"] < len(pids) and w.get("pid") == pids[w["rank"]]]


def short_of_plan(short: int, lost: List[dict], summary) -> MpitrainError:
    """The server's error when ``short`` planned updates were never made: the steps of
    the ``lost`` workers found no worker left to take them. Only the server knows."""
    names = ", ".join(f"rank {w['rank']} on {w['host']}" for w in lost)
    return MpitrainError(f"the run ended {short} updates short of its plan: the remaining "
                         f"steps of lost {names} had no worker left to take them (its "
                         f"results are kept, recorded as failed)", summary=summary)
