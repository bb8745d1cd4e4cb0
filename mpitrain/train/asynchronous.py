"""Asynchronous parameter-server training (``--async``), with bounded staleness.

Rank 0 (the server) holds the canonical weights as one flat float32 vector and
applies each worker's gradient the moment it arrives, in arrival order, with a
numpy optimizer (:mod:`.optim`); it never runs TensorFlow in its protocol loop,
so it needs microseconds per update and sleeps in between (see
:class:`mpitrain.comm.Backoff`). Evaluation runs in a background thread on a
snapshot of the weights, so it never stalls the workers.

Protocol, per worker (all messages on the world communicator, numpy buffers
with the header of :mod:`.protocol` in front, mpi4py uppercase methods):

1. The worker waits for a **lease**: the server's reply ``[header | weights]``
   on ``TAG_WEIGHTS``; the header carries the weights' version (the server's
   update count when they were sent).
2. It computes the gradient of its next batch at those weights (one compiled
   call) and pushes ``[header | gradient]`` with ``Isend`` on ``TAG_GRADIENT``;
   the header carries the version the gradient was computed at, the step, the
   loss, and FINAL on its last batch. The ``Irecv`` for the reply is posted
   before the push.
3. The server applies the gradient (staleness = server version - that
   version, recorded per worker), replies with a new lease when the staleness
   bound allows (immediately when unbounded), and re-posts its ``Irecv`` for
   that worker. A FINAL push gets a header-only reply and ends that worker.

Bounded staleness (``--staleness K``): the server grants a lease only while
every lease holder would still see its gradient applied with staleness <= K
(:class:`~mpitrain.train.leases.Leases`); K = 0 is synchronous training one
worker at a time, no K (the default) never holds anyone.

Termination: the server ends when every worker's FINAL push is applied; every
push has been matched by a receive and every reply received, so no request is
pending at MPI_Finalize. Every wait is bounded: the server names a lease holder
that stays silent for ``--timeout`` seconds; a worker waits at most twice that
for its reply (the server speaks first about a stalled peer).

Lost workers (only under ``mpirun --enable-recovery``, which keeps the other ranks
alive when one dies): a lease holder whose process is gone (seen directly on the
server's host) or that stays silent past its liveness bound
(:class:`~mpitrain.train.leases.Liveness`: 20x its measured step interval, at least
``--liveness-floor`` (10 s), at most ``--timeout``) is dropped: its pending receive
is cancelled, it gets a FINAL|DROPPED reply in case it comes back (it then exits
with a message), and its remaining steps are reassigned to the workers still
training (:class:`~mpitrain.train.leases.Quotas`), who run extra passes over their
own shards, so the run still makes its planned number of updates; the lost worker's
shard is not visited after its loss (recorded as ``lost_workers`` in runs.csv and
status.json). Each reply carries the steps the receiving worker runs beyond its own
(those reassigned to it), so it knows when to push FINAL. A lost worker on the
server's host still alive ``FENCE_GRACE`` (5 s) after it was dropped is killed (a
SIGSTOPped one would keep mpirun waiting); on another host it is named. A worker on the
server's host stops (CommTimeout) within a second of the server's process dying, so
``mpitrain launch`` restarts the run then, not after the worker's reply bound. Without
``--enable-recovery`` mpirun ends the job when a rank dies and a silent worker is a
CommTimeout, as before.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ..models import optim
from ..comm import (HOT, IDLE, SERVING, Backoff, PeerProcesses, Role, recovery_enabled,
                    share_with_server, shares_with_server)
from ..errors import CommTimeout, Divergence, Dropped, Interrupted, UsageError
from ..lifecycle import Checkpoint, optimizer_mismatch
from ..schema import STALENESS_COLUMNS
from .compression import PushCodec
from .context import Context, Summary, diverged, interrupted, worker_batches
from .evaluation import BackgroundEvaluator, Evaluator, Stopwatch
from .leases import Leases, Liveness, Pipelining, Quotas, first_look
from .priority import niceness
from .protocol import (DIVERGED, DROPPED, FAREWELL, FINAL, INTERRUPTED, PIPELINED, SLOTS,
                       TAG_GRADIENT, TAG_WEIGHTS, Header, SilentPeers, new_message, sentinel,
                       slots_of, slots_word, stalled)

#: workers whose steps take less than this (EWMA) make the server poll, not sleep
FAST_STEP = 2e-4
#: how the server polls then: yield for a round trip's worth, then sleep
POLLING = Backoff(yield_for=3e-4, first_sleep=SERVING.first_sleep, max_sleep=SERVING.max_sleep)


def train(ctx: Context) -> Summary:
    """Run async training on this rank. Collective: every rank of the world calls it."""
    clock = Stopwatch()
    if ctx.role is Role.SERVER:
        return Server(ctx, clock).run()
    comm = ctx.comm
    # under --enable-recovery the server's death does not end the job: a worker on its
    # host sees it directly and stops, instead of waiting out its reply bound
    comm.while_waiting = PeerProcesses(comm, [0]).watch(0, "the parameter server") \
        if recovery_enabled() else None
    try:
        return _work(ctx, clock)
    finally:
        comm.while_waiting = None


# ---------------------------------------------------------------------------------------
# Message buffers
# ---------------------------------------------------------------------------------------
#: pushes a worker may have in flight under unbounded staleness (see _work)
PIPELINE_DEPTH = 2
#: the traffic table's kind for payload bytes that moved through shared memory
SHARED = "shared"


class Mailbox(NamedTuple):
    """A worker's message buffers, as it and the server see them.

    ``pushes``: [header | gradient | buffers], one per push it may have in flight;
    ``leases``: [header | weights | buffers], one more (the one in use). Where the
    worker shares the server's host (``--shared-memory``), they lie in memory both
    map (:func:`mpitrain.comm.share_with_server`): the worker computes from the
    lease the server wrote in place and the server applies the gradient where the
    worker wrote it, and only the header travels through MPI (``carried`` =
    SLOTS; else None: the whole message). A push's header then names its push
    slot and the lease slot its reply goes to (:func:`.protocol.slots_word`). Each
    slot has one owner at a time, as an MPI buffer does: a push slot is the
    server's from its header's send until its reply is taken, a lease slot from
    the push that names it until its reply comes.
    """

    pushes: List[np.ndarray]
    leases: List[np.ndarray]
    carried: Optional[int]

    @property
    def shared(self) -> bool:
        return self.carried is not None


def _mailbox_shape(ctx: Context) -> List[int]:
    """Float32 lengths of a worker's push slots, then of its lease slots (the same on
    every rank: the server maps the workers' slots)."""
    replica = ctx.replica
    most = 1 if _pipelining_mode(ctx.cfg) == "off" else PIPELINE_DEPTH
    push = SLOTS + PushCodec(ctx.cfg.compression, replica.n_params).slots + replica.n_buffers
    return [push] * most + [SLOTS + replica.n_state] * (most + 1)


