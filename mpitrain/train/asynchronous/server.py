"""The async server (rank 0): applies pushes in arrival order, grants leases, evaluates."""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional

import numpy as np

from ...comm import SERVING, Backoff
from ...errors import CommTimeout
from ...run.checkpoint import Checkpoint
from ..context import Context, Summary, diverged, interrupted
from ..evaluation import Stopwatch
from ..leases import Leases, Quotas, first_look
from ..protocol import (DIVERGED, FAREWELL, FINAL, INTERRUPTED, PIPELINED, Header,
                        SilentPeers, stalled)
from ..protocol import PARKED as PARKED_FLAG
from . import accounts
from .accounts import WorkerAccount
from .mailbox import PIPELINE_DEPTH, ServerEnd
from .milestones import Milestones
from .sharded.partition import partition_of
from .sharded.peers import GONE, PartitionServers, completed, raise_if_lost
from .recovery import Recovery, short_of_plan
from .store import ParameterStore, fresh_share_state, share_of_checkpoint
from .worker_states import (DISMISSED, DONE, LOST, PARKED, RECALLED, TAKERS, TRAINING,
                            WorkerStates)

#: workers whose steps take less than this (EWMA) make the server poll, not sleep
FAST_STEP = 2e-4
#: how the server polls then: yield for a round trip's worth, then sleep
POLLING = Backoff(yield_for=3e-4, first_sleep=SERVING.first_sleep, max_sleep=SERVING.max_sleep)
#: the progress line is refreshed every this many updates (the console throttles it too)
PROGRESS_EVERY = 64


class PollPolicy:
    """How the server waits for the next push: yield-poll when workers' steps are
    shorter than FAST_STEP, else sleep.

    When a worker's step (its compute between pushes, which it reports) is shorter
    than the server's sleep, every sleep would add its whole length to each update;
    when steps are long, polling would burn the CPU the workers need and the
    pipeline hides a sleep behind their compute (docs/architecture.md, "The async
    server's sleep between pushes").

    Pipelined workers (their pushes say PIPELINED) need the reply to push k only when
    they would push k+2, two steps after push k: so the server's first sleep lasts
    until two steps after the oldest lease it is owed a push for
    (:func:`..leases.first_look`; that push is then in, and its reply still a step
    early), instead of waking every millisecond or so to find nothing. A worker that
    does not pipeline (bounded staleness, --pipeline, or its first steps) waits for
    each reply, so the server sleeps less.
    """

    def __init__(self):
        self.step_time = 1.0  # EWMA of the workers' reported seconds of compute per step
        self.last_think = 1.0  # the last push's

    def observe(self, think: float) -> None:
        self.step_time = 0.8 * self.step_time + 0.2 * think
        self.last_think = think

    def backoff(self, holders: List[int], accounts: Dict[int, WorkerAccount],
                since: Dict[int, float]) -> Backoff:
        """The wait for a push from ``holders``, whose leases were granted at ``since``."""
        if self.step_time < FAST_STEP:
            return POLLING
        if not all(accounts[r].pipelined for r in holders):
            return SERVING
        # (the smaller of the mean and the last: a slow first step, which traces the
        # model, must not hold the mean up for the next twenty)
        first = first_look(min(since[r] for r in holders),
                           min(self.step_time, self.last_think), time.monotonic())
        if first <= SERVING.first_sleep:
            return SERVING
        return Backoff(0.0, first_sleep=first, max_sleep=SERVING.max_sleep)


