"""Synchronous data-parallel training (the default mode).

Workers (ranks 1..N-1) each take a step on their own batch, average their flat
gradients with ONE allreduce on the workers' communicator, and apply the same
mean gradient, so all replicas stay bit-identical. The global batch is
workers x per-worker batch; an epoch is one pass of every worker over its shard.

How rank 0 (the parameter server) keeps the canonical model current: it does
**not** join the per-step allreduce. Joining with a zero gradient would add a
rank to every collective and, since MPI waits busy-poll, keep rank 0 spinning
on a core all the time; at ``-np 4`` on 2 cores that core is one a worker
needs. Instead rank 0 sleeps in a bounded wait and, at each evaluation point,
receives the weights from worker 1 and a weight checksum from every worker. It
checks that all checksums agree (replicas identical; :class:`ReplicaDrift`
otherwise), loads the weights and evaluates on the test set while the workers
go on training. The cost is one model-sized message per evaluation (visible
as ``pull`` traffic) instead of one model-sized allreduce contribution per step.

Workers also send rank 0 a 48-byte progress report about once a second, so
rank 0 can show progress and notices a worker that has gone silent.

Message protocol (worker -> rank 0), all on the world communicator:

* ``TAG_REPORT``: float64 header ``[kind, step, train_loss, checksum, elapsed, final]``
  with kind PROGRESS or EVAL; every worker sends EVAL at every evaluation point.
* ``TAG_WEIGHTS``: after its EVAL header, worker 1 sends the flat weights.

At -np 1 the single rank trains with the fused step and evaluates itself.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import numpy as np

from .comm import IDLE, Role
from .errors import CommTimeout, ReplicaDrift
from .replica import checksum
from .trainer import (HEARTBEAT_SECONDS, TAG_REPORT, TAG_WEIGHTS, Context, Evaluator,
                      Stopwatch, Summary, is_eval_point, worker_batches)

PROGRESS, EVAL = 0.0, 1.0
HEADER_LEN = 6
KIND, STEP, LOSS, CRC, ELAPSED, FINAL = range(HEADER_LEN)


def train(ctx: Context) -> Summary:
    """Run sync training on this rank. Collective: every rank of the world calls it.

    Rank 0 broadcasts its initial weights to all ranks; then the server serves
    (evaluates what the workers report) and the workers train. Returns the
    summary as this rank knows it (complete on the serving rank).
    """
    initial = ctx.comm.bcast_(ctx.replica.weights())
    ctx.replica.set_weights(initial)
    clock = Stopwatch()
    if ctx.role is Role.SERVER:
        return _serve(ctx, clock)
    link = LocalEvaluation(ctx, clock) if ctx.role is Role.SINGLE else ServerLink(ctx, clock)
    return _work(ctx, link, clock)


# ---------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------
def _work(ctx: Context, link, clock: Stopwatch) -> Summary:
    replica, workers, timer = ctx.replica, ctx.comm.workers, ctx.timer
    alone = workers.size == 1  # nothing to average: use the fused one-call step
    transfer = 0.0 if alone else allreduce_cost(workers, replica.n_params)
    loss_sum, n_batches, step = 0.0, 0, 0
    mark = timer.restart()  # every second of an epoch is accounted from here on
    for epoch, step, x, y, end_of_epoch in worker_batches(ctx):
        # (the generator prepared the batch since `mark`: counted as compute below)
        if alone:
            loss = replica.train_step(x, y)
            t1 = t2 = time.perf_counter()
        else:
            grad, loss = replica.grad(x, y)
            t1 = time.perf_counter()
            workers.allreduce_mean_(grad)
            t2 = time.perf_counter()
            replica.apply(grad)
        loss_sum += loss
        n_batches += 1
        t3 = time.perf_counter()
        link.after_step(step, loss_sum / n_batches)
        if end_of_epoch and is_eval_point(ctx, epoch, step):
            link.report(step, loss_sum / n_batches, final=step == ctx.total_steps)
        t4 = time.perf_counter()
        # the allreduce call = moving the data + waiting for the slowest worker
        moving = min(t2 - t1, transfer)
        timer.add(compute=(t1 - mark) + (t3 - t2), comm=moving, wait=(t2 - t1) - moving)
        timer.add(**{link.accounted_as: t4 - t3})
        mark = t4
        if end_of_epoch:
            timer.end_epoch(round(step / ctx.steps_per_epoch, 4))
            loss_sum, n_batches = 0.0, 0
    return link.close(step)


def allreduce_cost(workers, n_params: int) -> float:
    """Seconds one gradient allreduce takes when nobody is late (measured back to back).

    Lets the timing split a step's time in the allreduce into moving data
    (this much) and waiting for the slowest worker (the rest). Collective
    over the workers. Counted as "calibration" traffic, not as "allreduce".
    """
    buf = np.zeros(n_params, np.float32)
    repeats = 3 if buf.nbytes > 16 * 2**20 else 20
    workers.barrier("the allreduce calibration")
    workers.allreduce_mean_(buf, kind="calibration")  # warm up (connections, buffers)
    t0 = time.perf_counter()
    for _ in range(repeats):
        workers.allreduce_mean_(buf, kind="calibration")
    return (time.perf_counter() - t0) / repeats


class LocalEvaluation:
    """The single rank's link to itself: evaluate in place."""

    accounted_as = "compute"  # its time is evaluation work

    def __init__(self, ctx: Context, clock: Stopwatch):
        self.evaluator, self.clock = Evaluator.for_sync(ctx, clock), clock
        self.evaluator.record(0, None, 0.0)  # the initial model, outside the timed run
        clock.restart()

    def after_step(self, step: int, running_loss: float) -> None:
        self.evaluator.progress(step, running_loss)

    def report(self, step: int, train_loss: float, final: bool) -> None:
        self.evaluator.record(step, train_loss, self.clock())

    def close(self, step: int) -> Summary:
        return self.evaluator.summary(self.clock())


