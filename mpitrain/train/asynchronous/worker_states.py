"""An async worker's life, as its parameter server sees it: one state per worker, and
the transitions the protocol allows, in one table (pure: no MPI, no clock; unit-tested).

* :class:`WorkerState`: what a worker is to rank 0 (see the table below).
* :data:`TRANSITIONS`: every legal move, each with the event that makes it; anything
  else is a bug in the protocol and raises :class:`IllegalMove`.
* :class:`WorkerStates`: every worker's state, with what the server's loop reads
  derived from it: how many workers it still awaits a message from, and who was
  dismissed.
* :func:`after_reply`: the same life from the worker's side, what a reply from rank 0
  means for a worker that stopped pushing (the worker's loop runs over these states).
* :func:`diagram`: the table as a state diagram (docs/architecture.md holds it; a unit
  test keeps the two the same).

Holding a lease is not a state of a worker's life: a pipelined worker can hold one
lease and be owed the reply to a second push at once, and the staleness bound needs
the lease's version, so :class:`..leases.Leases` keeps holders and waiters. Only a
TRAINING worker holds a lease or waits for one, and a RECALLED one waits for one;
no other is in :class:`..leases.Leases`.

Who counts what (rank 0, :mod:`.server`): the loop runs while a TRAINING, RECALLED or
DISMISSED worker is left (it waits for a message from each); a lost worker's steps go
to the TRAINING, RECALLED, DISMISSED and PARKED ones; the liveness check watches the
lease holders and the DISMISSED workers (:mod:`.recovery`), whose keepalive schedule is
that of the PARKED ones. A server of rank > 0 (:mod:`.partition_server`) sees only
TRAINING, DONE (the worker's farewell) and LOST (rank 0 dropped it).
"""

from __future__ import annotations

import enum
from typing import Dict, Iterable, List

from ..protocol import DROPPED, FINAL, PARKED as PARKED_FLAG


class WorkerState(enum.Enum):
    """What an async worker is to its parameter server."""

    #: computes and pushes: holds a lease or waits for one (:class:`..leases.Leases`)
    TRAINING = "training"
    #: pushed FINAL, then was given a lost worker's steps (or had been, before its FINAL
    #: push came in): the reply to that push will be a lease, or the final reply if the
    #: run stops first; it sends no farewell
    RECALLED = "recalled"
    #: told to stop (the run stops early, or a resumed worker had its steps done): its
    #: pushes in flight are answered so too, until its FINAL push or farewell
    DISMISSED = "dismissed"
    #: its steps done while others train (``--enable-recovery``): answered PARKED, and
    #: again every half ``--timeout``, kept for a lost worker's steps
    PARKED = "parked"
    #: given its final reply: the server waits for nothing more from it
    DONE = "done"
    #: dropped (``--enable-recovery``): silent past its liveness bound, its process gone,
    #: or stopped as the run ended; no message of its is awaited, its steps went on
    LOST = "lost"


TRAINING, RECALLED, DISMISSED = WorkerState.TRAINING, WorkerState.RECALLED, WorkerState.DISMISSED
PARKED, DONE, LOST = WorkerState.PARKED, WorkerState.DONE, WorkerState.LOST

#: every legal move: state -> {next state: the event that makes it}. A state's move to
#: itself is the protocol repeating itself there (no change of state)
TRANSITIONS: Dict[WorkerState, Dict[WorkerState, str]] = {
    TRAINING: {
        DISMISSED: "the run stops, or its steps were done before it began",
        DONE: "its FINAL push applied, or a diverged push",
        PARKED: "its FINAL push applied while others train",
        RECALLED: "its FINAL push applied, with steps given to it meanwhile",
        LOST: "silent past its liveness bound, or its process gone",
    },
    RECALLED: {
        TRAINING: "a lease, with the steps of a lost worker",
        DONE: "the run stops first",
    },
    DISMISSED: {
        DISMISSED: "a push it had in flight, answered so too",
        DONE: "its FINAL push or its farewell",
        LOST: "silent past its liveness bound, or its process gone",
    },
    PARKED: {
        PARKED: "a PARKED reply again, every half timeout",
        RECALLED: "a worker lost, a share of its steps",
        DONE: "the run is over",
    },
    DONE: {
        LOST: "stopped on the server's host as the run ended",
    },
    LOST: {},
}

