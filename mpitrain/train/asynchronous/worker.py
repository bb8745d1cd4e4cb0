"""The async worker: compute at the lease's weights, push, take the next lease."""

from __future__ import annotations

import collections
import math
import time
from typing import Deque, Iterator, Optional, Tuple

import numpy as np

from ...comm import HOT, IDLE, Backoff
from ...errors import Divergence, Dropped, Interrupted
from ..context import Context, Summary, worker_batches
from ..evaluation import Stopwatch
from ..leases import Pipelining
from ..protocol import (DIVERGED, DROPPED, FAREWELL, FINAL, INTERRUPTED, PIPELINED, SLOTS,
                        TAG_GRADIENT, TAG_WEIGHTS, Header, sentinel, slots_word)
from .mailbox import PIPELINE_DEPTH, pipelining_mode
from .post import Post
from .worker_states import DISMISSED, DONE, LOST, PARKED, TRAINING, WorkerState, after_reply


def work(ctx: Context, clock: Stopwatch) -> Summary:
    """The worker loop: compute at the lease's weights, push, take the next lease.

    Pipelined (``--pipeline``: :class:`..leases.Pipelining` decides, from the first
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

    The loop runs over the worker's states (:mod:`.worker_states`), each a method of
    :class:`_Run` that returns the next: TRAINING (its steps, until it pushes FINAL or
    rank 0 says stop; then the replies still due say what it is), PARKED (its steps
    done under recovery: it waits for rank 0's next word), DISMISSED (its farewell),
    until DONE or LOST (dropped: it leaves with :class:`Dropped`).
    """
    run = _Run(ctx, clock)
    ctx.started()  # (its mailboxes made: the job's start-up is over)
    moves = {TRAINING: run.train, PARKED: run.wait_parked, DISMISSED: run.farewell}
    state = run.start()
    while state in moves:
        state = moves[state]()
    return run.leave(state)


