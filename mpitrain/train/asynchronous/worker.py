"""The async worker: compute at the lease's weights, push, take the next lease."""

from __future__ import annotations

import collections
import math
import time
from typing import Optional, Tuple

import numpy as np

from ...bounds import Bounds
from ...comm import HOT, IDLE, Backoff
from ...errors import Divergence, Dropped, Interrupted
from ..context import Context, Summary, worker_batches
from ..evaluation import Stopwatch
from ..leases import Pipelining
from ..protocol import (DIVERGED, DROPPED, FAREWELL, FINAL, INTERRUPTED, PARKED, PIPELINED,
                        SLOTS, TAG_GRADIENT, TAG_WEIGHTS, Header, sentinel, slots_word)
from .mailbox import PIPELINE_DEPTH, pipelining_mode
from .post import Post


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
    """
    comm, replica = ctx.comm, ctx.replica
    pipelining = Pipelining(pipelining_mode(ctx.cfg))
    depth = pipelining.depth
    post = Post(ctx)  # the mailboxes with rank 0 and (--servers K) the other servers
    reply_bound = Bounds(comm.timeout).reply  # the server speaks first about a stall
    current, flight, timer = 0, collections.deque(), ctx.timer
    total_steps = ctx.total_steps  # (a property: read once, not per step)
    flight.append(post.initial())  # the initial weights
    # what the lease in use says: its version, the step to resume from (> 0 when
    # resuming), whether the server is stopping (flags), steps of lost workers given
    # to this one (extra: its FINAL push comes at its own last step plus those)
    current, lease = _take_reply(post, flight, IDLE, reply_bound)
    start_step = step = lease.step
    flags = 0  # of this worker's last push
    if replica.n_buffers:  # the statistics the run has so far (a resumed run's)
        replica.set_buffers(post.buffers(0))
    timer.restart()
    batches = iter(() if lease.flags else worker_batches(ctx, start_step, endless=True))
    while True:
        for _, step, x, y, end_of_epoch in batches:
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
            post.fill(slot, grad, norm, replica.buffers() if replica.n_buffers else None)
            # a lease buffer nobody uses (one push at most is still in flight here)
            target = _free_lease(current, flight[0].lease if flight else None)
            post.stamp(slot, computed_at, Header(0, step, flags | (PIPELINED if depth > 1
                                                                   else 0), health, clock(),
                                                 think, 0, slots_word(slot, target)))
            timer.lap()
            flight.append(post.send(slot, target))
            timer.lap("comm")
            if depth == 1 and not flags & FINAL:  # (a FINAL push's reply: _last_replies)
                waited = time.perf_counter()
                with timer("wait"):
                    current, lease = _take_reply(post, flight, HOT, reply_bound)
                depth = pipelining.observe(think, time.perf_counter() - waited)
            if end_of_epoch or flags & FINAL:
                timer.end_epoch(round(step / ctx.steps_per_epoch, 4))
            if flags & FINAL or lease.flags:
                break
        timer.lap()
        ending, resumed = _last_replies(post, flight, flags, lease.flags, reply_bound)
        timer.lap("wait")
        if resumed is None:
            break
        (current, lease), flags = resumed, 0  # a lost worker's steps to run
    if ending & DROPPED:
        post.cancel(flight)  # the servers will not answer these: their receives must go
        raise Dropped(f"{comm.name(comm.rank)} was dropped by the parameter server after it "
                      "stopped answering; the run went on without it (this process leaves)")
    if not flags & FINAL:  # dismissed: say the last word, so the server stops listening
        ending |= _farewell(comm, post.zero.pushes[0], post.zero.leases[current],
                            reply_bound)
    post.farewell(reply_bound)  # (the other servers, --servers K, listen until then)
    if ending & DIVERGED:
        raise Divergence("training diverged (see rank 0's message)", everywhere=True)
    if ending & INTERRUPTED:
        raise Interrupted("stopped (see rank 0's message)", everywhere=True)
    nan = float("nan")
    return Summary(clock(), step, step / ctx.steps_per_epoch, nan, nan, nan)


def _last_replies(post: Post, flight, flags: int, ending: int, bound: float
                  ) -> Tuple[int, Optional[Tuple[int, Header]]]:
    """Take the replies still due once the worker stopped pushing (its last push had
    ``flags``; the server's last word so far, ``ending``). Returns the flags they end
    the run with, and None, or, when the reply to a FINAL push is a lease (a lost
    worker's steps given to this one), the lease buffer and header to go on with.
    A PARKED reply (the server keeps this worker for such steps) is listened past:
    the server speaks again within ``--timeout``, half of ``bound``."""
    while flight and not ending & DROPPED:
        taken, header = _take_reply(post, flight, IDLE, bound)
        if flight or not flags & FINAL or header.flags & (FINAL | DROPPED):
            ending |= header.flags
        elif header.flags & PARKED:
            flight.append(post.again(taken))
        else:
            return ending, (taken, header)
    return ending, None


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