#: the states whose workers the server's loop still waits for a message from
AWAITED = frozenset({TRAINING, RECALLED, DISMISSED})
#: the states whose workers may be given a lost worker's steps
TAKERS = frozenset(AWAITED | {PARKED})


class IllegalMove(RuntimeError):
    """A move the protocol does not allow: a bug (it ends the job, never a hang)."""


class WorkerStates:
    """Every worker's state (all start TRAINING), moved only along
    :data:`TRANSITIONS`, and what the server's loop reads, kept as they move (the
    loop reads them once per update, so they are not computed then):
    :attr:`awaited` (the workers it still waits for a message from) and
    :attr:`dismissed` (the DISMISSED workers, in the order they were dismissed). The
    dict :attr:`of` and the list :attr:`dismissed` are changed in place, never
    replaced: the server binds them once."""

    def __init__(self, ranks: Iterable[int]):
        #: rank -> its state (read it, move it only with :meth:`move`)
        self.of: Dict[int, WorkerState] = {r: TRAINING for r in ranks}
        #: rank -> every state it has been in, in order (for :meth:`was` and for errors)
        self.history: Dict[int, List[WorkerState]] = {r: [TRAINING] for r in self.of}
        self.awaited = len(self.of)
        self.dismissed: List[int] = []

    def move(self, rank: int, to: WorkerState) -> None:
        """Move ``rank`` to ``to``; :class:`IllegalMove` if the table has no such move."""
        now = self.of[rank]
        if to not in TRANSITIONS[now]:
            raise IllegalMove(f"async worker rank {rank}: no move from {now.name} to "
                              f"{to.name} (its states so far: "
                              f"{' -> '.join(s.name for s in self.history[rank])})")
        if now is to:
            return
        self.of[rank] = to
        self.history[rank].append(to)
        self.awaited += (to in AWAITED) - (now in AWAITED)
        if now is DISMISSED:
            self.dismissed.remove(rank)
        elif to is DISMISSED:
            self.dismissed.append(rank)

    def ranks(self, *states: WorkerState) -> List[int]:
        """The ranks in any of ``states``, in the order the ranks were given."""
        return [r for r, s in self.of.items() if s in states]

    def was(self, rank: int, state: WorkerState) -> bool:
        """Whether ``rank`` has ever been in ``state`` (e.g. dismissed, now done)."""
        return state in self.history[rank]

    def all_lost(self) -> bool:
        return all(s is LOST for s in self.of.values())


def after_reply(flags: int, pushed_final: bool) -> WorkerState:
    """A worker that stopped pushing (its last push FINAL if ``pushed_final``; else it
    stopped because rank 0 said so) took rank 0's reply with ``flags``: the state it
    is in now. DROPPED: LOST (it leaves); FINAL: DONE if it pushed FINAL, else
    DISMISSED (it owes a farewell); PARKED: PARKED (it listens on); a lease: TRAINING
    (a lost worker's steps). Rank 0 parks or recalls only a worker that pushed FINAL:
    anything else is :class:`IllegalMove`."""
    if flags & DROPPED:
        return LOST
    if flags & FINAL:
        return DONE if pushed_final else DISMISSED
    if not pushed_final:
        raise IllegalMove(f"an async worker that did not push FINAL was answered with "
                          f"flags {flags} (a lease or PARKED) after it stopped pushing")
    return PARKED if flags & PARKED_FLAG else TRAINING


def diagram() -> str:
    """:data:`TRANSITIONS` as a Mermaid state diagram (the block in
    docs/architecture.md, "The async worker's life")."""
    lines = ["stateDiagram-v2", f"    [*] --> {TRAINING.name}"]
    for state, moves in TRANSITIONS.items():
        lines += [f"    {state.name} --> {to.name}: {event}" for to, event in moves.items()]
    lines += [f"    {state.name} --> [*]" for state in (DONE, LOST)]
    return "\n".join(lines) + "\n"