class Server:
    """Rank 0 in async mode: applies gradients in arrival order, grants leases
    (:class:`..leases.Leases`, bounded staleness), evaluates and checkpoints in the
    background; the parameters are its :class:`.store.ParameterStore`, each worker's
    transport a :class:`.mailbox.ServerEnd`, its counts a
    :class:`.accounts.WorkerAccount` and where it is in its life
    :class:`.worker_states.WorkerStates` (moved only along its table); lost workers are
    :class:`.recovery.Recovery`'s.

    Termination: the loop ends when no worker is awaited (each DONE, PARKED or LOST);
    every push has been matched by a receive and every reply received, so no request
    is pending at MPI_Finalize. Every wait is bounded: a lease holder silent for
    ``--timeout`` is named (or, under recovery, dropped at its liveness bound).

    Why one class of this size (over the ~250 lines we hold classes to): it is the
    server's event loop, and each method is one thing the loop does with a push
    (apply, lease, cut for an evaluation or checkpoint, drop, finish). What has state
    of its own already has its room (store, mailbox, accounts, leases, milestones,
    recovery, and the partition servers of ``--servers``); the rest shares the loop's
    order of events, which is clearer read in one place.
    """

    def __init__(self, ctx: Context, clock: Stopwatch):
        self.ctx, self.clock, self.comm = ctx, clock, ctx.comm
        self.store = ParameterStore(ctx)
        self._write_lease = self.store.write_lease  # (bound once: it runs once per update)
        self.ending = 0  # INTERRUPTED and/or DIVERGED once the run must stop early
        self.diverged_at: List[str] = []
        self.ends: Dict[int, ServerEnd] = ServerEnd.open_all(ctx)
        #: each worker's state (.worker_states); its dict, and its list of the workers
        #: told to stop whose FINAL push has not come yet (_dismiss), bound once
        self.states = WorkerStates(self.ends)
        self._state_of, self.dismissed = self.states.of, self.states.dismissed
        self.accounts: Dict[int, WorkerAccount] = accounts.open_accounts(self.ends, self.states)
        self.leases = Leases(ctx.cfg.staleness_bound, self.accounts)
        # a worker's silence starts when it is granted a lease (then it owes a push)
        self.silence = SilentPeers(self.comm, self.accounts)
        self.polling = PollPolicy()
        self.milestones = Milestones(ctx, clock, len(self.accounts), self._snapshot,
                                     self.checkpoint)
        self.recovery = Recovery(ctx, clock, len(self.accounts))
        self.total_steps = ctx.total_steps  # (a property: read once, not per reply)
        self.quotas = Quotas(self.accounts, self.total_steps)
        #: the other parameter servers (--servers K; see .peers): with them, evaluations
        #: and checkpoints are made at cuts (see _milestone), and at the end from every
        #: server's final share (``whole``)
        self.peers = PartitionServers(ctx)
        self.cut: Optional[_Cut] = None
        self.whole: Optional[dict] = None
        #: how many updates before a point a cut starts draining (0: none, one server)
        self.lookahead = PIPELINE_DEPTH * len(self.accounts) if self.peers.enabled else 0
        if ctx.resume_from is not None:
            self._restore(ctx.resume_from)

    @property
    def version(self) -> int:
        """Updates applied so far (a resumed run's included)."""
        return self.store.version

    def _restore(self, ckpt: Checkpoint) -> None:
        self.clock.offset = ckpt.wall_time_s  # the run's clock goes on, as a sync run's does
        run_dir = self.ctx.cfg.resume
        assert run_dir is not None  # (a checkpoint is resumed from --resume's run)
        self.store.restore(ckpt, run_dir)
        self.ctx.lost.extend(accounts.restore(self.accounts, self.quotas, ckpt))

    def checkpoint(self) -> Checkpoint:
        """The run's checkpoint now; with other servers, rank 0's share unless the
        whole state is in (the end: :attr:`whole`; a cut completes it: _make_cut)."""
        ckpt = accounts.checkpoint(self.store, self.accounts, self.quotas, self.total_steps,
                                   self.clock(), self.ctx)
        return completed(ckpt, self.whole) if self.whole is not None else ckpt

    def _snapshot(self) -> np.ndarray:
        """The weights and statistics to evaluate: all of them on rank 0 with one server;
        with others, the run's initial weights or (the end) :attr:`whole`'s."""
        latest = accounts.latest_buffers(self.accounts)
        if not self.peers.enabled:
            return self.store.snapshot(latest)
        weights = self.ctx.replica.weights() if self.whole is None else \
            self.whole["state"]["weights"]
        return np.concatenate([weights, self.store.average_buffers(latest)])

    def _start_states(self) -> Dict[int, dict]:
        """What each other server starts from: its share of the initial weights (fresh) or
        of the checkpoint, each worker's position, and its own staleness counts (a run
        resumed with as many servers)."""
        ckpt, part = self.ctx.resume_from, partition_of(self.ctx)
        if ckpt is None:
            weights = self.ctx.replica.weights()
            states = {s: fresh_share_state(self.ctx, weights, part.share(s))
                      for s in self.peers.ranks}
        else:
            states = {s: share_of_checkpoint(ckpt, part.share(s)) for s in self.peers.ranks}
        # (the counts are theirs only if the checkpoint had as many servers)
        was = ckpt.meta.geometry if ckpt is not None else None
        saved = ckpt.meta.partition_staleness if ckpt is not None and was is not None \
            and was.servers == part.servers else {}
        positions = {r: w.steps for r, w in self.accounts.items()}
        return {s: {"state": states[s],
                    "positions": positions,
                    "staleness": {w: dict(counts)
                                  for w, counts in saved.get(s, {}).items()}}
                for s in self.peers.ranks}

    # ---- the loop ---------------------------------------------------------------------
    def run(self) -> Summary:
        self.milestones.start(self.version, fresh=self.ctx.resume_from is None)
        if self.peers.enabled:
            self.peers.start(self._start_states())
        cpu = accounts.CpuShare()
        timer = self.ctx.timer
        pooled = any(end.pools is not None or end.release is not None
                     for end in self.ends.values())
        states = self.states
        self._grant_leases()
        timer.restart()
        # (the phases marked with timer.lap, not `with timer(...)`: the loop runs tens of
        # thousands of times a second when workers push zeros, and a block costs more)
        while states.awaited:
            if self.ctx.stop and not self.ending:
                self.ending |= INTERRUPTED
                self._grant_leases()  # releases the waiting workers
                continue
            timer.lap()
            rank = self._next_push()
            timer.lap("wait")
            if rank is None:  # a worker was dropped instead
                continue
            end = self.ends[rank]
            self._apply(self.accounts[rank], end)
            if pooled:  # (its memory: see .pool)
                end.taken()
            timer.lap()
            self._grant_leases()
            timer.lap("comm")
            version, milestones = self.store.version, self.milestones
            if version >= milestones.next_point - self.lookahead:
                self._milestone(version)
            if self.cut is not None or self.peers.gathering is not None:
                self._cutting()
            if version % milestones.updates_per_epoch == 0:
                timer.end_epoch(version // milestones.updates_per_epoch)
            if version % PROGRESS_EVERY == 0:
                milestones.progress(version)
        for rank in self.recovery.release():  # the run is over: no more steps to give
            states.move(rank, DONE)
            self._reply(self.accounts[rank])
        self._fence_stopped()
        for rank, state in states.of.items():
            # a lost worker's last reply may never be taken; Open MPI finalizes with it
            # pending
            if state is not LOST:
                self.ends[rank].drain()
        self.recovery.fence(at_end=True)
        wall, cpu_share = self.clock(), cpu.shares()
        if self.peers.enabled:  # every other server's final share, and its counts
            self.whole = self.peers.whole_final({"state": self.store.state()})
        self.milestones.finish(self.version, wall, record=not self.ending & DIVERGED)
        summary = self.milestones.summary(wall, **accounts.report(
            self.ctx, self.accounts, self.version, wall, self.leases.bound, cpu_share,
            self.quotas.short, self.peers.finals))
        if self.ending & DIVERGED:
            raise diverged(", ".join(self.diverged_at), summary)
        if self.ending & INTERRUPTED:
            raise interrupted(self.ctx, f"after {self.version} updates", summary)
        if self.quotas.short:
            raise short_of_plan(self.quotas.short, self.ctx.lost, summary)
        return summary

    def _next_push(self) -> Optional[int]:
        """The next worker whose push arrived; None when a lost worker was dropped
        instead (only under --enable-recovery)."""
        holders = self.leases.holders  # who owes a push (a new list)
        if self.dismissed:
            holders += self.dismissed
        ends = self.ends
        if self.cut is not None:
            holders += self.cut.extras
        if self.recovery.enabled and self.recovery.due():
            raise_if_lost(self.peers)  # (a share of the model went with it: restart)
            for rank in self.recovery.keepalives():
                self._reply(self.accounts[rank], flags=PARKED_FLAG)
            lost = self.recovery.lost(self.silence, {r: ends[r].posted for r in holders})
            if lost is not None:
                self._drop(*lost)
                return None
        for rank in holders:  # a push already here (the usual case when workers are
            if ends[rank].posted.test():  # busy): taken without setting up a wait
                return self._arrived(rank)
        wait = self.polling.backoff(holders, self.accounts, self.silence.since)
        came = self.silence.first({r: ends[r].posted for r in holders}, wait,
                                  wake_every=self.recovery.wake_every,  # for the next check
                                  tested=True)  # (just above)
        if came is not None:
            return self._arrived(came)
        late = None if self.recovery.enabled else self.silence.overdue(holders)
        if late is not None:  # (under recovery, dropped above instead)
            raise stalled(self.comm, late, f"has not pushed a gradient for "
                                           f"{self.comm.timeout:g} s")
        return None

    def _arrived(self, rank: int) -> int:
        if self.recovery.enabled:  # its push interval is what its liveness bound is made of
            self.recovery.liveness.observe(rank, self.silence.silent_for(rank))
        return rank

    def _drop(self, rank: int, why: str) -> None:
        """Go on without ``rank``: no request of its left to match, its steps reassigned
        (to the workers still awaited, and the parked ones, which are recalled)."""
        w, states = self.accounts[rank], self.states
        self.leases.drop(rank)
        states.move(rank, LOST)
        self.recovery.drop(self.ends[rank])
        self.peers.drop(rank)
        if self.cut is not None and rank in self.cut.extras:
            self.cut.extras.remove(rank)
        gained = self.quotas.reassign(rank, w.steps, states.ranks(*TAKERS))
        woken = [r for r, n in gained.items() if n and states.of[r] is PARKED]
        for r in woken:  # the reply to its FINAL push will be a lease, with these steps
            self.recovery.unpark(r)
            states.move(r, RECALLED)
            self.leases.wait(r)
        self.recovery.record(rank, self.version, w.steps, why, gained, self.quotas.short,
                             states.awaited, len(woken))
        if states.all_lost():
            raise CommTimeout(f"every worker was lost (the last: {self.comm.name(rank)}, "
                              f"{why})")
        if self.cut is not None:  # its lease may have been the last push the cut waited
            self._cutting()       # for: made now, or no one would hold a lease to push
        self._grant_leases()  # its lease no longer holds the others back (--staleness)

    def _fence_stopped(self) -> None:
        """The run is over: a worker stopped on this host (e.g. parked, then SIGSTOPped:
        no liveness check covers a worker without a lease) counts as lost and is killed,
        so that neither the telemetry's gather nor mpirun waits for it."""
        finished = self.states.ranks(DONE)  # (every other one is LOST by now)
        for rank, why in self.recovery.stopped_at_end(finished):
            self.states.move(rank, LOST)
            self.recovery.drop(self.ends[rank], why_kill=why)
            self.peers.drop(rank)
            self.recovery.record(rank, self.version, self.accounts[rank].steps, why, {}, 0, 0, 0)

    def _apply(self, w: WorkerAccount, end: ServerEnd) -> None:
        header = Header.read(end.recv)  # (the push's header is always there)
        flags = header.flags
        if flags & FAREWELL:  # a dismissed worker's last word: nothing to apply
            self._finish(w)
            return
        w.steps, w.elapsed, w.pipelined = header.step, header.elapsed, bool(flags & PIPELINED)
        dismissed = self._state_of[w.rank] is DISMISSED
        # (a dismissed worker's pushes were sent before it knew; a cut takes a pipelined
        # worker's push sent before it took its last lease, see _Cut)
        if not dismissed and self.leases.holds(w.rank):
            self.leases.returned(w.rank)
        if flags & DIVERGED or not math.isfinite(header.loss):
            self.ending |= DIVERGED  # never apply a non-finite gradient
            self.diverged_at.append(f"{self.comm.name(w.rank)} at its step {w.steps}")
            self._finish(w)
            return
        self.ending |= flags & INTERRUPTED
        w.staleness[self.store.version - header.version] += 1
        buffers = self.store.apply(end.payload(header), header.version)
        if buffers is not None:
            w.buffers = buffers
        w.applied += 1
        self.polling.observe(header.think)
        if flags & FINAL:
            if self.cut is not None and self.cut.final(w.rank):
                self._answer_owed(w)
            self._final(w)
        elif dismissed:  # one it had in flight: told again, listened to until FINAL
            self._dismiss(w)
        else:
            self.leases.wait(w.rank)
            if self.cut is not None:
                self.cut.took(w, flags, self.ends[w.rank], self.silence)
        self.milestones.losses.append(header.loss)

    # ---- cuts: evaluations and checkpoints with other servers (see .peers) -------------
    def _milestone(self, version: int) -> None:
        """``version`` is at (one server) or near (others: lookahead) the next point."""
        milestones = self.milestones
        if not self.peers.enabled:
            milestones.reached(version)
            return
        point = milestones.next_point
        owed = len(self.leases.base) + len(self.dismissed)  # pushes still to come in
        if self.cut is not None or version + owed < point:
            return
        if point >= self.milestones.evaluations.evaluator.total_updates:
            milestones.next_point = math.inf  # (the end: every server's final share)
            return
        self.cut = _Cut(*milestones.due(int(point)))  # (finite: below the last, just above)

    def _cutting(self) -> None:
        """Make the cut once drained; take the shares of the one being gathered."""
        if self.cut is not None and not self.leases.base and not self.dismissed \
                and not self.cut.extras:
            self._make_cut()
        self.peers.poll()

    def _make_cut(self) -> None:
        """Every push the workers could send without a reply is in: the workers'
        positions are final until rank 0 replies again, so every server can hold its
        share there. Rank 0 records its own, tells the others (once they acked, it
        replies again), and evaluates and/or saves when their shares are in."""
        cut, self.cut = self.cut, None
        assert cut is not None  # (_cutting makes the cut being drained for)
        version, wall = self.store.version, self.clock()
        checkpoint = self.checkpoint() if cut.save else None  # (rank 0's share: completed)
        buffers = self.store.average_buffers(accounts.latest_buffers(self.accounts))
        positions = {r: GONE if w.state is LOST else w.steps for r, w in self.accounts.items()}

        def then(whole: dict) -> None:
            state = np.concatenate([whole["state"]["weights"], buffers]) \
                if cut.evaluate else None
            self.milestones.submit(version, state, checkpoint and completed(checkpoint, whole),
                                   wall)
        self.peers.cut(positions, {"state": self.store.state()}, then)
        self._grant_leases()

    # ---- leases and replies -----------------------------------------------------------
    def _grant_leases(self) -> None:
        if self.cut is not None:  # draining: no lease until the cut is made
            if not self.ending:
                return
            self.cut = None  # (the run ends: its last state is saved instead)
        version = self.store.version  # (no update is applied while leases are granted)
        for rank in self.leases.next_waiting(version, force=bool(self.ending)):
            w = self.accounts[rank]
            if self._state_of[rank] is RECALLED:  # it pushed FINAL: no farewell will come
                if self.ending:  # (it was to go on with a lost one's steps)
                    self._finish(w)
                    continue
                self.states.move(rank, TRAINING)
            if self.ending or (w.applied == 0 and w.steps >= self.quotas.of[rank]):
                self._dismiss(w)  # stopping, or resumed with its steps done: no lease
                continue
            self.leases.grant(rank, version)
            self.silence.heard(rank)
            self.ends[rank].listen()
            self._reply(w, with_weights=True)

    def _dismiss(self, w: WorkerAccount) -> None:
        """Tell ``w`` to stop (a header-only FINAL reply) and go on listening to it: the
        pushes it had in flight come in and are answered the same way, until its FINAL
        push (its last step's, or a FAREWELL) ends it, so none is left unmatched."""
        self.states.move(w.rank, DISMISSED)  # (again for each push it had in flight)
        self.silence.heard(w.rank)  # it owes a push now
        self.ends[w.rank].listen("a gradient or its farewell")
        self._reply(w)

    def _final(self, w: WorkerAccount) -> None:
        """``w``'s FINAL push was applied: it is finished, unless (under recovery, the
        run going on) it was given a lost worker's steps after it pushed (it is
        recalled: its reply is a lease), or others still train (it is parked: see
        :mod:`.recovery`)."""
        if self.ending or self._state_of[w.rank] is DISMISSED or not self.recovery.enabled:
            self._finish(w)
        elif w.steps < self.quotas.of[w.rank]:
            self.states.move(w.rank, RECALLED)
            self.leases.wait(w.rank)
        elif self.states.awaited > 1:  # (it is one of them until it is parked)
            self.states.move(w.rank, PARKED)
            self.recovery.park(w.rank)
            self._reply(w, flags=PARKED_FLAG)
        else:
            self._finish(w)

    def _answer_owed(self, w: WorkerAccount) -> None:
        """``w``'s FINAL push came while a cut drained, the reply to its push before held
        back (_Cut): that reply goes first (replies are taken in order), a header alone
        (it computes at no lease after its FINAL push), and it waits for no lease."""
        self.leases.drop(w.rank)
        self._reply(w, flags=0)

    def _finish(self, w: WorkerAccount) -> None:
        """``w`` sent its FINAL push or farewell (or, recalled, the run ends before its
        lease): the final reply, and no more listening to it."""
        self.states.move(w.rank, DONE)
        self._reply(w)

    def _reply(self, w: WorkerAccount, with_weights: bool = False,
               flags: Optional[int] = None) -> None:
        """A lease (the current weights) or a header alone with ``flags`` (by default a
        final reply: FINAL and why the run ends early); with the step to resume from and
        the steps of lost workers this one runs beyond its own."""
        if flags is None:
            flags = 0 if with_weights else FINAL | self.ending
        # (positional: a namedtuple made from keywords costs more, once per update)
        header = Header(self.store.version, w.steps, flags, 0.0, 0.0, 0.0,
                        self.quotas.of[w.rank] - self.total_steps, 0)
        self.ends[w.rank].reply(header, self._write_lease if with_weights else None)


class _Cut:
    """An evaluation and/or checkpoint point being drained for (``--servers K``): rank
    0 grants no lease until every push the workers can send without one is in. That
    is the lease holders' and dismissed workers' pushes, and one more of each pipelined
    worker whose push rank 0 answers no more: it sends the next one before it waits
    for the answer (``extras``, listened for at once)."""

    def __init__(self, evaluate: bool, save: bool):
        self.evaluate, self.save = evaluate, save
        self.extras: List[int] = []
        self.seen: set = set()

    def took(self, w: WorkerAccount, flags: int, end: ServerEnd, silence) -> None:
        """``w``'s push (``flags``) was applied while draining; its lease is held back."""
        if w.rank in self.extras:
            self.extras.remove(w.rank)
        elif w.rank not in self.seen and flags & PIPELINED:
            self.extras.append(w.rank)
            silence.heard(w.rank)
            end.listen()
        self.seen.add(w.rank)

    def final(self, rank: int) -> bool:
        """``rank``'s FINAL push was applied while draining: it sends nothing more, so
        the cut waits for no push of it. Returns whether it was an extra: then the
        reply to its push before (held back by the cut) is still owed to it."""
        extra = rank in self.extras
        if extra:
            self.extras.remove(rank)
        return extra