def _pipelining_mode(cfg) -> str:
    return "off" if cfg.staleness is not None else cfg.pipeline


def _pushes_and_leases(seq: list) -> Tuple[list, list]:
    """A worker's push slots and its lease slots (one more than pushes), from ``seq``
    laid out as :func:`_mailbox_shape` (lengths, or the slots themselves)."""
    most = (len(seq) - 1) // 2
    return seq[:most], seq[most:]


def _share_mailboxes(ctx: Context, shape: List[int]) -> tuple:
    """(this worker's shared slots or [], on the server every sharing worker's by
    rank): :func:`mpitrain.comm.share_with_server` of slots of ``shape``
    (:func:`_mailbox_shape`) for ``--shared-memory`` auto or on. Collective over the
    world; the server and every worker call it once, first."""
    comm, mode = ctx.comm, ctx.cfg.shared_memory
    if mode == "off":
        return [], {}
    if mode == "on" and len(shares_with_server(comm)) < comm.size - 1:
        away = sorted({comm.hosts[r] for r in range(1, comm.size)} - {comm.hosts[0]})
        raise UsageError(f"--shared-memory on needs every worker on rank 0's host "
                         f"({comm.hosts[0]}); workers run on {', '.join(away)}: use "
                         f"--shared-memory auto")
    mine, theirs, sharing = share_with_server(comm, shape)
    if mode == "on" and len(sharing) < comm.size - 1:
        raise UsageError("--shared-memory on: the workers' message memory could not be "
                         "mapped by rank 0 (no memfd, or /proc/PID/fd not readable): use "
                         "--shared-memory auto")
    return mine, theirs


def _worker_mailbox(ctx: Context) -> Mailbox:
    shape = _mailbox_shape(ctx)
    slots, _ = _share_mailboxes(ctx, shape)
    if slots:
        return Mailbox(*_pushes_and_leases(slots), SLOTS)
    pushes, leases = _pushes_and_leases(shape)
    return Mailbox([new_message(n - SLOTS) for n in pushes],
                   [new_message(n - SLOTS) for n in leases], None)


# ---------------------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------------------


class _InFlight(NamedTuple):
    """One push of a worker that the server has not answered yet (as the worker knows)."""

    reply: object  # the pending receive of the server's reply
    push: object  # the pending send of the push (None: the initial lease, no push)
    lease: int  # the lease buffer the reply lands in