class ServerLink:
    """A worker's side of the sync protocol: progress heartbeats and evaluation reports."""

    accounted_as = "comm"  # its time is sending reports and weights

    def __init__(self, ctx: Context, clock: Stopwatch):
        self.ctx, self.clock = ctx, clock
        self.comm = ctx.comm
        self.sends = []  # (pending, buffer) pairs: buffers must live until sent
        self.next_beat = 0.0
        self.sends_weights = ctx.worker_index == 0

    def after_step(self, step: int, running_loss: float) -> None:
        now = self.clock()
        if now >= self.next_beat:
            self.next_beat = now + HEARTBEAT_SECONDS
            self._send_header(PROGRESS, step, running_loss, 0, final=False)

    def report(self, step: int, train_loss: float, final: bool) -> None:
        weights = self.ctx.replica.weights()
        self._send_header(EVAL, step, train_loss, checksum(weights), final)
        if self.sends_weights:
            # back-pressure: at most one weights message in flight
            self._complete(kind="pull")
            self.sends.append((self.comm.isend(weights, 0, TAG_WEIGHTS, "pull",
                                               "rank 0 to take the weights"), weights))

    def _send_header(self, kind: float, step: int, loss: float, crc: int, final: bool) -> None:
        header = np.array([kind, step, loss, crc, self.clock(), final], dtype=np.float64)
        self._prune()
        self.sends.append((self.comm.isend(header, 0, TAG_REPORT, "control",
                                           "rank 0 to take a progress report"), header))

    def _prune(self) -> None:
        self.sends = [(p, b) for p, b in self.sends if not p.test()]

    def _complete(self, kind: Optional[str] = None) -> None:
        for pending, _ in self.sends:
            if kind is None or pending.kind == kind:
                self.comm.wait(pending, IDLE)
        self._prune()

    def close(self, step: int) -> Summary:
        self._complete()
        nan = float("nan")
        return Summary(self.clock(), step, step / self.ctx.steps_per_epoch, nan, nan, nan)


# ---------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------
def _serve(ctx: Context, clock: Stopwatch) -> Summary:
    comm, replica, timer = ctx.comm, ctx.replica, ctx.timer
    evaluator = Evaluator.for_sync(ctx, clock)
    evaluator.record(0, None, 0.0)  # the initial model: the curve starts at epoch 0
    workers = list(range(1, comm.size))
    headers = {w: np.zeros(HEADER_LEN, np.float64) for w in workers}
    posted = {w: _post_report(comm, headers[w], w) for w in workers}
    last_heard = {w: time.monotonic() for w in workers}
    weights = np.empty(replica.n_params, np.float32)
    evals: Dict[int, Dict[int, np.ndarray]] = {}
    finished = set()
    while len(finished) < len(workers):
        live = [w for w in workers if w not in finished]
        silent_for = time.monotonic() - min(last_heard[w] for w in live)
        t0 = time.perf_counter()
        index = comm.wait_any([posted[w] for w in live], IDLE,
                              timeout=max(0.0, comm.timeout - silent_for))
        timer.add(wait=time.perf_counter() - t0)
        if index is None:
            w = min(live, key=last_heard.get)
            raise CommTimeout(f"{comm.name(w)} sent nothing for {comm.timeout:g} s; it is "
                              "stalled or dead (raise --timeout if its steps are "
                              "legitimately that slow)")
        w = live[index]
        last_heard[w] = time.monotonic()
        header = headers[w].copy()
        if header[KIND] == EVAL:
            evals.setdefault(int(header[STEP]), {})[w] = header
            if header[FINAL]:
                finished.add(w)
        else:
            evaluator.progress(int(header[STEP]), float(header[LOSS]))
        if w not in finished:
            posted[w] = _post_report(comm, headers[w], w)
        for step in sorted(evals):
            if len(evals[step]) < len(workers):
                break
            _evaluate_reports(ctx, evaluator, step, evals.pop(step), weights)
            timer.end_epoch(round(step / ctx.steps_per_epoch, 4))
    return evaluator.summary(clock())


def _post_report(comm, buf: np.ndarray, worker: int):
    return comm.irecv(buf, worker, TAG_REPORT, "control", "a progress report")


def _evaluate_reports(ctx: Context, evaluator: Evaluator, step: int,
                      reports: Dict[int, np.ndarray], weights: np.ndarray) -> None:
    comm = ctx.comm
    t0 = time.perf_counter()
    comm.wait(comm.irecv(weights, 1, TAG_WEIGHTS, "pull", "the weights to evaluate"), IDLE)
    t1 = time.perf_counter()
    sums = {w: int(h[CRC]) for w, h in reports.items()}
    if checksum(weights) != sums[1]:
        raise ReplicaDrift(f"weights from {comm.name(1)} arrived corrupted at step {step} "
                           "(checksum mismatch in transit)")
    drifted = [w for w, s in sums.items() if s != sums[1]]
    if drifted:
        names = ", ".join(comm.name(w) for w in drifted)
        raise ReplicaDrift(f"sync replicas drifted apart at step {step}: weights on {names} "
                           f"differ from {comm.name(1)}'s; the allreduce delivered different "
                           "results to different ranks")
    ctx.replica.set_weights(weights)
    train_loss = float(np.mean([h[LOSS] for h in reports.values()]))
    elapsed = max(h[ELAPSED] for h in reports.values())
    evaluator.record(step, train_loss, elapsed)
    ctx.timer.add(comm=t1 - t0, compute=time.perf_counter() - t1)
