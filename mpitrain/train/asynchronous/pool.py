"""A server's message memory, flat in the number of workers.

Each worker's pushes and leases need memory on its server: through MPI, a buffer the
push lands in and one or two its replies leave from; through shared memory
(:mod:`.mailbox`), the worker's push and lease slots, which the server maps, and the
pages it touches count in its resident memory. Kept per worker, that is about three
messages a worker: for a small model the fastest way (a persistent request per
buffer, started once per message, never rebuilt) and a few megabytes in all; for a
large one three models per worker (AlexNet at 224x224: 0.7 GB a worker), where an
allreduce rank keeps one model whatever the number of workers. So once every
worker's buffers together would exceed :data:`RESIDENT_BUDGET` (:func:`pooled`), a
server keeps only what is in flight:

* **Pushes through MPI** (:class:`ReceivePool`): no receive buffer is posted for a
  push before it comes. A matched probe (:meth:`mpitrain.comm.Comm.matched_recv`)
  finds it and receives it into one of :data:`RECEIVE_BUFFERS` buffers, which the
  server takes back once it has applied it (it applies one push at a time). Until
  then the push stays in its worker's own buffer: a large message travels by
  rendezvous, its bytes move once its receive is there.
* **Leases through MPI** (:class:`ReplyPool`): a lease is written into a buffer of one
  pool shared by every worker and sent from it; the buffer is free again once its
  send completed (its worker has the lease). The pool grows to what is in flight, at
  most :data:`REPLY_BUDGET` (at least two buffers); with every buffer in flight the
  server waits for the first send to complete, bounded as every wait is (a worker
  takes its reply at its next MPI call: at once when it waits for it, after its step
  when it pipelines).
* **Shared memory**: the slots stay the worker's. The server applies a push where
  the worker wrote it, then drops those pages from its page tables (not from the
  worker's file: :meth:`mpitrain.comm.shared.PeerSlots.forget`), and writes a lease
  through the worker's file without mapping it
  (:class:`mpitrain.comm.shared.FileWindow`): zero-copy still (the server reads the
  gradient, the worker computes from the lease, where the other wrote them), and only
  the push being applied is in the server's resident memory. Re-mapping a push costs
  page faults, about half a microsecond per 4 KB page; writing a lease through the
  file costs about as much more than through a mapping that stays.

A worker that is lost (``--enable-recovery``) may leave a receive or a send pending
on a pool buffer, which MPI may still read or write: that buffer leaves the pool for
good (:meth:`ReceivePool.lose`, :meth:`ReplyPool.forget`) and the pool may make
another, so a loss costs at most the buffers it held.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np

from ...comm import IDLE, Pending
from ..protocol import TAG_WEIGHTS

#: bytes of message buffers a server may keep as every worker's own (about three
#: messages a worker: :func:`pooled`) before it pools them
RESIDENT_BUDGET = 256 << 20
#: bytes a pooled server's reply buffers may take (as many as are in flight, at least
#: two buffers)
REPLY_BUDGET = 1 << 30
#: receive buffers of a pooled server: it applies one push at a time; a second lets the
#: next push come in while it works through the first's
RECEIVE_BUFFERS = 2


def pooled(push: int, lease: int, n_workers: int) -> bool:
    """Whether a server of ``n_workers`` workers pools their messages' memory: when their
    own buffers (a push and two leases each, of ``push`` and ``lease`` float32) would
    together exceed :data:`RESIDENT_BUDGET`."""
    return n_workers * (push + 2 * lease) * 4 > RESIDENT_BUDGET


def _new(length: int) -> np.ndarray:
    return np.empty(length, np.float32)


class ReceivePool:
    """Push buffers of ``length`` float32 lent to the receives of pushes that came (see
    the module): at most ``count`` at a time. Pure bookkeeping: the receives are the
    caller's."""

    def __init__(self, length: int, count: int = RECEIVE_BUFFERS,
                 new: Callable[[int], np.ndarray] = _new):
        self.length, self.count, self._new = length, count, new
        self.free: List[np.ndarray] = []
        self.made = 0  # buffers of the pool (lent or free)
        #: buffers a lost worker's receive may still write into: never lent again
        self.lost: List[np.ndarray] = []

    def lend(self) -> Optional[np.ndarray]:
        """A free buffer (made if fewer than ``count`` are), or None: every one is lent."""
        if self.free:
            return self.free.pop()
        if self.made < self.count:
            self.made += 1
            return self._new(self.length)
        return None

    def give_back(self, buffer: np.ndarray) -> None:
        """``buffer``'s push was applied: it is free."""
        self.free.append(buffer)

    def lose(self, buffer: np.ndarray) -> None:
        """``buffer``'s receive was abandoned (its worker lost): kept out of the pool, and
        replaceable."""
        self.lost.append(buffer)
        self.made -= 1