def _work(ctx: Context, clock: Stopwatch) -> Summary:
    """The worker loop: compute at the lease's weights, push, take the next lease.

    Pipelined (``--pipeline``: :class:`.leases.Pipelining` decides, from the first
    steps' wait for a reply against their compute), communication is hidden behind
    compute: up to PIPELINE_DEPTH (2) pushes are in flight, so the worker computes
    gradient k+1 at the weights it already has while push k and its reply
    travel, and pushes k+1 without waiting for reply k; before each push it
    takes every reply already in (the newest weights), and waits for the
    oldest only when the pipeline is full. Two push buffers and three lease
    buffers rotate, so no reply lands in the weights being used and no push
    buffer changes while it is sent. Otherwise the worker waits for each reply
    (always with --staleness K: one gradient per lease, which the server's bound
    accounting relies on). Its pushes say whether it pipelines (PIPELINED), for
    the server's poll policy.

    A worker's last message is always a FINAL push: its last step's, or, when
    the server dismissed it (the run is stopping, or a resumed worker had its
    steps done), a FINAL|FAREWELL push without a gradient, sent after the
    pushes it had in flight; the server listens to it until then, so no push is
    left unmatched.
    """
    comm, replica, n = ctx.comm, ctx.replica, ctx.replica.n_params
    pipelining = Pipelining(_pipelining_mode(ctx.cfg))
    depth = pipelining.depth
    codec = PushCodec(ctx.cfg.compression, n)
    box = _worker_mailbox(ctx)
    pushes, leases, carried = box  # carried: None (all of a message) or its header
    shared_push = (pushes[0].size - SLOTS) * 4 if box.shared else 0  # bytes
    reply_bound = 2 * comm.timeout
    current, flight, timer = 0, collections.deque(), ctx.timer
    total_steps = ctx.total_steps  # (a property: read once, not per step)
    # one persistent receive per lease buffer, one persistent send per push buffer
    replies = [comm.recv_init(b[:carried], 0, TAG_WEIGHTS, "pull",
                              "new weights from the server") for b in leases]
    sends = [comm.send_init(b[:carried], 0, TAG_GRADIENT, "push",
                            "the server to take a gradient") for b in pushes]
    flight.append(_InFlight(comm.start(replies[0]), None, 0))  # the initial weights
    # what the lease in use says: its version, the step to resume from (> 0 when
    # resuming), whether the server is stopping (flags), steps of lost workers given
    # to this one (extra: its FINAL push comes at its own last step plus those)
    current, lease = _take_reply(comm, flight, box, IDLE, reply_bound)
    start_step = step = lease.step
    flags = 0  # of this worker's last push
    if replica.n_buffers:  # the statistics the run has so far (a resumed run's)
        replica.set_buffers(leases[0][SLOTS + n:])
    timer.restart()
    for _, step, x, y, end_of_epoch in ([] if lease.flags else worker_batches(
            ctx, start_step, endless=True)):
        started = time.perf_counter()  # (preparing the batch is compute too)
        grad, loss, norm = replica.grad_at(leases[current][SLOTS:SLOTS + n], x, y)
        think = time.perf_counter() - started  # lets the server pick its poll policy
        version = lease.version
        # the replies already in, the oldest one anyway when the pipeline is full
        # (the phases marked with timer.lap, not `with timer(...)`: a block costs more,
        # and with no compute at all this loop runs tens of thousands of times a second)
        while flight and (len(flight) >= depth or flight[0].reply.test()) \
                and not lease.flags:
            timer.lap()
            current, lease = _take_reply(comm, flight, box, HOT, reply_bound)
            timer.lap("wait")
        health = sentinel(loss, norm)
        if lease.flags:  # the server is stopping: this gradient is not wanted
            break
        flags = _push_flags(ctx, step, total_steps + lease.extra, health)
        slot = step % depth
        push = pushes[slot]  # (its last send completed with its reply)
        codec.encode(grad, push[SLOTS:SLOTS + codec.slots])
        if replica.n_buffers:  # this worker's statistics travel with each push
            push[SLOTS + codec.slots:] = replica.buffers()
        # a lease buffer nobody uses (one push at most is still in flight here)
        target = _free_lease(current, flight[0].lease if flight else None)
        Header(version, step, flags | (PIPELINED if depth > 1 else 0), health, clock(),
               think, 0, slots_word(slot, target)).write(push)
        timer.lap()
        flight.append(_InFlight(comm.start(replies[target]), comm.start(sends[slot]), target))
        timer.lap("comm")
        if shared_push:
            comm.traffic.add_sent(SHARED, shared_push)
        if depth == 1:
            waited = time.perf_counter()
            with timer("wait"):
                current, lease = _take_reply(comm, flight, box, HOT, reply_bound)
            depth = pipelining.observe(think, time.perf_counter() - waited)
        if end_of_epoch or flags & FINAL:
            timer.end_epoch(round(step / ctx.steps_per_epoch, 4))
        if flags & FINAL or lease.flags:
            break
    ending = lease.flags
    while flight and not ending & DROPPED:
        ending |= _take_reply(comm, flight, box, IDLE, reply_bound)[1].flags
    if ending & DROPPED:
        for f in flight:  # the server will not answer these: their receives must go
            comm.cancel(f.reply)
        raise Dropped(f"{comm.name(comm.rank)} was dropped by the parameter server after it "
                      "stopped answering; the run went on without it (this process leaves)")
    if not flags & FINAL:  # dismissed: say the last word, so the server stops listening
        ending |= _farewell(comm, pushes[0], leases[current], reply_bound)
    if ending & DIVERGED:
        raise Divergence("training diverged (see rank 0's message)", everywhere=True)
    if ending & INTERRUPTED:
        raise Interrupted("stopped (see rank 0's message)", everywhere=True)
    nan = float("nan")
    return Summary(clock(), step, step / ctx.steps_per_epoch, nan, nan, nan)


def _take_reply(comm, flight, box: Mailbox, backoff: Backoff,
                bound: float) -> Tuple[int, Header]:
    """Complete the oldest push in ``flight``: wait for its reply, then for the push
    itself (None for the initial lease), unless the reply dismisses this worker as
    lost (DROPPED: the server cancelled its receive, so that push is never taken; a
    pending send to a live rank does not stop MPI_Finalize). Returns the lease
    buffer the reply is in, and the reply's header."""
    oldest = flight.popleft()
    comm.wait(oldest.reply, backoff, timeout=bound)
    lease = box.leases[oldest.lease]
    header = Header.read(lease)
    if oldest.push is not None and not header.flags & DROPPED:
        comm.wait(oldest.push, backoff, timeout=bound)
    if box.shared and not header.flags & FINAL:  # the weights the server wrote in place
        comm.traffic.add_recv(SHARED, (lease.size - SLOTS) * 4)
    return oldest.lease, header


