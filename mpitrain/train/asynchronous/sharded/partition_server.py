"""A parameter server of rank 1..K-1 (``--servers K``): its share of every push.

It owns one share of the parameters (:mod:`.partition`), applies each worker's push
to it the moment the push arrives, in arrival order, with the same optimizer as rank
0, and answers with the share's weights. Rank 0 decides everything else about the
run (:mod:`.peers`): this server starts from what rank 0 sends, follows its cuts
(evaluations and checkpoints), forgets the workers it drops, and ends once every
worker said farewell (every worker ends by saying it to each server of rank > 0).

Bounded staleness (``--staleness K``): this server's own bound, over its own version,
with the lease policy of rank 0 (:class:`..leases.Leases`). A worker asks it for a
lease (a REQUEST header) only once it holds the leases of every server before it, so
no two workers can each hold a lease the other waits for. Unbounded, every push is
answered at once with a lease.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

from ....comm import SERVING
from ....errors import CommTimeout
from ...context import Context, Summary
from ...evaluation import Stopwatch
from ...leases import Leases
from ...protocol import DIVERGED, FAREWELL, FINAL, REQUEST, TAG_CONTROL, Header, slots_of
from .. import accounts
from ..accounts import WorkerAccount
from ..mailbox import ServerEnd
from .peers import ACK, CUT, DROP, GONE, ObjectIn, ObjectOut, control_message
from ..server import FAST_STEP, POLLING, PollPolicy
from ..store import ParameterStore
from ..worker_states import DONE, LOST, TRAINING, WorkerStates


class PartitionServer:
    """Rank s, 0 < s < K. Every wait is bounded: it names the silence when neither a
    worker nor rank 0 said anything for longer than rank 0's own bound (rank 0 names a
    stalled worker first)."""

    def __init__(self, ctx: Context, clock: Stopwatch):
        self.ctx, self.clock, self.comm = ctx, clock, ctx.comm
        self.rank = self.comm.rank
        self.store = ParameterStore(ctx, server=self.rank)
        self._write_lease = self.store.write_lease
        self.ends: Dict[int, ServerEnd] = ServerEnd.open_all(ctx)
        #: each worker's state: here only TRAINING (it has not said farewell), DONE (it
        #: has) and LOST (rank 0 dropped it); see .worker_states
        self.states = WorkerStates(self.ends)
        self.accounts: Dict[int, WorkerAccount] = accounts.open_accounts(self.ends, self.states)
        self.bounded = ctx.cfg.staleness_bound is not None
        # (bounded: a worker waits once it asks)
        self.leases = Leases(ctx.cfg.staleness_bound, [])
        self.polling = PollPolicy()
        self.listening: set = set()  # workers whose next message a receive is posted for
        self.bound = self.comm.bounds.workers  # rank 0, which names a rank, first
        self.control = control_message(self.comm)
        self.listen_to_rank0 = self.comm.recv_init(self.control, 0, TAG_CONTROL, "control",
                                                   "a word from rank 0")
        #: a cut being made: worker rank -> the step of its last push in it
        self.positions: Optional[Dict[int, int]] = None
        self.cut = 0
        self.held: List[int] = []  # workers whose push came past the cut: taken after it
        self.outgoing: List[ObjectOut] = []
        self.heard = 0.0  # when a worker or rank 0 last spoke (the clock's time)

    def run(self) -> Summary:
        comm = self.comm
        start = ObjectIn(comm, 0, "rank 0's start: this server's share").wait()
        self.store.load(start["state"])
        for rank, w in self.accounts.items():
            w.start_step = w.steps = start["positions"].get(rank, 0)
            w.staleness.update(start["staleness"].get(rank, {}))
        comm.start(self.listen_to_rank0)
        for rank in self.accounts:
            if self.bounded:
                self._listen(rank, "a request for its lease")
            else:
                self._lease(rank)
        self.heard = self.clock()
        while self.states.awaited:
            came = self._next()
            if came is not None:
                self._take(came)
            if self.positions is not None and self._reached(self.positions):
                self._share()
        self._report()
        return Summary(self.clock(), 0, 0.0, math.nan, math.nan, math.nan)

    # ---- what comes in ----------------------------------------------------------------
    def _next(self) -> Optional[int]:
        """The next worker whose message came in; None after a word from rank 0."""
        listening = list(self.listening)
        posted = [self.ends[r].posted for r in listening]
        for rank, pending in zip(listening, posted):  # (most often one is in already)
            if pending.test():
                self.heard = self.clock()
                self.listening.discard(rank)
                return rank
        if self.listen_to_rank0.test():
            self._from_rank0()
            return None
        backoff = POLLING if self.polling.step_time < FAST_STEP else SERVING
        left = self.bound - (self.clock() - self.heard)
        index = self.comm.wait_any(posted + [self.listen_to_rank0], backoff,
                                   timeout=max(0.0, left), tested=True)
        if index is None:
            raise CommTimeout(
                f"{self.comm.name(self.rank)}, a parameter server, heard nothing from any "
                f"worker nor from rank 0 for {self.bound:g} s: a rank is stalled or dead "
                "(raise --timeout if steps are legitimately that slow)")
        self.heard = self.clock()
        if index == len(posted):
            self._from_rank0()
            return None
        self.listening.discard(listening[index])
        return listening[index]

    def _from_rank0(self) -> None:
        operation, argument = int(self.control[0]), int(self.control[1])
        if operation == CUT:
            pairs = self.control[2:].reshape(-1, 2)
            self.positions = {int(r): int(p) for r, p in pairs if r > 0 and p != GONE}
            self.cut = argument
            for rank in self.states.ranks(TRAINING):  # (those with every push of the cut in)
                self._pause_past_cut(rank, self.positions)
            ack = control_message(self.comm)
            ack[:2] = ACK, argument
            self.comm.wait(self.comm.isend(ack, 0, TAG_CONTROL, "control",
                                           "rank 0 to take the ack of a cut"))
        elif operation == DROP:
            self._drop(argument)
        self.comm.start(self.listen_to_rank0)

    def _take(self, rank: int) -> None:
        end, w = self.ends[rank], self.accounts[rank]
        header = Header.read(end.recv)
        if header.flags & FAREWELL:
            self._finish(w)
        elif header.flags & REQUEST:  # (bounded) it holds the leases before this one's
            if end.leases is not None:
                end.reply_to = slots_of(header.aux)[1]
            self.leases.wait(rank)
            self._grant_leases()
        elif self.positions is not None and header.step > self.positions.get(rank, header.step):
            self.held.append(rank)  # past the cut: applied once the cut is made
            return  # (its message stays where it landed until then)
        else:
            self._apply(w, end, header)
        end.taken()  # (its memory: see .pool)

    def _apply(self, w: WorkerAccount, end: ServerEnd, header: Header) -> None:
        w.steps, w.elapsed = header.step, header.elapsed
        if self.positions is not None:
            self._pause_past_cut(w.rank, self.positions)
        payload = end.payload(header)  # (shared memory: says where the reply goes)
        if not header.flags & DIVERGED and math.isfinite(header.loss):
            w.staleness[self.store.version - header.version] += 1
            self.store.apply(payload, header.version)
            w.applied += 1
        self.polling.observe(header.think)
        if not self.bounded:
            self._lease(w.rank)
            return
        if self.leases.holds(w.rank):
            self.leases.returned(w.rank)
        self._listen(w.rank, "a request for its lease")
        self._grant_leases()  # its lease no longer holds the others back

    # ---- what goes out ----------------------------------------------------------------
    def _listen(self, rank: int, what: Optional[str] = None) -> None:
        self.ends[rank].listen(what)
        self.listening.add(rank)

    def _lease(self, rank: int) -> None:
        end = self.ends[rank]
        self._listen(rank, "a gradient")
        w = self.accounts[rank]
        end.reply(Header(self.store.version, w.steps, 0, 0.0, 0.0, 0.0, 0, 0),
                  self._write_lease)

    def _grant_leases(self) -> None:
        version = self.store.version
        for rank in self.leases.next_waiting(version):
            self.leases.grant(rank, version)
            self._lease(rank)

    def _finish(self, w: WorkerAccount) -> None:
        """``w`` said farewell: the last reply, and no more listening to it."""
        self.states.move(w.rank, DONE)
        self.leases.drop(w.rank)
        self.ends[w.rank].reply(Header(self.store.version, w.steps, FINAL))
        self._grant_leases()

    def _drop(self, rank: int) -> None:
        """Rank 0 lost worker ``rank``: listen to it no more."""
        if self.states.of[rank] is not TRAINING:  # (it said farewell here already)
            return
        self.states.move(rank, LOST)
        self.listening.discard(rank)
        if rank in self.held:
            self.held.remove(rank)
        self.leases.drop(rank)
        self.ends[rank].hang_up(tell=False)
        self._grant_leases()

    # ---- cuts and the end -------------------------------------------------------------
    def _pause_past_cut(self, rank: int, positions: Dict[int, int]) -> None:
        """While a cut is made (at ``positions``, :attr:`positions`): a worker with every
        push of the cut applied sends only pushes past it next, held until the cut is
        made; pooled, they are left with it until then (:meth:`.mailbox.ServerEnd.pause`),
        so that held pushes cannot take every buffer of the pool from the pushes the cut
        still waits for."""
        if self.accounts[rank].steps >= positions.get(rank, float("inf")):
            self.ends[rank].pause(True)

    def _reached(self, positions: Dict[int, int]) -> bool:
        """Whether every worker still here has every push of the cut (at ``positions``,
        :attr:`positions`) applied."""
        return all(self.accounts[r].steps >= p for r, p in positions.items()
                   if self.states.of.get(r) is TRAINING)

    def _share(self) -> None:
        """The share at the cut to rank 0; then the pushes held past it."""
        self.outgoing = [o for o in self.outgoing if not o.test()]
        self.outgoing.append(ObjectOut(self.comm, self._state(), 0,
                                       "rank 0 to take this server's share at a cut"))
        self.positions = None
        for end in self.ends.values():
            end.pause(False)
        held, self.held = self.held, []
        for rank in held:
            self._take(rank)

    def _state(self) -> dict:
        return {"cut": self.cut, "state": self.store.state(),
                "staleness": {r: dict(w.staleness) for r, w in self.accounts.items()},
                "applied": {r: w.applied for r, w in self.accounts.items()}}

    def _report(self) -> None:
        """The final share to rank 0; then every reply taken (bounded)."""
        final = ObjectOut(self.comm, self._state(), 0, "rank 0 to take this server's "
                          "final share")
        for out in self.outgoing + [final]:
            out.wait()
        for rank, state in self.states.of.items():
            if state is not LOST:
                self.ends[rank].drain()
        self.comm.cancel(self.listen_to_rank0)

