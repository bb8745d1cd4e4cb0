"""The async messages' buffers, and how they travel between a worker and a server.

Every message is ``[header | payload]`` (:mod:`..protocol`): a push carries a
gradient (as :class:`PushCodec` encodes it) and its
worker's BatchNorm buffers; a lease (the server's reply) carries the weights and
the buffers; a final reply is the header alone. A worker and a server exchange
them through a *mailbox*: one push slot per push the worker may have in flight,
and one lease slot more (the one in use). Its two ends:

* :class:`Mailbox`, the worker's: its slots and one persistent request per slot;
* :class:`ServerEnd`, the server's: where the worker's pushes land and its replies
  leave from.

Where the worker shares the server's host (``--shared-memory``), the slots lie in
memory both map (:func:`mpitrain.comm.share_with_server`): the worker computes from
the lease the server wrote in place, the server applies the gradient where the
worker wrote it, and only the headers travel through MPI (``carried`` = SLOTS;
else None: whole messages). A push's header then names its push slot and the lease
slot its reply goes to (:func:`..protocol.slots_word`). Each slot has one owner at a
time, as an MPI buffer does: a push slot is the server's from its header's send
until its reply is taken, a lease slot from the push that names it until its reply
comes.

A :class:`Layout` sizes both ends from the payload the server owns (its share of
the parameters, :mod:`.partition`): with ``--servers K`` a worker has K mailboxes, one
with each server, each the length of that server's share.

The server's side of every mailbox together stays within a memory budget whatever the
number of workers (:mod:`.pool`): above it, the messages through MPI land in and leave
from pools of buffers shared by all workers, and those in shared memory stay out of
the server's resident memory. The workers' side, and the wire, are the same either way.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ...comm import IDLE, PeerSlots, Pending, Persistent, share_with_server
from ...errors import UsageError
from ...exchange import ErrorFeedback
from ...exchange.powersgd import LowRankFeedback
from ...exchange.topk import TopKFeedback
from ...kernels.half import widen_
from ..protocol import (DROPPED, FINAL, SLOTS, TAG_GRADIENT, TAG_WEIGHTS, Header, new_message,
                        slots_of)
from .sharded.partition import partition_of
from .pool import Pools

#: pushes a worker may have in flight under unbounded staleness (see .worker)
PIPELINE_DEPTH = 2
#: --pipeline auto pipelines with at most this many workers: a pipelined gradient is
#: older by one update of every other worker, which doubles a staleness of N-1, and
#: past two workers that cost more accuracy than the round trip it hides saved time
#: (bench scale)
AUTO_PIPELINE_WORKERS = 2
#: the traffic table's kind for payload bytes that moved through shared memory
SHARED = "shared"


def pipelining_mode(cfg) -> str:
    """--pipeline as it applies: never under a staleness bound (one gradient per lease),
    and 'auto' never with more than AUTO_PIPELINE_WORKERS workers."""
    if cfg.staleness_bound is not None:
        return "off"
    mode = cfg.asynchronous.pipeline
    return "off" if mode == "auto" and cfg.workers > AUTO_PIPELINE_WORKERS else mode


def norm_slots(cfg) -> int:
    """A push's float32 slots after its gradient: with ``--servers K`` > 1, one, the
    gradient's global L2 norm (each server holds a share of the gradient, and
    --clip-grad-norm clips by the whole's norm); with one server none (it has the whole
    gradient: the message is today's)."""
    return 1 if cfg.asynchronous.servers > 1 else 0