def _free_lease(current: int, in_flight: Optional[int]) -> int:
    """The first lease buffer that is neither the one in use (``current``) nor awaited
    by the push in flight (``in_flight``, None if none): of two buffers when a worker
    keeps one push in flight at most, of three when two (PIPELINE_DEPTH)."""
    for i in range(PIPELINE_DEPTH + 1):
        if i != current and i != in_flight:
            return i
    raise AssertionError("three lease buffers, two of them busy at most")


def _farewell(comm, message: np.ndarray, reply: np.ndarray, bound: float) -> int:
    """A dismissed worker's last push (FINAL|FAREWELL, no gradient; into the free
    ``message``) and the server's answer (into ``reply``); returns its flags."""
    Header(flags=FINAL | FAREWELL).write(message)
    answer = comm.irecv(reply[:SLOTS], 0, TAG_WEIGHTS, "pull", "the server's last reply")
    comm.wait(comm.isend(message[:SLOTS], 0, TAG_GRADIENT, "push",
                         "the server to take this worker's farewell"), IDLE, timeout=bound)
    comm.wait(answer, IDLE, timeout=bound)
    return Header.read(reply).flags


def _push_flags(ctx: Context, step: int, quota: int, loss: float) -> int:
    """FINAL on the last step (``quota``); also INTERRUPTED on a stop request, DIVERGED
    on NaN/Inf."""
    flags = FINAL if step >= quota else 0
    if ctx.stop:
        flags |= FINAL | INTERRUPTED
    if not math.isfinite(loss):
        flags |= FINAL | DIVERGED
    return flags


#: seconds between the server's checks of its silent workers under --enable-recovery
LIVENESS_CHECK_EVERY = 1.0
#: seconds a dropped worker on the server's host gets to come back and leave by itself
#: before the server kills it (a SIGSTOPped rank never woken would hold mpirun forever)
FENCE_GRACE = 5.0
# ---------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------
@dataclass
class WorkerLedger:
    """What the server knows about one worker."""

    rank: int
    recv: np.ndarray  # [header | gradient | buffers] receive buffer (the header, shared)
    #: [header | weights | buffers] reply buffers: one, or two for a pipelined worker
    #: that pushes again before it has taken the last reply (see _reply)
    sends: List[np.ndarray]
    posted: object = None  # the started receive of its next push (``receive``)
    #: the pending Isend of the last reply from each of ``sends``, and which was last
    sending: List[object] = field(default_factory=lambda: [None])
    #: the persistent receive of its pushes, and the persistent send of each of ``sends``
    #: (whole, or its header where the weights are shared)
    receive: object = None
    replying: List[object] = field(default_factory=list)
    last_reply: int = 0
    applied: int = 0
    dismissed: bool = False  # told to stop; listened to until its FINAL push
    steps: int = 0
    start_step: int = 0  # steps done before this session (a resumed run)
    elapsed: float = 0.0
    done: bool = False
    pipelined: bool = False  # its last push said it keeps a second one in flight
    staleness: collections.Counter = field(default_factory=collections.Counter)
    buffers: Optional[np.ndarray] = None  # its BatchNorm statistics at its latest push
    lost: str = ""  # why it was dropped (under --enable-recovery); "" while it is in
    farewell: object = None  # the pending FINAL|DROPPED reply of a dropped worker
    fence_at: float = 0.0  # when the server kills it if it is still alive (its host only)
    fenced: bool = False
    #: what a reply waits for, in a timeout message (made once: the server replies
    #: thousands of times a second)
    takes_weights: str = ""
    takes_last_reply: str = ""
    #: its Mailbox's slots when it shares this host's memory (only headers travel)
    pushes: Optional[List[np.ndarray]] = None
    leases: Optional[List[np.ndarray]] = None
    reply_to: int = 0  # the lease slot its next reply goes to (its last push said)