class _Run:
    """What a worker's states share: its mailboxes (:class:`.post.Post`), the pushes in
    flight, the lease in use and what rank 0 said of the run's end."""

    def __init__(self, ctx: Context, clock: Stopwatch):
        self.ctx, self.clock, self.comm = ctx, clock, ctx.comm
        self.pipelining = Pipelining(pipelining_mode(ctx.cfg))
        self.depth = self.pipelining.depth
        self.post = Post(ctx)  # the mailboxes with rank 0 and (--servers K) the other servers
        self.reply_bound = self.comm.bounds.reply  # the server speaks first
        self.flight: Deque = collections.deque()  # (of .post.InFlight)
        # what the lease in use (lease buffer ``current``) says: its version, the step
        # to resume from (> 0 when resuming), whether the server is stopping (flags),
        # steps of lost workers given to this one (extra: its FINAL push comes at its
        # own last step plus those)
        self.current, self.lease = 0, Header()
        self.flags = 0  # of this worker's last push
        self.step = 0  # of its last push (the step it resumed from before any)
        self.ending = 0  # rank 0's word on the end: FINAL, INTERRUPTED, DIVERGED, DROPPED
        self.batches: Iterator[Tuple[int, int, np.ndarray, np.ndarray, bool]] = iter(())

    def start(self) -> WorkerState:
        """Take the first lease (the initial weights, or a dismissal): TRAINING from the
        step it says, else what rank 0's word makes this worker."""
        ctx, post = self.ctx, self.post
        self.flight.append(post.initial())
        self.current, self.lease = _take_reply(post, self.flight, IDLE, self.reply_bound)
        self.step = self.lease.step
        if ctx.replica.n_buffers:  # the statistics the run has so far (a resumed run's)
            ctx.replica.set_buffers(post.buffers(0))
        ctx.timer.restart()
        if self.lease.flags:
            self.ending |= self.lease.flags
            return after_reply(self.lease.flags, pushed_final=False)
        self.batches = worker_batches(ctx, self.step, endless=True)
        return TRAINING

    def train(self) -> WorkerState:
        """TRAINING: compute at the lease's weights, push, take the replies in, until
        this worker pushes FINAL or rank 0's reply says stop; then the replies still due
        (:meth:`_settle`) say what it is."""
        ctx, replica, post, clock, timer = self.ctx, self.ctx.replica, self.post, \
            self.clock, self.ctx.timer
        pipelining, depth, flight, reply_bound = self.pipelining, self.depth, self.flight, \
            self.reply_bound
        current, lease, flags, step = self.current, self.lease, 0, self.step
        total_steps = ctx.total_steps  # (a property: read once, not per step)
        # encoding a compressed push is the compression's time (timing.csv's codec_s)
        filling = "compute" if ctx.cfg.transport.compression == "none" else "codec"
        for _, step, x, y, end_of_epoch in self.batches:
            started = time.perf_counter()  # (preparing the batch is compute too)
            grad, loss, norm = replica.grad_at(post.weights(current), x, y)
            think = time.perf_counter() - started  # lets the server pick its poll policy
            computed_at = current
            # the replies already in, the oldest one anyway when the pipeline is full
            # (the phases marked with timer.lap, not `with timer(...)`: a block costs more,
            # and with no compute at all this loop runs tens of thousands of times a second)
            while flight and (len(flight) >= depth or flight[0].reply.test()) \
                    and not lease.flags:
                timer.lap()
                current, lease = _take_reply(post, flight, HOT, reply_bound)
                timer.lap("wait")
            health = sentinel(loss, norm)
            if lease.flags:  # the server is stopping: this gradient is not wanted
                break
            flags = _push_flags(ctx, step, total_steps + lease.extra, health)
            slot = step % depth  # (its last send completed with its reply)
            # this worker's statistics travel with each push
            timer.lap()
            post.fill(slot, grad, norm, replica.buffers() if replica.n_buffers else None)
            timer.lap(filling)
            # a lease buffer nobody uses (one push at most is still in flight here)
            target = _free_lease(current, flight[0].lease if flight else None)
            post.stamp(slot, computed_at, Header(0, step, flags | (PIPELINED if depth > 1
                                                                   else 0), health, clock(),
                                                 think, 0, slots_word(slot, target)))
            timer.lap()
            flight.append(post.send(slot, target))
            timer.lap("comm")
            if depth == 1 and not flags & FINAL:  # (a FINAL push's reply: _settle)
                waited = time.perf_counter()
                with timer("wait"):
                    current, lease = _take_reply(post, flight, HOT, reply_bound)
                depth = pipelining.observe(think, time.perf_counter() - waited)
            if end_of_epoch or flags & FINAL:
                timer.end_epoch(round(step / ctx.steps_per_epoch, 4))
            if flags & FINAL or lease.flags:
                break
        self.current, self.lease, self.flags, self.step, self.depth = \
            current, lease, flags, step, depth
        timer.lap()
        state = self._settle()
        timer.lap("wait")
        return state

    def _settle(self) -> WorkerState:
        """Take the replies still due now that this worker stopped pushing (its last push
        FINAL, or rank 0's last reply said stop): the last one, to its FINAL push, says
        what it is (:meth:`_answer`); else rank 0's word so far does (DISMISSED: it owes
        a farewell; LOST once a reply says DROPPED)."""
        flight, pushed_final = self.flight, bool(self.flags & FINAL)
        ending = self.lease.flags
        while flight and not ending & DROPPED:
            taken, header = _take_reply(self.post, flight, IDLE, self.reply_bound)
            if flight or not pushed_final:
                ending |= header.flags
            else:
                self.ending |= ending
                return self._answer(taken, header)
        self.ending |= ending
        return after_reply(ending, pushed_final)

    def _answer(self, taken: int, header: Header) -> WorkerState:
        """Rank 0's reply (``header``, in lease buffer ``taken``) to this worker's FINAL
        push, or its next word to a parked worker: what the worker is now. Recalled
        (a lease), it trains on at it; parked, it listens on (rank 0 speaks again
        within --timeout, half the bound of this worker's wait)."""
        state = after_reply(header.flags, pushed_final=True)
        if state is TRAINING:  # a lost worker's steps to run
            self.current, self.lease, self.flags = taken, header, 0
        elif state is PARKED:
            self.flight.append(self.post.again(taken))
        else:
            self.ending |= header.flags
        return state

    def wait_parked(self) -> WorkerState:
        """PARKED: wait for rank 0's next word (:meth:`_answer`)."""
        taken, header = _take_reply(self.post, self.flight, IDLE, self.reply_bound)
        self.ctx.timer.lap("wait")
        return self._answer(taken, header)

    def farewell(self) -> WorkerState:
        """DISMISSED: say the last word, so that rank 0 stops listening; then DONE."""
        zero = self.post.zero
        self.ending |= _farewell(self.comm, zero.pushes[0], zero.leases[self.current],
                                 self.reply_bound)
        return DONE

    def leave(self, state: WorkerState) -> Summary:
        """The end (``state`` DONE or LOST): the summary, or why this worker stopped."""
        comm, post = self.comm, self.post
        if state is LOST:
            post.cancel(self.flight)  # the servers will not answer these: receives must go
            raise Dropped(f"{comm.name(comm.rank)} was dropped by the parameter server after "
                          "it stopped answering; the run went on without it (this process "
                          "leaves)")
        post.farewell(self.reply_bound)  # (the other servers, --servers K, listen until then)
        if self.ending & DIVERGED:
            raise Divergence("training diverged (see rank 0's message)", everywhere=True)
        if self.ending & INTERRUPTED:
            raise Interrupted("stopped (see rank 0's message)", everywhere=True)
        nan = float("nan")
        return Summary(self.clock(), self.step, self.step / self.ctx.steps_per_epoch, nan, nan,
                       nan)


def _take_reply(post: Post, flight, backoff: Backoff, bound: float) -> Tuple[int, Header]:
    """Complete the oldest push in ``flight`` (:meth:`.post.Post.take`). Returns the lease
    buffer its replies are in, and rank 0's header."""
    oldest = flight.popleft()
    return oldest.lease, post.take(oldest, backoff, bound)


def _free_lease(current: int, in_flight: Optional[int]) -> int:
    """The first lease buffer that is neither the one in use (``current``) nor awaited
    by the push in flight (``in_flight``, None if none): of two buffers when a worker
    keeps one push in flight at most, of three when two (PIPELINE_DEPTH)."""
    for i in range(PIPELINE_DEPTH + 1):
        if i != current and i != in_flight:
            return i
    raise AssertionError("three lease buffers, two of them busy at most")


def _farewell(comm, message: np.ndarray, reply: np.ndarray, bound: float) -> int:
    """A dismissed worker's last push to rank 0 (FINAL|FAREWELL, no gradient; into the
    free ``message``) and the server's answer (into ``reply``); returns its flags."""
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