class PushCodec:
    """How a push carries its share of the gradient in a float32 message: as it is, or
    (``--compression``) compressed with error feedback on the worker: fp16 (float16
    pairs packed into float32 slots: :class:`mpitrain.exchange.ErrorFeedback`), topk
    (:class:`mpitrain.exchange.topk.TopKFeedback`) or powersgd
    (:class:`mpitrain.exchange.powersgd.LowRankFeedback`). ``span``: the share of the
    fused gradient (start, end) of variables ``shapes``; ``sends``: the worker's end
    (which keeps the residual) or the server's (which decodes)."""

    def __init__(self, transport, shapes: Sequence[Tuple[int, ...]], span: Tuple[int, int],
                 sends: bool, seed: int = 0):
        self.n = span[1] - span[0]
        self.coder = _coder(transport, shapes, span, sends, seed)
        #: float32 slots the gradient takes in the message
        self.slots = self.coder.slots if self.coder is not None else self.n
        self._decoded = np.zeros(self.n if self.coder is not None and not sends else 0,
                                 np.float32)  # (reused: the server applies one at a time)

    @classmethod
    def of(cls, ctx, server: int, sends: bool) -> "PushCodec":
        """The codec of pushes to server ``server`` (rank ``server``) in this run."""
        share = partition_of(ctx).share(server)
        return cls(ctx.cfg.transport, ctx.replica.shapes, (share.start, share.stop), sends,
                   ctx.cfg.seed)

    def encode(self, grad: np.ndarray, slots: np.ndarray) -> None:
        """Write ``grad`` into the message's gradient ``slots`` (worker)."""
        if self.coder is None:
            slots[:] = grad
        else:
            self.coder.encode(grad, slots)

    def decode(self, slots: np.ndarray) -> np.ndarray:
        """The float32 gradient in the message's gradient ``slots`` (server)."""
        return slots if self.coder is None else self.coder.decode(slots, self._decoded)


