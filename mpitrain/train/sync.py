"""Synchronous data-parallel training (the default mode).

Workers (ranks 1..N-1) each take a step on their own batch, average their flat
gradients with ONE allreduce on the workers' communicator, and apply the same
mean gradient, so all replicas stay bit-identical. The global batch is
workers x per-worker batch; an epoch is one pass of every worker over its shard.

How rank 0 (the parameter server) keeps the canonical model current: it does
**not** join the per-step allreduce. Joining with a zero gradient would add a
rank to every collective and, since MPI waits busy-poll, keep rank 0 spinning
on a core all the time; at ``-np 4`` on 2 cores that core is one a worker
needs. Instead rank 0 sleeps in a bounded wait and, at each evaluation or
checkpoint point, receives the weights from worker 1 and a weight checksum
from every worker. It checks that all checksums agree (replicas identical;
:class:`ReplicaDrift` otherwise), loads the weights and evaluates on the test
set while the workers go on training. The cost is one model-sized message per
evaluation (``pull`` traffic) instead of one model-sized allreduce contribution
per step.

**The status tail.** The fused buffer carries ``1 + W`` extra floats after the
gradient: a stop flag, and one slot per worker holding that worker's loss
(plus 0 x its gradient norm, so a non-finite gradient makes the slot NaN).
After the one allreduce every worker knows whether anyone was asked to stop,
which workers went non-finite, and the mean loss, and all act at the same step.
How it travels (MPI, shared memory or Horovod; float16 with error feedback under
``--compression fp16``; whole, or in buckets overlapped with back-propagation) is
planned once by :func:`mpitrain.exchange.plan`.

Message protocol with rank 0, on the world communicator (tags, header and flags
in :mod:`.protocol`):

* worker -> 0, ``TAG_REPORT``: a header (step, loss, elapsed, flags, checksum);
  a heartbeat about once a second (also while blocked in the allreduce, so rank
  0 can name a worker that went silent), a REPORT at evaluation/checkpoint
  points and at the end, flags telling which.
* worker 1 -> 0 after each REPORT: the flat weights (``TAG_WEIGHTS``); at
  checkpoints also the optimizer state (``TAG_STATE``); every worker also
  sends its random-generator state (``TAG_RNG``) if the model has one, and
  under ``--compression`` its codec's state (``TAG_CODEC``: its residuals, which
  differ between workers), which rank 0 sends back to each on resume: a resumed
  compressed run continues bit-identically too.
* 0 -> worker, ``TAG_STOP``: exactly once per run, either to ask for a stop
  (rank 0 got the signal) or, at the end, to say that no stop will come; so
  no receive is ever left pending and no message unmatched.

**BatchNorm statistics** (the replica's *buffers*) follow each worker's own
batches, so they are the one state that differs between replicas. At every
evaluation or checkpoint point (a step all workers agree on: the flags come
from the step number and the stop flag of the shared allreduce) the workers
average them with one small allreduce and all continue from the mean; the
checksum they report covers weights and buffers, and worker 1 sends both.

Rank 0 never applies an update, so it builds no optimizer (no slots); it learns
the layout of the optimizer state it checkpoints from the workers at the start.

At -np 1 the single rank trains with the fused step and evaluates itself. Rank 0's
side is :mod:`.sync_server`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple, cast

import numpy as np

from ..comm import IDLE, Comm, Role
from ..errors import Interrupted
from ..run.checkpoint import Checkpoint, CheckpointMeta, optimizer_mismatch
from ..exchange import plan
from ..models.replica import checksum
from .context import Context, Summary, is_checkpoint_point, is_eval_point, worker_batches
from .evaluation import Evaluator, Stopwatch, evaluate_and_save
from .protocol import (CODEC, DIVERGED, EVALUATE, FINAL, HEARTBEAT_SECONDS, INTERRUPTED, REPORT,
                       SAVE, TAG_CODEC, TAG_REPORT, TAG_RNG, TAG_STATE, TAG_STOP, TAG_WEIGHTS,
                       WAITED, Header, new_message, sentinel)
from .sync_server import (SyncServer, diverged_at, pack_state, packed_size,
                          receive_codec_states, unpack_state)


def train(ctx: Context) -> Summary:
    """Run sync training on this rank. Collective: every rank of the world calls it.

    Rank 0 broadcasts the starting weights (fresh, or the resumed checkpoint's)
    and, on resume, the optimizer and random-generator state; then the server
    serves and the workers train. Returns the summary as this rank knows it
    (complete on the serving rank). Raises :class:`Interrupted` or
    :class:`Divergence` on every rank, at the same step, when training stops
    for those reasons.
    """
    start_step, offset, layout, codec = _start(ctx)
    clock = Stopwatch(offset)
    if ctx.role is Role.SERVER:
        return SyncServer(ctx, clock, layout).run(start_step)
    link = LocalEvaluation(ctx, clock, start_step) if ctx.role is Role.SINGLE \
        else ServerLink(ctx, clock)
    return _work(ctx, link, start_step, codec)


def _start(ctx: Context):
    """Share the starting state from rank 0; returns (start step, clock offset, the
    optimizer state's layout, this worker's saved compression state or None).

    Rank 0 serves and has no optimizer (it never applies an update): it learns
    the layout of the optimizer state it will checkpoint from the workers."""
    comm, replica, ckpt = ctx.comm, ctx.replica, ctx.resume_from
    if ckpt is not None:
        replica.set_state(ckpt.state)
    codecs = ckpt is not None and sorted(ckpt.codecs) == list(range(1, comm.size))
    position = np.array([ckpt.step, ckpt.wall_time_s, codecs] if ckpt else [0, 0.0, 0],
                        np.float64)
    comm.bcast_(position)
    replica.set_state(comm.bcast_(replica.state()))
    mine = replica.optimizer_layout() if replica.applies else None
    layout = cast(dict, mine if comm.size == 1 else next(  # (alone, this rank applies)
        found for found in comm.allgather_objects(mine) if found is not None))
    if position[0] > 0:  # resuming: the optimizer and generators continue too
        if ckpt:
            saved = replica.adapt_optimizer_state(ckpt.optimizer, layout)
            comm.agree(optimizer_mismatch(saved, layout, ctx.cfg.resume))
            state = pack_state(saved, layout)
        else:
            comm.agree(None)
            state = np.empty(packed_size(layout), np.uint8)
        comm.bcast_(state)
        if replica.applies:
            replica.set_optimizer_state(unpack_state(state, layout))
        rng = _rng_table(ckpt, comm.size, len(replica.rng_state()))
        comm.bcast_(rng)
        if ctx.role.trains and rng.shape[1]:
            replica.set_rng_state(rng[comm.rank])
    codec = _deal_codec_states(comm, ckpt) if position[2] else None
    return int(position[0]), float(position[1]), layout, codec


def _deal_codec_states(comm: Comm, ckpt) -> Optional[np.ndarray]:
    """Rank 0 sends each worker the compression state the checkpoint saved of it (each
    its own: their residuals differ); a worker returns its own, rank 0 None."""
    if comm.rank == 0:
        comm.wait_all([comm.isend(state, w, TAG_CODEC, "checkpoint",
                                  f"{comm.name(w)} to take its compression state")
                       for w, state in ckpt.codecs.items()], IDLE)
        return None
    return receive_codec_states(comm, [0], "rank 0's compression state")[0]


def _rng_table(ckpt, size: int, width: int) -> np.ndarray:
    table = np.zeros((size, width), np.int64)
    for rank, row in (ckpt.meta.rng.items() if ckpt else ()):
        table[rank] = row
    return table


# ---------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------
def _work(ctx: Context, link, start_step: int, codec: Optional[np.ndarray]) -> Summary:
    worker_comm = cast(Comm, ctx.comm.workers)  # (a worker's)
    if worker_comm.size == 1:  # nothing to average: use the fused one-call step
        return _steps(ctx, link, start_step, None)
    tail = 1 + worker_comm.size  # the status tail: a stop flag, a loss per worker
    with plan(ctx.cfg, ctx.replica, worker_comm, tail, ctx.run_dir, start_step) as exchange:
        if codec is not None:  # (where it does not fit, the residuals start at zero)
            exchange.restore_codec(codec)
        link.codec_state = exchange.codec_state
        return _steps(ctx, link, start_step, exchange)


def _steps(ctx: Context, link, start_step: int, exchange) -> Summary:
    replica, worker_comm, timer = ctx.replica, cast(Comm, ctx.comm.workers), ctx.timer
    n, me, alone = replica.n_params, worker_comm.rank, exchange is None
    loss_sum, n_batches, step = 0.0, 0, start_step
    timer.restart()  # every second of an epoch is accounted from here on
    for epoch, step, x, y, end_of_epoch in worker_batches(ctx, start_step):
        link.poll_stop()
        if alone:
            loss, norm = replica.train_step(x, y)
            stop, losses = bool(ctx.stop), [sentinel(loss, norm)]
        else:
            buf, loss, norm = exchange.grad(x, y)
            buf[n] = 1.0 if ctx.stop else 0.0
            buf[n + 1 + me] = sentinel(loss, norm)
            with timer.collective() as call:  # moving the data + waiting for the slowest
                exchange.allreduce_(buf)
                call.codec = exchange.take_codec_seconds()
            stop, losses = bool(buf[n] > 0), list(buf[n + 1:])
        nonfinite = [w for w, value in enumerate(losses) if not math.isfinite(value)]
        if not alone and not nonfinite:
            replica.apply(buf[:n])
        loss_sum += float(np.mean(losses))
        n_batches += 1
        flags = _flags(ctx, epoch, step, end_of_epoch, stop, me in nonfinite)
        if nonfinite or stop:
            flags |= FINAL
        with timer(link.accounted_as):
            link.after_step(step, loss_sum / n_batches)
            if flags & (EVALUATE | SAVE) and not (alone or nonfinite):
                average_buffers(replica, worker_comm)  # every worker: the same step, the same flags
            if flags:
                link.report(step, loss_sum / n_batches, flags)
        if end_of_epoch or flags & FINAL:
            timer.end_epoch(round(step / ctx.steps_per_epoch, 4))
            loss_sum, n_batches = 0.0, 0
        if nonfinite:
            link.close(step)
            raise diverged_at(ctx, [w + 1 for w in nonfinite], step)
        if stop:
            link.close(step)
            raise Interrupted(f"stopped by {ctx.stop.name or 'a peer'} at step {step}; "
                              f"checkpoint saved, resume with --resume", everywhere=True)
    return link.close(step)


def _flags(ctx: Context, epoch: int, step: int, end_of_epoch: bool, stop: bool,
           diverged_here: bool) -> int:
    flags = 0
    if end_of_epoch and is_eval_point(ctx, epoch, step) or stop:
        flags |= EVALUATE
    if is_checkpoint_point(ctx, epoch, step, end_of_epoch) or stop:
        flags |= SAVE
    if step == ctx.total_steps:
        flags |= FINAL
    if stop:
        flags |= INTERRUPTED
    if diverged_here:
        flags = (flags | DIVERGED) & ~(EVALUATE | SAVE)
    return flags


def average_buffers(replica, worker_comm) -> None:
    """Make every worker's BatchNorm statistics their mean across the workers.

    Each replica updates its moving statistics from its own batches, so between
    evaluation points they differ (the trained weights never do). At every
    evaluation and checkpoint point the workers average them with one small
    allreduce and all continue from the mean, so the state rank 0 evaluates
    and checkpoints is every worker's state, and a resumed run continues
    exactly as an uninterrupted one. Collective over the workers; a no-op for
    models without buffers.
    """
    if replica.n_buffers:
        replica.set_buffers(worker_comm.allreduce_mean_(replica.buffers(), "the buffers allreduce",
                                                    kind="buffers"))


class LocalEvaluation:
    """The single rank's link to itself: evaluate and checkpoint in place."""

    accounted_as = "compute"  # its time is evaluation work

    def __init__(self, ctx: Context, clock: Stopwatch, start_step: int):
        self.ctx, self.clock = ctx, clock
        self.evaluator = Evaluator.for_sync(ctx, clock)
        if start_step == 0:
            self.evaluator.record(0, None, 0.0)  # the initial model, outside the timed run
        clock.restart()
        self.wall: Optional[float] = None  # the clock at the latest report

    def poll_stop(self) -> None:
        pass

    def after_step(self, step: int, running_loss: float) -> None:
        self.evaluator.progress(step, running_loss)

    def report(self, step: int, train_loss: float, flags: int) -> None:
        now, replica = self.clock(), self.ctx.replica
        self.wall = now
        checkpoint = None
        if flags & SAVE:
            rng = replica.rng_state()
            meta = CheckpointMeta.sync(self.ctx.geometry, {0: rng.tolist()} if rng.size else {})
            checkpoint = Checkpoint(replica.weights(), replica.optimizer_state(), step, now,
                                    meta=meta, buffers=replica.buffers())
        evaluate_and_save(self.ctx, (lambda: self.evaluator.record(step, train_loss, now))
                          if flags & EVALUATE else None, checkpoint)

    def close(self, step: int) -> Summary:
        return self.evaluator.summary(self.wall)


class ServerLink:
    """A worker's side of the sync protocol: heartbeats, reports, the stop message."""

    accounted_as = "comm"  # its time is sending reports and weights

    def __init__(self, ctx: Context, clock: Stopwatch):
        self.ctx, self.clock = ctx, clock
        self.comm = ctx.comm
        self.sends: List[Tuple[Any, np.ndarray]] = []  # (pending, buffer): kept until sent
        self.next_beat = 0.0
        self.step, self.loss = 0, float("nan")  # what the heartbeats report
        self.sends_weights = ctx.worker_index == 0
        #: what a checkpoint carries of this worker's compression (set by the exchange)
        self.codec_state: Callable[[], Optional[np.ndarray]] = lambda: None
        self.stop_msg = np.zeros(1, np.float64)
        self.stop_recv = self.comm.irecv(self.stop_msg, 0, TAG_STOP, "control",
                                         "rank 0's stop message")
        # heartbeats also while blocked in the allreduce: rank 0 then knows this
        # worker is alive and waiting, and can name the one that is not
        cast(Comm, self.comm.workers).while_waiting = self._beat

    def poll_stop(self) -> None:
        if not self.stop_recv.done and self.stop_recv.test() and self.stop_msg[0] > 0:
            self.ctx.stop.request()

    def after_step(self, step: int, running_loss: float) -> None:
        self.step, self.loss = step, running_loss
        if self.clock() >= self.next_beat:
            self._beat()

    def _beat(self) -> None:
        now = self.clock()
        self.next_beat = now + HEARTBEAT_SECONDS
        self._send_header(Header(step=self.step, loss=self.loss, elapsed=now))

    def report(self, step: int, train_loss: float, flags: int) -> None:
        # the step's time is now, before its state is read out and summed: as the single
        # rank's report, the training clock stops at the last update (what follows it is
        # the evaluation's and checkpoint's: the summary's finish_s)
        elapsed, replica = self.clock(), self.ctx.replica
        weights = replica.state()  # buffers averaged at every report point: identical too
        codec = self.codec_state() if flags & SAVE else None
        flags |= REPORT | (WAITED if self._rank_0_behind() else 0) | \
            (CODEC if codec is not None else 0)
        self._send_header(Header(step=step, flags=flags, loss=train_loss, elapsed=elapsed,
                                 aux=checksum(weights)))
        payloads = []
        if self.sends_weights:
            payloads.append((TAG_WEIGHTS, "pull", weights))
            if flags & SAVE:
                payloads.append((TAG_STATE, "checkpoint", pack_state(  # (pack_state copies)
                    replica.optimizer_state(copy=False), replica.optimizer_layout())))
        rng = replica.rng_state()
        if flags & SAVE and rng.size:
            payloads.append((TAG_RNG, "checkpoint", rng))
        if codec is not None:
            payloads.append((TAG_CODEC, "checkpoint", codec))
        for tag, kind, buf in payloads:
            self._complete(kind)  # back-pressure: one message of each kind in flight
            self.sends.append((self.comm.isend(buf, 0, tag, kind, f"rank 0 to take {kind}"),
                               buf))

    def _rank_0_behind(self) -> bool:
        """Whether rank 0 has yet to take a payload of the last report (weights, checkpoint
        state), which this report's must wait for: it is then on the workers' critical
        path, and the flag in this report tells it so (:class:`.sync_server.SyncServer`)."""
        return any(p.kind != "control" and not p.test() for p, _ in self.sends)

    def _send_header(self, header: Header) -> None:
        message = header.write(new_message())
        self._prune()
        self.sends.append((self.comm.isend(message, 0, TAG_REPORT, "control",
                                           "rank 0 to take a report"), message))

    def _prune(self) -> None:
        self.sends = [(p, b) for p, b in self.sends if not p.test()]

    def _complete(self, kind=None) -> None:
        for pending, _ in self.sends:
            if kind is None or pending.kind == kind:
                self.comm.wait(pending, IDLE)
        self._prune()

    def close(self, step: int) -> Summary:
        cast(Comm, self.comm.workers).while_waiting = None
        self._complete()
        self.comm.wait(self.stop_recv, IDLE)  # rank 0 sends it exactly once per run
        nan = float("nan")
        return Summary(self.clock(), step, step / self.ctx.steps_per_epoch, nan, nan, nan)
