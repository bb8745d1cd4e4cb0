"""The async worker: compute at the lease's weights, push, take the next lease."""

from __future__ import annotations

import collections
import math
import time
from typing import NamedTuple, Optional, Tuple

import numpy as np

from ...comm import HOT, IDLE, Backoff
from ...errors import Divergence, Dropped, Interrupted
from ..context import Context, Summary, worker_batches
from ..evaluation import Stopwatch
from ..leases import Pipelining
from ..protocol import (DIVERGED, DROPPED, FAREWELL, FINAL, INTERRUPTED, PARKED, PIPELINED,
                        SLOTS, TAG_GRADIENT, TAG_WEIGHTS, Header, sentinel, slots_word)
from .mailbox import PIPELINE_DEPTH, SHARED, Mailbox, PushCodec, pipelining_mode


class _InFlight(NamedTuple):
    """One push of a worker that the server has not answered yet (as the worker knows)."""

    reply: object  # the pending receive of the server's reply
    push: object  # the pending send of the push (None: the initial lease, no push)
    lease: int  # the lease buffer the reply lands in


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
    comm, replica, n = ctx.comm, ctx.replica, ctx.replica.n_params
    pipelining = Pipelining(pipelining_mode(ctx.cfg))
    depth = pipelining.depth
    codec = PushCodec(ctx.cfg.compression, n)
    box = Mailbox.open(ctx)
    pushes, leases, replies, sends = box.pushes, box.leases, box.replies, box.sends
    shared_push = box.shared_push
    reply_bound = 2 * comm.timeout
    current, flight, timer = 0, collections.deque(), ctx.timer
    total_steps = ctx.total_steps  # (a property: read once, not per step)
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
    batches = iter(() if lease.flags else worker_batches(ctx, start_step, endless=True))
    while True:
        for _, step, x, y, end_of_epoch in batches:
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
        timer.lap()
        ending, resumed = _last_replies(comm, flight, box, flags, lease.flags, reply_bound)
        timer.lap("wait")
        if resumed is None:
            break
        (current, lease), flags = resumed, 0  # a lost worker's steps to run
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


def _last_replies(comm, flight, box: Mailbox, flags: int, ending: int, bound: float
                  ) -> Tuple[int, Optional[Tuple[int, Header]]]:
    """Take the replies still due once the worker stopped pushing (its last push had
    ``flags``; the server's last word so far, ``ending``). Returns the flags they end
    the run with, and None, or, when the reply to a FINAL push is a lease (a lost
    worker's steps given to this one), the lease buffer and header to go on with.
    A PARKED reply (the server keeps this worker for such steps) is listened past:
    the server speaks again within ``--timeout``, half of ``bound``."""
    while flight and not ending & DROPPED:
        taken, header = _take_reply(comm, flight, box, IDLE, bound)
        if flight or not flags & FINAL or header.flags & (FINAL | DROPPED):
            ending |= header.flags
        elif header.flags & PARKED:
            flight.append(_InFlight(comm.start(box.replies[taken]), None, taken))
        else:
            return ending, (taken, header)
    return ending, None


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
    if box.shared and not header.flags & (FINAL | PARKED):  # weights written in place
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