class _Half:
    """fp16 as a push codec: float16 pairs in float32 slots, error feedback (worker)."""

    def __init__(self, n: int, sends: bool):
        self.n, self.slots = n, (n + 1) // 2
        self.feedback = ErrorFeedback(n if sends else 0)

    def encode(self, grad: np.ndarray, slots: np.ndarray) -> None:
        self.feedback.encode(grad, slots.view(np.float16))

    def decode(self, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
        return widen_(slots.view(np.float16)[:self.n], out)


def _coder(transport, shapes, span: Tuple[int, int], sends: bool, seed: int):
    kind = transport.compression
    if kind == "fp16":
        return _Half(span[1] - span[0], sends)
    if kind == "topk":
        return TopKFeedback(shapes, transport.compression_ratio,
                            transport.compression_min_size, span, sends)
    if kind == "powersgd":
        return LowRankFeedback(shapes, transport.compression_rank,
                               transport.compression_min_size, span, sends, seed)
    return None


class Layout(NamedTuple):
    """Float32 lengths of one mailbox's slots: the same at both ends."""

    push: int  # [header | gradient | buffers]
    lease: int  # [header | weights | buffers]
    depth: int  # push slots: the pushes its worker may have in flight

    @classmethod
    def of(cls, ctx, server: int = 0) -> "Layout":
        """The mailbox of a worker with server ``server`` (rank ``server``): its share of
        the parameters, and the BatchNorm buffers with server 0."""
        replica, cfg = ctx.replica, ctx.cfg
        depth = 1 if pipelining_mode(cfg) == "off" else PIPELINE_DEPTH
        share = partition_of(ctx).size(server)
        gradient = PushCodec.of(ctx, server, sends=False).slots
        buffers = replica.n_buffers if server == 0 else 0
        return cls(SLOTS + gradient + norm_slots(cfg) + buffers, SLOTS + share + buffers, depth)

    @property
    def lengths(self) -> List[int]:
        """Every slot's length: the push slots, then the lease slots."""
        return [self.push] * self.depth + [self.lease] * (self.depth + 1)

    def split(self, slots: Sequence) -> Tuple[list, list]:
        """(push slots, lease slots) of ``slots`` laid out as :attr:`lengths`."""
        return list(slots[:self.depth]), list(slots[self.depth:])


def share_mailboxes(ctx, lengths: List[int], server: int = 0) -> tuple:
    """(this worker's shared slots with ``server`` or [], on that server every sharing
    worker's by rank): :func:`mpitrain.comm.share_with_server` of slots of ``lengths``
    (:attr:`Layout.lengths`) for ``--shared-memory`` auto or on. Collective over the
    world; every rank calls it once per server, first, in server order."""
    comm, mode = ctx.comm, ctx.cfg.transport.shared_memory
    if mode == "off":
        return [], {}
    worker_ranks = range(ctx.cfg.asynchronous.servers, comm.size)
    host = comm.hosts[server]
    if mode == "on" and any(comm.hosts[r] != host for r in worker_ranks):
        away = sorted({comm.hosts[r] for r in worker_ranks} - {host})
        raise UsageError(f"--shared-memory on needs every worker on rank {server}'s host "
                         f"({host}); workers run on {', '.join(away)}: use --shared-memory "
                         "auto")
    mine, theirs, sharing = share_with_server(comm, lengths, server,
                                              [r for r in worker_ranks if comm.hosts[r] == host])
    if mode == "on" and len(sharing) < len(worker_ranks):
        raise UsageError(f"--shared-memory on: the workers' message memory could not be "
                         f"mapped by rank {server} (no memfd, or /proc/PID/fd not readable): "
                         "use --shared-memory auto")
    return mine, theirs


class Mailbox:
    """A worker's end: its push and lease slots, a persistent send per push slot and a
    persistent receive per lease slot (started once per message, never rebuilt)."""

    def __init__(self, comm, pushes: List[np.ndarray], leases: List[np.ndarray],
                 carried: Optional[int], server: int = 0):
        self.pushes, self.leases, self.carried = pushes, leases, carried
        self.server = server  # the server's rank
        #: a push's payload bytes that moved through shared memory (0: through MPI)
        self.shared_push = (pushes[0].size - SLOTS) * 4 if self.shared else 0
        self.replies = [comm.recv_init(b[:carried], server, TAG_WEIGHTS, "pull",
                                       "new weights from the server") for b in leases]
        self.sends = [comm.send_init(b[:carried], server, TAG_GRADIENT, "push",
                                     "the server to take a gradient") for b in pushes]

    @property
    def shared(self) -> bool:
        return self.carried is not None

    @classmethod
    def open_all(cls, ctx) -> List["Mailbox"]:
        """This worker's mailboxes, one with each server in server order, in shared
        memory where they can be. Collective with :meth:`ServerEnd.open_all` on the
        servers."""
        boxes = []
        for server in range(ctx.cfg.asynchronous.servers):
            layout = Layout.of(ctx, server)
            slots, _ = share_mailboxes(ctx, layout.lengths, server)
            if slots:
                boxes.append(cls(ctx.comm, *layout.split(slots), SLOTS, server))
            else:
                boxes.append(cls(
                    ctx.comm, [new_message(layout.push - SLOTS) for _ in range(layout.depth)],
                    [new_message(layout.lease - SLOTS) for _ in range(layout.depth + 1)], None,
                    server))
        return boxes


class _NotPosted(Pending):
    """:attr:`ServerEnd.posted` while no receive is posted (before the end's first listen,
    once it hung up): done, so that a listen posts one and a cancel has nothing to do;
    tested, it raises, as a test of the None it stands for did: the server waits only
    for the workers it listened to."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(None, "nothing: no receive posted", None, "push")
        self.done = True

    def test(self) -> bool:
        raise RuntimeError("a test of a worker's next push with no receive posted for it")


NOT_POSTED = _NotPosted()


class ServerEnd:
    """The server's end of one worker's mailbox: where the worker's pushes land, the
    replies it is sent, and the requests that move them. Transport only: what the
    server counts about the worker is its :class:`.accounts.WorkerAccount`.

    Its memory (:mod:`.pool`): below the budget, the worker's own buffers, a persistent
    receive into its push buffer and persistent sends from one or two reply buffers;
    above it (``pools``), through MPI, each push received into a buffer the server's
    receive pool lends once the push is there (a matched probe) and each lease sent
    from its reply pool, headers alone from small buffers of its own. In shared memory
    only headers travel, into and from its own small buffers; above the budget the
    server drops a push's pages once it applied them (:meth:`taken`) and writes leases
    through the worker's file (:attr:`release`)."""

    def __init__(self, comm, rank: int, layout: Layout,
                 slots: Optional[PeerSlots] = None, pools: Optional[Pools] = None):
        self.comm, self.rank = comm, rank
        whole = slots is None
        #: pooled through MPI: the pools its pushes land in and its leases leave from
        self.pools = pools if whole else None
        #: pooled in shared memory: its slots, the pages of a push dropped once applied,
        #: leases written through the file
        self.release = slots if pools is not None and not whole else None
        #: its push and lease slots when it shares this host's memory (headers travel)
        self.pushes: Optional[List[np.ndarray]]
        self.leases: Optional[list]  # (arrays; FileWindows with release)
        self.pushes, self.leases = (None, None) if slots is None else layout.split(slots)
        if self.release is not None:
            self.leases = [self.release.window(i)
                           for i in range(layout.depth, len(self.release))]
        own = whole and self.pools is None  # its whole messages in buffers of its own
        self.head = new_message()  # a header alone (pooled: a message without payload)
        #: the message that arrived: [header | gradient | buffers], its header alone
        #: (shared), or (pooled) in whichever buffer the pool lent it
        self.recv = new_message(layout.push - SLOTS) if own else self.head
        #: [header | weights | buffers] reply buffers (the headers alone, shared or
        #: pooled): one, or two for a pipelined worker that pushes again before it took
        #: the last reply
        self.sends = [new_message(layout.lease - SLOTS if own else 0)]
        #: what a reply waits for, in a timeout message (made once: the server replies
        #: thousands of times a second)
        self.takes_weights = f"{comm.name(rank)} to take its weights"
        self.takes_last_reply = f"{comm.name(rank)} to take its last reply"
        self.what = "a gradient"  # what its next message is, in a timeout message
        self.receive = None if self.pools else comm.recv_init(self.recv, rank, TAG_GRADIENT,
                                                                "push", self.what)
        self.replying = [self._reply_op(0)]  # the persistent send of each of ``sends``
        self.sending: List[Optional[Pending]] = [None]  # the pending send from each of ``sends``
        self.last_reply = 0  # which of ``sends`` went last
        #: the started receive of its next push (until the first listen, and once hung
        #: up, NOT_POSTED: typed so, the server's loop tests it with no check for None)
        self.posted: Pending = NOT_POSTED
        self.reply_to = 0  # the lease slot its next reply goes to (its last push said)
        self.reading: Optional[int] = None  # the push slot being applied (release)
        #: pooled: its pushes are left with it, not received, for now (see pause)
        self.paused = False

    @classmethod
    def open_all(cls, ctx) -> Dict[int, "ServerEnd"]:
        """Every worker's end with this server, by rank, shared where the worker shares
        this host's memory, pooled above the budget (:func:`.pool.pooled`). Collective with
        :meth:`Mailbox.open_all` on the workers (and this call on the other servers)."""
        comm, me, ends = ctx.comm, ctx.comm.rank, {}
        worker_ranks = range(ctx.cfg.asynchronous.servers, comm.size)
        for server in range(ctx.cfg.asynchronous.servers):
            layout = Layout.of(ctx, server)
            _, shared = share_mailboxes(ctx, layout.lengths, server)
            if server == me:
                pools = Pools.of(comm, layout.push, layout.lease, len(worker_ranks))
                ends = {r: cls(comm, r, layout, shared.get(r), pools) for r in worker_ranks}
        return ends

    def _reply_op(self, i: int) -> Persistent:
        """The persistent send of reply buffer ``i`` with its weights."""
        return self.comm.send_init(self.sends[i], self.rank, TAG_WEIGHTS, "pull",
                                   self.takes_weights)

    def listen(self, what: Optional[str] = None) -> None:
        """Start the receive of the worker's next push (``what`` it is, if not a gradient),
        unless it is started already (a cut listens early: see .server._Cut)."""
        if what:
            self.what = what
            if self.receive is not None:
                self.receive.what = what
        if self.posted.done or self.posted.failed:  # (NOT_POSTED is done)
            self.posted = self.comm.start(self.receive) if self.pools is None else \
                self.comm.matched_recv(self.rank, TAG_GRADIENT, "push", self.what, self._lend)

    def _lend(self, nbytes: int) -> Optional[np.ndarray]:
        """Pooled: the buffer a message of ``nbytes`` that came is received into (None:
        none yet)."""
        if nbytes <= self.head.nbytes:  # a header alone (a farewell, a lease request)
            buffer = self.head
        elif self.paused:
            return None
        else:
            pools = self.pools
            assert pools is not None  # (only a pooled end's receive lends: see listen)
            lent = pools.receives.lend()
            if lent is None:
                return None
            buffer = lent
        self.recv = buffer
        return buffer

    def pause(self, paused: bool) -> None:
        """Pooled: leave the worker's pushes with it (a header alone is still received)
        while ``paused``: a push held for later would hold a pool buffer (see
        .partition_server's cuts). Elsewhere a push lands in memory of its own anyway."""
        self.paused = paused

    def payload(self, header: Header) -> np.ndarray:
        """The message of the push that arrived (``header``'s): where its worker wrote
        it when they share memory (then its reply goes where the header says)."""
        if self.pushes is None:
            return self.recv
        slot, self.reply_to = slots_of(header.aux)
        push = self.pushes[slot]
        self.reading = slot
        self.comm.traffic.add_recv(SHARED, push.nbytes - SLOTS * 4)
        return push

    def taken(self) -> None:
        """The push that arrived is applied (or will never be): pooled, its buffer goes
        back to the pool, or its shared pages out of this process's memory."""
        if self.release is not None:
            if self.reading is not None:
                self.release.forget(self.reading)
                self.reading = None
        elif self.pools is not None and self.recv is not self.head:
            self.pools.receives.give_back(self.recv)
            self.recv = self.head

    def reply(self, header: Header, lease_writer=None) -> None:
        """Send ``header`` to the worker: with the weights ``lease_writer(lease)`` writes
        (a lease), or alone (a final reply, a dismissal)."""
        if lease_writer is not None and self.pools is not None:
            def write(lease: np.ndarray) -> None:
                header.write(lease)
                lease_writer(lease)
            self.pools.replies.send(self.rank, self.takes_weights, write)
            return
        i = self.last_reply = self._free_reply_buffer()
        send = self.sends[i]
        header.write(send)
        if lease_writer is None:
            self.sending[i] = self.comm.isend(send[:SLOTS], self.rank, TAG_WEIGHTS, "pull",
                                              self.takes_last_reply)
            return
        # (a shared lease slot is free until this reply reaches its worker: see above)
        lease = send if self.leases is None else self.leases[self.reply_to]
        lease_writer(lease)
        if self.leases is not None:
            self.comm.traffic.add_sent(SHARED, lease.nbytes - SLOTS * 4)
        self.sending[i] = self.comm.start(self.replying[i])

    def _free_reply_buffer(self) -> int:
        """A reply buffer whose last reply was taken. A pipelined worker may push again
        before it takes the last reply (it is computing, so the send waits for its next
        MPI call): then a second buffer is made, once; with both busy, the older one's
        reply was taken before the push being answered was sent (the worker has at most
        PIPELINE_DEPTH pushes in flight), so its send completes at once. Slow steps
        (large models) never need the second buffer."""
        for i, sending in enumerate(self.sending):
            if sending is None or sending.test():
                return i
        if len(self.sends) < PIPELINE_DEPTH:
            self.sends.append(np.empty_like(self.sends[0]))
            self.sending.append(None)
            self.replying.append(self._reply_op(len(self.sends) - 1))
            return len(self.sends) - 1
        older = (self.last_reply + 1) % len(self.sends)
        self.comm.wait(self.sending[older], IDLE)
        return older

    def drain(self) -> None:
        """Wait until the worker took every reply sent to it."""
        pending = [p for p in self.sending if p is not None]
        if self.pools is not None:
            pending += self.pools.replies.pending_to(self.rank)
        self.comm.wait_all(pending, IDLE)

    def hang_up(self, tell: bool) -> Optional[Pending]:
        """The worker is lost: its pending receive is cancelled (pooled: a buffer lent to
        it leaves the pool, as do those of its replies still pending) and, if ``tell``
        (its process is still there), a FINAL|DROPPED reply sent in case it comes back
        (it then leaves). Returns that reply's send, or None."""
        self.comm.cancel(self.posted, peer_lost=True)
        self.posted = NOT_POSTED
        if self.pools is not None:
            if self.recv is not self.head:  # (MPI may still write into it)
                self.pools.receives.lose(self.recv)
                self.recv = self.head
            self.pools.replies.forget(self.rank)
        else:
            self.taken()  # (shared: the pages of a push being read)
        if not tell:
            return None
        dismissal = Header(flags=FINAL | DROPPED).write(new_message())
        return self.comm.isend(dismissal, self.rank, TAG_WEIGHTS, "control",
                               f"{self.comm.name(self.rank)} to take its dismissal")