class Server:
    """Rank 0 in async mode: applies gradients in arrival order, grants leases, evaluates."""

    def __init__(self, ctx: Context, clock: Stopwatch):
        self.ctx, self.clock, self.comm = ctx, clock, ctx.comm
        n = ctx.replica.n_params
        self.weights = ctx.replica.weights()
        self.buffers = ctx.replica.buffers()  # the workers' mean at the last evaluation
        self.optimizer = optim.make(ctx.cfg.optimizer, n, ctx.cfg.effective_lr,
                                    ctx.decay_steps, ctx.cfg.clip_grad_norm)
        self.version = 0
        self.ending = 0  # INTERRUPTED and/or DIVERGED once the run must stop early
        self.diverged_at: List[str] = []
        self.codec = PushCodec(ctx.cfg.compression, n)
        self.workers = self._ledgers(ctx)
        self.leases = Leases(ctx.cfg.staleness, self.workers)
        #: workers told to stop whose FINAL push has not come yet (see _dismiss)
        self.dismissed: List[int] = []
        # a worker's silence starts when it is granted a lease (then it owes a push)
        self.silence = SilentPeers(self.comm, self.workers)
        self.updates_per_epoch = len(self.workers) * ctx.steps_per_epoch
        self.eval_interval = ctx.cfg.eval_every * self.updates_per_epoch
        self.losses: List[float] = []  # since the last evaluation
        self.last_loss = float("nan")
        self.evaluations = BackgroundEvaluator(Evaluator(
            ctx, clock, self.updates_per_epoch, ctx.cfg.batch_size,
            len(self.workers) * ctx.total_steps))
        self.step_time = 1.0  # EWMA of the workers' reported seconds of compute per step
        self.last_think = 1.0  # the last push's
        self.checkpoint_interval = ctx.cfg.checkpoint_every * self.updates_per_epoch
        # --checkpoint-steps counts each worker's steps: N of theirs are N x workers updates
        self.checkpoint_steps = (ctx.cfg.checkpoint_steps or 0) * len(self.workers)
        self.recovery = recovery_enabled() and len(self.workers) > 1
        self.liveness = Liveness(self.comm.timeout, floor=ctx.cfg.liveness_floor)
        self.total_steps = ctx.total_steps  # (a property: read once, not per reply)
        self.quotas = Quotas(self.workers, self.total_steps)
        self.processes = PeerProcesses(self.comm) if self.recovery else None
        self.next_liveness_check = 0.0
        self.training = len(self.workers)  # workers not done (see _retire)
        if ctx.resume_from is not None:
            self._restore(ctx.resume_from)

    def _ledgers(self, ctx: Context) -> Dict[int, WorkerLedger]:
        """Every worker's ledger, with its receive and reply buffers: whole messages, or
        headers where it shares this host's memory (:class:`Mailbox`)."""
        shape = _mailbox_shape(ctx)
        _, shared = _share_mailboxes(ctx, shape)
        ledgers = {}
        for r in range(1, self.comm.size):
            slots = shared.get(r)
            whole = slots is None
            pushes, leases = (None, None) if whole else _pushes_and_leases(slots)
            ledgers[r] = WorkerLedger(
                r, new_message(shape[0] - SLOTS if whole else 0),
                [new_message(shape[-1] - SLOTS if whole else 0)],
                takes_weights=f"{self.comm.name(r)} to take its weights",
                takes_last_reply=f"{self.comm.name(r)} to take its last reply",
                pushes=pushes, leases=leases)
            ledgers[r].receive = self.comm.recv_init(ledgers[r].recv, r, TAG_GRADIENT, "push",
                                                     "a gradient")
            ledgers[r].replying.append(self._reply_op(ledgers[r], 0))
        return ledgers

    def _reply_op(self, w: WorkerLedger, i: int):
        """The persistent send of ``w``'s reply buffer ``i`` with its weights."""
        return self.comm.send_init(w.sends[i], w.rank, TAG_WEIGHTS, "pull", w.takes_weights)

    def _restore(self, ckpt: Checkpoint) -> None:
        self.clock.offset = ckpt.wall_time_s  # the run's clock goes on, as a sync run's does
        self.weights = ckpt.weights.astype(np.float32).copy()
        if ckpt.buffers.size:
            self.buffers = ckpt.buffers.astype(np.float32).copy()
        mismatch = optimizer_mismatch(ckpt.optimizer, self.optimizer.layout(),
                                      self.ctx.cfg.resume)
        if mismatch is not None:
            mismatch.everywhere = False  # the server alone knows: it reports, ends the job
            raise mismatch
        self.optimizer.load_state(ckpt.optimizer)
        self.version = ckpt.step
        extra = ckpt.extra.get("extra_steps", {})  # relative: --epochs may change on resume
        for rank, w in self.workers.items():
            w.start_step = w.steps = ckpt.worker_steps.get(rank, 0)
            for s, c in ckpt.extra.get("staleness", {}).get(str(rank), {}).items():
                w.staleness[int(s)] += c
            self.quotas.of[rank] += extra.get(str(rank), 0)
        self.quotas.short = ckpt.extra.get("updates_short", 0)
        self.ctx.lost.extend(ckpt.extra.get("lost_workers", []))

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.weights.copy(), self.optimizer.state(), self.version,
                          self.clock(), {w.rank: w.steps for w in self.workers.values()},
                          {"staleness": {str(w.rank): dict(w.staleness)
                                         for w in self.workers.values()},
                           "extra_steps": {str(r): q - self.ctx.total_steps
                                           for r, q in self.quotas.of.items()},
                           "updates_short": self.quotas.short,
                           "lost_workers": list(self.ctx.lost),
                           "geometry": self.ctx.geometry},
                          self._average_buffers())

    def _average_buffers(self) -> np.ndarray:
        """The mean of the workers' latest BatchNorm statistics (each worker's follow its
        own batches); kept as the server's until the next evaluation or checkpoint."""
        latest = [w.buffers for w in self.workers.values() if w.buffers is not None]
        if latest:
            self.buffers = np.mean(latest, axis=0, dtype=np.float64).astype(np.float32)
        return self.buffers.copy()

    def _state(self) -> np.ndarray:
        """A snapshot to evaluate: the weights and the averaged statistics."""
        buffers = self._average_buffers()
        return np.concatenate([self.weights, buffers]) if buffers.size else self.weights.copy()

    # ---- the loop ---------------------------------------------------------------------
    def run(self) -> Summary:
        if self.ctx.resume_from is None:
            self.evaluations.submit(0, self._state(), None, 0.0)
        cpu0, loop_cpu0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        timer = self.ctx.timer
        self._grant_leases()
        timer.restart()
        # (the phases marked with timer.lap, not `with timer(...)`: the loop runs tens of
        # thousands of times a second when workers push zeros, and a block costs more)
        while self.training:
            if self.ctx.stop and not self.ending:
                self.ending |= INTERRUPTED
                self._grant_leases()  # releases the waiting workers
                continue
            timer.lap()
            worker = self._next_push()
            timer.lap("wait")
            if worker is None:  # a worker was dropped instead
                continue
            self._apply(worker)
            timer.lap()
            self._grant_leases()
            timer.lap("comm")
            if self.version % self.updates_per_epoch == 0:
                timer.end_epoch(self.version // self.updates_per_epoch)
            if self.version % 64 == 0:
                self.evaluations.evaluator.progress(self.version, self.last_loss)
        for w in self.workers.values():
            # a lost worker's last reply may never be taken; Open MPI finalizes with it
            # pending (measured)
            if not w.lost:
                self.comm.wait_all([p for p in w.sending if p is not None], IDLE)
        self._fence_lost(at_end=True)
        wall = self.clock()
        span = max(1e-9, time.perf_counter() - t0)
        cpu_share = {"server_cpu_share": round((time.process_time() - cpu0) / span, 4),
                     "server_loop_cpu_share": round((time.thread_time() - loop_cpu0) / span, 4),
                     "server_nice": niceness()}  # (it keeps its priority: .priority)
        if not self.ending & DIVERGED:
            self._evaluate_and_save(self.evaluations.last_step != self.version, True, wall)
        self.evaluations.close()
        summary = self._summary(wall, cpu_share)
        self._raise_if_ending(summary)
        return summary

    def _raise_if_ending(self, summary: Summary) -> None:
        if self.ending & DIVERGED:
            raise diverged(", ".join(self.diverged_at), summary)
        if self.ending & INTERRUPTED:
            raise interrupted(self.ctx, f"after {self.version} updates", summary)

    def _next_push(self) -> Optional[WorkerLedger]:
        """The next worker whose push arrived; None when a lost worker was dropped
        instead (only under --enable-recovery)."""
        holders = self.leases.holders  # who owes a push (a new list)
        if self.dismissed:
            holders += self.dismissed
        if self.recovery and time.monotonic() >= self.next_liveness_check:
            # also while the others push: one silent worker among busy ones is the case
            self.next_liveness_check = time.monotonic() + LIVENESS_CHECK_EVERY
            self._fence_lost()
            lost = self.silence.lost({r: self.workers[r].posted for r in holders},
                                     self.liveness, self.processes.alive)
            if lost is not None:
                rank, why = lost
                self._drop(self.workers[rank], why)
                return None
        for rank in holders:  # a push already here (the usual case when workers are
            w = self.workers[rank]  # busy): taken without setting up a wait
            if w.posted.test():
                return self._arrived(w)
        rank = self.silence.first({r: self.workers[r].posted for r in holders},
                                  self._poll_policy(holders),  # recovery: wake for the next check
                                  wake_every=LIVENESS_CHECK_EVERY if self.recovery else None,
                                  tested=True)  # (just above)
        if rank is not None:
            return self._arrived(self.workers[rank])
        late = None if self.recovery else self.silence.overdue(holders)  # else: dropped above
        if late is not None:
            raise stalled(self.comm, late, f"has not pushed a gradient for "
                                           f"{self.comm.timeout:g} s")
        return None

    def _arrived(self, w: WorkerLedger) -> WorkerLedger:
        if self.recovery:  # its push interval is what its liveness bound is made of
            self.liveness.observe(w.rank, self.silence.silent_for(w.rank))
        return w

    def _drop(self, w: WorkerLedger, why: str) -> None:
        """Go on without ``w``: no request of its left to match, its steps reassigned."""
        self.comm.cancel(w.posted, peer_lost=True)
        self.leases.drop(w.rank)
        if w.dismissed:
            self.dismissed.remove(w.rank)
        w.posted, w.lost = None, why
        self._retire(w)
        w.fence_at = time.monotonic() + FENCE_GRACE
        if self.processes.alive(w.rank):  # stalled: if it comes back, it must leave
            farewell = Header(flags=FINAL | DROPPED).write(new_message())
            w.farewell = self.comm.isend(farewell, w.rank, TAG_WEIGHTS, "control",
                                         f"{self.comm.name(w.rank)} to take its dismissal")
        active = [r for r, v in self.workers.items() if not v.done]
        gained = self.quotas.reassign(w.rank, w.steps, active)
        self.ctx.lost.append({"rank": w.rank, "host": self.comm.hosts[w.rank],
                              "update": self.version, "step": w.steps,
                              "wall_time_s": round(self.clock(), 3), "reason": why})
        moved = (f"its {sum(gained.values())} remaining steps go to "
                 + ", ".join(f"rank {r}" for r in gained) if gained else
                 f"{self.quotas.short} planned updates will not be made")
        going_on = (f"training continues with {len(active)} worker(s)" if active else
                    "the other workers have finished")
        self.ctx.console.note(
            f"lost {self.comm.name(w.rank)} at update {self.version}: {why}; {moved}; "
            + going_on)
        self.ctx.results.set_status("running", lost_workers=self.ctx.lost)
        if all(v.lost for v in self.workers.values()):
            raise CommTimeout(f"every worker was lost (the last: {self.comm.name(w.rank)}, "
                              f"{why})")
        self._grant_leases()  # its lease no longer holds the others back (--staleness)

    def _fence_lost(self, at_end: bool = False) -> None:
        """Kill lost workers still alive on this host ``FENCE_GRACE`` seconds after they
        were dropped, or at the end (stopped ones would keep mpirun waiting for them
        forever); name those on other hosts."""
        now = time.monotonic()
        for w in self.workers.values():
            if w.fenced or not w.lost or not (at_end or now >= w.fence_at):
                continue
            w.fenced = True
            if not self.processes.alive(w.rank):
                continue
            if self.processes.kill(w.rank):
                self.ctx.console.note(f"killed lost {self.comm.name(w.rank)} (pid "
                                      f"{self.comm.pids[w.rank]}): it was still alive "
                                      f"{FENCE_GRACE:g} s after it was dropped")
            else:
                self.ctx.console.note(
                    f"lost {self.comm.name(w.rank)} may still be alive (pid "
                    f"{self.comm.pids[w.rank]} there): if the job does not end, kill it")

    def _poll_policy(self, holders) -> Backoff:
        """Yield-poll when workers' steps are shorter than FAST_STEP, else sleep.

        When a worker's step (its compute between pushes, which it reports)
        is shorter than the server's sleep, every sleep would add its whole
        length to each update; when steps are long, polling would burn the CPU
        the workers need and the pipeline hides a sleep behind their compute.
        Measured: workers pushing zeros: 1.6k updates/s at -np 2 sleeping, 24k
        polling (bench async_ps).

        Pipelined workers (their pushes say PIPELINED) need the reply to push k only
        when they would push k+2, two steps after push k: so the server's first
        sleep lasts until two steps after the oldest lease it is owed a push for
        (:func:`.leases.first_look`; that push is then in, and its reply still a
        step early), instead of waking every 0.5-1 ms to find nothing. Measured,
        async LR: protocol loop at -np 3 12.8-13.7% -> 10.2-10.7% of a core, at
        -np 4 12.7-14.0% -> 9.1-9.3%, the same epoch time; looking after 3 steps,
        8.5-8.8% but 18% slower (replies late). A worker that does not pipeline
        (bounded staleness, --pipeline, or its first steps) waits for each reply,
        so the server sleeps less.
        """
        if self.step_time < FAST_STEP:
            return POLLING
        if not all(self.workers[r].pipelined for r in holders):
            return SERVING
        # (the smaller of the mean and the last: a slow first step, which traces the
        # model, must not hold the mean up for the next twenty)
        first = first_look(min(self.silence.since[r] for r in holders),
                           min(self.step_time, self.last_think), time.monotonic())
        if first <= SERVING.first_sleep:
            return SERVING
        return Backoff(0.0, first_sleep=first, max_sleep=SERVING.max_sleep)

    def _apply(self, w: WorkerLedger) -> None:
        header = Header.read(w.recv)
        flags = header.flags
        if flags & FAREWELL:  # a dismissed worker's last word: nothing to apply
            self._finish(w)
            return
        w.steps, w.elapsed, w.pipelined = header.step, header.elapsed, bool(flags & PIPELINED)
        if not w.dismissed:  # (a dismissed worker's pushes were sent before it knew)
            self.leases.returned(w.rank)
        if flags & DIVERGED or not math.isfinite(header.loss):
            self.ending |= DIVERGED  # never apply a non-finite gradient
            self.diverged_at.append(f"{self.comm.name(w.rank)} at its step {w.steps}")
            self._finish(w)
            return
        self.ending |= flags & INTERRUPTED
        staleness = self.version - header.version
        w.staleness[staleness] += 1
        push = w.recv
        if w.pushes is not None:  # the push is where its worker wrote it
            slot, w.reply_to = slots_of(header.aux)
            push = w.pushes[slot]
            self.comm.traffic.add_recv(SHARED, push.nbytes - SLOTS * 4)
        end = SLOTS + self.codec.slots
        self.optimizer.step(self.weights, self.codec.decode(push[SLOTS:end]))  # clips first
        if push.size > end:
            w.buffers = push[end:].copy()
        self.version += 1
        w.applied += 1
        self.step_time = 0.8 * self.step_time + 0.2 * header.think
        self.last_think = header.think
        self.last_loss = header.loss
        self.losses.append(self.last_loss)
        if flags & FINAL:
            if not self.ending and w.steps < self.quotas.of[w.rank]:  # a raise it never saw
                self.quotas.reassign(w.rank, w.steps,
                                     [r for r, v in self.workers.items()
                                      if not v.done and r != w.rank])
            self._finish(w)
        elif w.dismissed:  # one it had in flight: told again, listened to until FINAL
            self._dismiss(w)
        else:
            self.leases.wait(w.rank)
        version = self.version
        evaluate = version % self.eval_interval == 0
        save = version % self.checkpoint_interval == 0 or bool(
            self.checkpoint_steps and version % self.checkpoint_steps == 0)
        if evaluate or save:
            self._evaluate_and_save(evaluate, save, self.clock())

    def _evaluate_and_save(self, evaluate: bool, save: bool, wall: float) -> None:
        """Queue the current version's evaluation and/or checkpoint (written meanwhile)."""
        checkpoint = self.checkpoint() if save else None
        if evaluate:
            self.evaluations.submit(self.version, self._state(), self._train_loss(), wall,
                                    checkpoint)
        elif checkpoint is not None:
            self.evaluations.save(checkpoint)

    def _train_loss(self) -> Optional[float]:
        loss = float(np.mean(self.losses)) if self.losses else None
        self.losses.clear()
        return loss

    # ---- leases -----------------------------------------------------------------------
    def _grant_leases(self) -> None:
        for rank in self.leases.next_waiting(self.version, force=bool(self.ending)):
            w = self.workers[rank]
            if self.ending or (w.applied == 0 and w.steps >= self.quotas.of[rank]):
                self._dismiss(w)  # stopping, or resumed with its steps done: no lease
                continue
            self.leases.grant(rank, self.version)
            self.silence.heard(rank)
            w.posted = self.comm.start(w.receive)
            self._reply(w, with_weights=True)

    def _dismiss(self, w: WorkerLedger) -> None:
        """Tell ``w`` to stop (a header-only FINAL reply) and go on listening to it: the
        pushes it had in flight come in and are answered the same way, until its FINAL
        push (its last step's, or a FAREWELL) ends it, so none is left unmatched."""
        if not w.dismissed:
            w.dismissed = True
            self.dismissed.append(w.rank)
        self.silence.heard(w.rank)  # it owes a push now
        w.receive.what = "a gradient or its farewell"
        w.posted = self.comm.start(w.receive)
        self._reply(w, with_weights=False)

    def _finish(self, w: WorkerLedger) -> None:
        """``w`` sent its FINAL push: the final reply, and no more listening to it."""
        self._retire(w)
        if w.dismissed:
            self.dismissed.remove(w.rank)
        self._reply(w, with_weights=False)

    def _retire(self, w: WorkerLedger) -> None:
        """``w`` is done (finished, or dropped): the loop no longer waits for it."""
        w.done = True
        self.training -= 1

    def _reply(self, w: WorkerLedger, with_weights: bool) -> None:
        i = w.last_reply = self._free_reply_buffer(w)
        send = w.sends[i]
        # (positional: a namedtuple made from keywords costs more, once per update)
        Header(self.version, w.steps,  # step: where to resume from
               0 if with_weights else FINAL | self.ending, 0.0, 0.0, 0.0,
               self.quotas.of[w.rank] - self.total_steps, 0).write(send)
        if with_weights:
            # (a shared lease slot is free until this reply reaches its worker: see Mailbox)
            lease = send if w.leases is None else w.leases[w.reply_to]
            n = self.weights.size
            lease[SLOTS:SLOTS + n] = self.weights
            if self.buffers.size:
                lease[SLOTS + n:] = self.buffers
            if w.leases is not None:
                self.comm.traffic.add_sent(SHARED, lease.nbytes - SLOTS * 4)
            w.sending[i] = self.comm.start(w.replying[i])
        else:
            w.sending[i] = self.comm.isend(send[:SLOTS], w.rank, TAG_WEIGHTS, "pull",
                                           w.takes_last_reply)

    def _free_reply_buffer(self, w: WorkerLedger) -> int:
        """A reply buffer of ``w`` whose last reply was taken. A pipelined worker may
        push again before it takes the last reply (it is computing, so the send waits
        for its next MPI call): then a second buffer is made, once; with both busy, the
        older one's reply was taken before the push being answered was sent (the
        worker has at most PIPELINE_DEPTH pushes in flight), so its send completes at
        once. Slow steps (large models) never need the second buffer."""
        for i, sending in enumerate(w.sending):
            if sending is None or sending.test():
                return i
        if len(w.sends) < PIPELINE_DEPTH:
            w.sends.append(np.empty_like(w.sends[0]))
            w.sending.append(None)
            w.replying.append(self._reply_op(w, len(w.sends) - 1))
            return len(w.sends) - 1
        older = (w.last_reply + 1) % len(w.sends)
        self.comm.wait(w.sending[older], IDLE)
        return older

    # ---- results ----------------------------------------------------------------------
    def _summary(self, wall: float, cpu_share: Dict[str, float]) -> Summary:
        ctx = self.ctx
        rows, all_staleness = [], collections.Counter()
        for w in self.workers.values():
            all_staleness.update(w.staleness)
            rows += [{"worker": w.rank, "staleness": s, "count": c}
                     for s, c in sorted(w.staleness.items())]
        ctx.results.write_csv("staleness.csv", list(STALENESS_COLUMNS), rows)
        total = sum(all_staleness.values())
        mean = sum(s * c for s, c in all_staleness.items()) / max(1, total)
        pushes = sum(w.steps - w.start_step for w in self.workers.values())
        extra = {
            "staleness_mean": round(mean, 3),
            "staleness_max": max(all_staleness) if all_staleness else 0,
            "staleness_bound": "" if self.leases.bound is None else self.leases.bound,
            "pushes": pushes, "applied": sum(w.applied for w in self.workers.values()),
            "server_updates_per_s": round(self.version / max(1e-9, wall), 1),
            "worker_steps_per_s": round(float(np.mean(
                [w.steps / max(1e-9, w.elapsed) for w in self.workers.values()])), 1),
            **cpu_share,
            "lost_workers": "; ".join(f"rank {w['rank']} on {w['host']} at update "
                                      f"{w['update']} ({w['reason']})" for w in ctx.lost),
            "updates_short": self.quotas.short,
        }
        ctx.console.info(
            f"async: {self.version} updates from {pushes} pushes; staleness mean "
            f"{extra['staleness_mean']}, max {extra['staleness_max']}; server "
            f"{extra['server_updates_per_s']} updates/s; server process "
            f"{100 * cpu_share['server_cpu_share']:.1f}% of a core (protocol loop "
            f"{100 * cpu_share['server_loop_cpu_share']:.1f}%, the rest evaluation)")
        return self.evaluations.evaluator.summary(wall, **extra)