class ReplyPool:
    """Lease buffers ``[header | weights | buffers]`` of ``length`` float32 shared by every
    worker of a server (see the module): as many as are in flight, at most ``most``.

    ``comm`` is the server's communicator (its ``isend`` and ``wait_any``); each buffer
    has at most one send pending, and a buffer is reused only once that send
    completed."""

    def __init__(self, comm, length: int, most: int, new: Callable[[int], np.ndarray] = _new):
        self.comm, self.length, self.most, self._new = comm, length, max(2, most), new
        self.buffers: List[np.ndarray] = []
        self.sends: List[Optional[Pending]] = []  # the pending send from each buffer
        self.to: List[int] = []  # the worker it goes to
        #: (buffer, send) of lost workers' replies: MPI may still read them
        self.lost: List[Tuple[np.ndarray, Optional[Pending]]] = []

    @classmethod
    def of(cls, comm, length: int, budget: Optional[int] = None) -> "ReplyPool":
        """A pool of buffers of ``length`` float32 within ``budget`` bytes (default
        :data:`REPLY_BUDGET`), two at least."""
        budget = REPLY_BUDGET if budget is None else budget
        return cls(comm, length, budget // (4 * length))

    def send(self, rank: int, what: str, write: Callable[[np.ndarray], None]) -> Pending:
        """Write a reply with ``write(buffer)`` into a free buffer and send it to ``rank``
        (``what``: what the wait for it is, in a timeout message). Returns the send."""
        i = self._free()
        buffer = self.buffers[i]
        write(buffer)
        self.sends[i] = sending = self.comm.isend(buffer, rank, TAG_WEIGHTS, "pull", what)
        self.to[i] = rank
        return sending

    def _free(self) -> int:
        """A buffer whose send completed; a new one below the bound; else the first of
        the pending ones to complete (bounded by the communicator's timeout, which
        names the worker)."""
        sends = self.sends
        for i, sending in enumerate(sends):
            if sending is None or sending.test():
                return i
        for i, sending in enumerate(sends):  # (ULFM said its worker died: never completes)
            assert sending is not None  # (a None would be free: the loop above took it)
            if sending.failed:
                self._lose(i)
                return self._grow()
        if len(self.buffers) < self.most:
            return self._grow()
        return self.comm.wait_any(sends, IDLE)

    def _grow(self) -> int:
        self.buffers.append(self._new(self.length))
        self.sends.append(None)
        self.to.append(-1)
        return len(self.buffers) - 1

    def _lose(self, i: int) -> None:
        self.lost.append((self.buffers.pop(i), self.sends.pop(i)))
        self.to.pop(i)

    def pending_to(self, rank: int) -> List[Pending]:
        """The sends to ``rank`` not known to be complete."""
        return [s for s, r in zip(self.sends, self.to) if r == rank and s is not None
                and not s.done]

    def forget(self, rank: int) -> None:
        """``rank`` was lost: the buffers of its replies still pending leave the pool."""
        for i in reversed(range(len(self.buffers))):
            sending = self.sends[i]
            if self.to[i] == rank and sending is not None and not sending.test():
                self._lose(i)


class Pools:
    """A pooled server's two pools: its workers' pushes through MPI land in
    :attr:`receives`, its leases through MPI leave from :attr:`replies`. Its workers in
    shared memory need neither (their slots are theirs), only to know that their
    server pools (:func:`pooled`)."""

    def __init__(self, comm, push: int, lease: int):
        self.receives = ReceivePool(push)
        self.replies = ReplyPool.of(comm, lease)

    @classmethod
    def of(cls, comm, push: int, lease: int, n_workers: int) -> Optional["Pools"]:
        """The pools of a server of ``n_workers`` workers whose messages are ``push`` and
        ``lease`` float32 long, or None: their own buffers fit in the budget."""
        return cls(comm, push, lease) if pooled(push, lease, n_workers) else None


__all__ = ["RESIDENT_BUDGET", "REPLY_BUDGET", "RECEIVE_BUFFERS", "pooled", "ReceivePool",
           "ReplyPool", "Pools"]
