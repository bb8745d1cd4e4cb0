"""A worker's mailboxes with its parameter servers, moved in step (``--servers K``).

With one server this is the worker's one :class:`.mailbox.Mailbox` with rank 0. With
K, each push goes to every server at once, each carrying that server's share of the
gradient (:mod:`.partition`), the gradient's norm (K > 1) and (rank 0's) the BatchNorm
statistics; its header carries that server's lease version. A push is answered when
every server has answered it: rank 0's reply decides what comes next (a lease, a
dismissal, PARKED, DROPPED: rank 0 decides about workers), the others' are their
shares' weights. The weights the worker computes at are the shares put together.

Bounded staleness (``--staleness``) with K servers: the others answer a push with
nothing; once rank 0's lease is in, the worker asks server 1 for its lease (REQUEST),
then server 2, and so on: it never waits for one server's lease while holding a
lease of a server after it, so no two workers can wait for each other.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import numpy as np

from ...comm import Backoff
from ..protocol import (DROPPED, FAREWELL, FINAL, PARKED, REQUEST, SLOTS, TAG_GRADIENT,
                        TAG_WEIGHTS, Header, new_message, slots_word, write_version)
from .mailbox import PIPELINE_DEPTH, SHARED, Mailbox, PushCodec, norm_slots
from .sharded.partition import partition_of


class InFlight(NamedTuple):
    """One push of a worker that its servers have not all answered yet."""

    reply: object  # the pending receive of rank 0's reply
    push: object  # the pending send of the push to rank 0 (None: the initial lease)
    lease: int  # the lease buffers the replies land in (one per server)
    others: Tuple = ()  # each other server's (pending reply or None, pending send or None)


class Post:
    """A worker's mailboxes, one per server, in server order (see the module)."""

    def __init__(self, ctx):
        cfg, self.comm = ctx.cfg, ctx.comm
        self.boxes: List[Mailbox] = Mailbox.open_all(ctx)
        self.zero, self.others = self.boxes[0], self.boxes[1:]
        part = partition_of(ctx)
        self.shares = [part.share(s) for s in range(part.servers)]
        self.codecs = [PushCodec.of(ctx, s, sends=True) for s in range(part.servers)]
        self.n = part.n
        self.norm_slots = norm_slots(cfg)  # (the gradient's norm after each share, K > 1)
        #: leases of the other servers are asked for, in server order (see the module)
        self.asks = cfg.staleness_bound is not None and bool(self.others)
        self.whole = np.empty(self.n, np.float32) if self.others else None
        self.assembled: Optional[int] = None  # the lease buffer ``whole`` holds
        #: each lease buffer's version from each server (what a push computed there says)
        self.versions = [[0] * len(self.boxes) for _ in range(PIPELINE_DEPTH + 1)]
        self.ask = new_message()  # a REQUEST (a header alone)
        self.sharing = [box for box in self.boxes if box.shared_push]
        # (with one server the weights are rank 0's lease buffers themselves: their views
        # made once, not per step; with no compute a worker steps tens of thousands of
        # times a second, docs/architecture.md, "The async hot path")
        self._views = None if self.others else [lease[SLOTS:SLOTS + self.n]
                                                for lease in self.zero.leases]

    # ---- what the worker computes with ------------------------------------------------
    def weights(self, lease: int) -> np.ndarray:
        """The weights in lease buffer ``lease``: rank 0's buffer itself with one server,
        else every server's share copied into one vector (once per lease taken)."""
        if self._views is not None:
            return self._views[lease]
        if self.assembled != lease:
            for box, share in zip(self.boxes, self.shares):
                self.whole[share] = box.leases[lease][SLOTS:SLOTS + share.stop - share.start]
            self.assembled = lease
        return self.whole

    def buffers(self, lease: int) -> np.ndarray:
        """The BatchNorm statistics in lease buffer ``lease`` (rank 0's)."""
        return self.zero.leases[lease][SLOTS + self.shares[0].stop:]

    # ---- pushes -----------------------------------------------------------------------
    def fill(self, slot: int, grad: np.ndarray, norm: float, buffers) -> None:
        """Push slot ``slot`` of every server: its share of ``grad``, the norm, and (rank
        0's) the statistics ``buffers`` (None: the model has none)."""
        tail = self.norm_slots
        for box, share, codec in zip(self.boxes, self.shares, self.codecs):
            push = box.pushes[slot]
            codec.encode(grad[share], push[SLOTS:SLOTS + codec.slots])
            if tail:
                push[SLOTS + codec.slots] = norm
        if buffers is not None:
            self.zero.pushes[slot][SLOTS + self.codecs[0].slots + tail:] = buffers

    def stamp(self, slot: int, lease: int, header: Header) -> None:
        """``header`` in front of every server's push ``slot``, with the version of that
        server's weights in lease buffer ``lease`` (those the gradient was computed at)."""
        for box, version in zip(self.boxes, self.versions[lease]):
            write_version(header.write(box.pushes[slot]), version)

    def send(self, slot: int, target: int) -> InFlight:
        """Start push ``slot`` to every server, and the receives of their replies into lease
        buffers ``target`` (not the others' when their leases are asked for)."""
        comm, zero = self.comm, self.zero
        reply = comm.start(zero.replies[target])
        others = tuple((None if self.asks else comm.start(box.replies[target]),
                        comm.start(box.sends[slot])) for box in self.others) \
            if self.others else ()
        flight = InFlight(reply, comm.start(zero.sends[slot]), target, others)
        for box in self.sharing:  # (one message each, as through MPI)
            comm.traffic.add_sent(SHARED, box.shared_push)
        return flight

    def initial(self) -> InFlight:
        """The receives of every server's first lease (into lease buffers 0)."""
        comm = self.comm
        return InFlight(comm.start(self.zero.replies[0]), None, 0,
                        () if self.asks else tuple((comm.start(box.replies[0]), None)
                                                   for box in self.others))

    def again(self, lease: int) -> InFlight:
        """Rank 0's next reply into lease buffers ``lease`` (after PARKED: it speaks again)."""
        return InFlight(self.comm.start(self.zero.replies[lease]), None, lease)

    def take(self, oldest: InFlight, backoff: Backoff, bound: float) -> Header:
        """Complete ``oldest``: rank 0's reply, then its push (None for the initial lease),
        unless rank 0 dismisses this worker as lost (DROPPED: it cancelled its receive, so
        that push is never taken); then the other servers' (asked for, in order, when
        rank 0's reply is a lease under a staleness bound). Returns rank 0's header."""
        comm = self.comm
        comm.wait(oldest.reply, backoff, timeout=bound)
        lease = self.zero.leases[oldest.lease]
        header = Header.read(lease)
        self.assembled = None
        if header.flags & DROPPED:
            self.cancel([oldest])
            return header
        if oldest.push is not None:
            comm.wait(oldest.push, backoff, timeout=bound)
        if self.zero.shared and not header.flags & (FINAL | PARKED):  # written in place
            comm.traffic.add_recv(SHARED, (lease.size - SLOTS) * 4)
        for box, (reply, send) in zip(self.others, oldest.others):
            if reply is not None:
                comm.wait(reply, backoff, timeout=bound)
                self._shared_lease(box, oldest.lease)
            if send is not None:
                comm.wait(send, backoff, timeout=bound)
        if self.asks and not header.flags & (FINAL | PARKED):
            for box in self.others:
                self._ask(box, oldest.lease, backoff, bound)
        versions = self.versions[oldest.lease]
        versions[0] = header.version
        for s, box in enumerate(self.others, 1):
            versions[s] = Header.read(box.leases[oldest.lease]).version
        return header

    def _ask(self, box: Mailbox, lease: int, backoff: Backoff, bound: float) -> None:
        """Ask ``box``'s server for its lease (REQUEST), into lease buffer ``lease``."""
        comm = self.comm
        Header(flags=REQUEST, aux=slots_word(0, lease)).write(self.ask)
        reply = comm.start(box.replies[lease])
        comm.wait(comm.isend(self.ask, box.server, TAG_GRADIENT, "push",
                             f"{comm.name(box.server)} to take a lease request"),
                  backoff, timeout=bound)
        comm.wait(reply, backoff, timeout=bound)
        self._shared_lease(box, lease)

    def _shared_lease(self, box: Mailbox, lease: int) -> None:
        if box.shared:
            self.comm.traffic.add_recv(SHARED, (box.leases[lease].size - SLOTS) * 4)

    def cancel(self, flight) -> None:
        """Cancel the receives of ``flight``'s replies (this worker was dropped: none of
        them will come)."""
        for f in flight:
            self.comm.cancel(f.reply)
            for reply, _ in f.others:
                self.comm.cancel(reply)

    def farewell(self, bound: float) -> None:
        """The last word to every other server (FINAL|FAREWELL, a header alone), and its
        answer: each listens to this worker until then."""
        comm = self.comm
        messages = [Header(flags=FINAL | FAREWELL).write(new_message()) for _ in self.others]
        answers = [new_message() for _ in self.others]
        waits = []
        for box, message, answer in zip(self.others, messages, answers):
            waits.append(comm.irecv(answer, box.server, TAG_WEIGHTS, "pull",
                                    f"{comm.name(box.server)}'s last reply"))
            waits.append(comm.isend(message, box.server, TAG_GRADIENT, "push",
                                    f"{comm.name(box.server)} to take this worker's "
                                    "farewell"))
        comm.wait_all(waits, timeout=bound)
