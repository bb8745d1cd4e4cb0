"""Rank 0 in sync mode (:class:`SyncServer`), and the optimizer state's wire format.

The protocol it serves is :mod:`.sync`'s (its docstring: what the workers send, when,
and what rank 0 does with it); this module is rank 0's side of it, apart from the
workers' so that each reads on its own. The workers pack the optimizer state they
checkpoint (:func:`pack_state`) and rank 0 unpacks it (:func:`unpack_state`).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Set, Tuple, cast

import numpy as np

from ..comm import IDLE
from ..errors import Divergence, ReplicaDrift
from ..run.checkpoint import Checkpoint, CheckpointMeta
from ..models.replica import checksum
from .context import Context, Summary, diverged, interrupted
from .evaluation import Evaluator, Stopwatch, evaluate_and_save
from .leases import Liveness
from .priority import Deference, deferring_to_workers
from .protocol import (CODEC, DIVERGED, EVALUATE, FINAL, INTERRUPTED, REPORT, SAVE, TAG_REPORT,
                       TAG_CODEC, TAG_RNG, TAG_STATE, TAG_STOP, TAG_WEIGHTS, WAITED, Header,
                       SilentPeers, new_message, stalled)


def pack_state(state: Dict[str, np.ndarray], layout) -> np.ndarray:
    """Optimizer state as one byte vector: each variable's own bytes in the dtype of
    ``layout`` (:meth:`~mpitrain.models.replica.Replica.optimizer_layout`), in its
    order. Float32 slots travel as 4 bytes each (as float64, a large model's
    momentum would cost twice the bytes at every checkpoint)."""
    parts = [np.ascontiguousarray(state[k], dtype=dtype).reshape(-1).view(np.uint8)
             for k, (_, dtype) in _in_order(layout)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def packed_size(layout) -> int:
    """Bytes of :func:`pack_state`'s vector."""
    return int(sum(np.prod(shape, dtype=np.int64) * np.dtype(dtype).itemsize
                   for shape, dtype in layout.values()))


def unpack_state(packed: np.ndarray, layout) -> Dict[str, np.ndarray]:
    """Inverse of :func:`pack_state`."""
    out, offset = {}, 0
    for k, (shape, dtype) in _in_order(layout):
        n = int(np.prod(shape, dtype=np.int64))
        out[k] = np.frombuffer(packed, dtype, n, offset).reshape(shape).copy()
        offset += n * np.dtype(dtype).itemsize
    return out


def _in_order(layout):
    """The layout's (name, (shape, dtype)) pairs in the optimizer's order (o0, o1, ...)."""
    return sorted(layout.items(), key=lambda item: int(item[0][1:]))


def receive_codec_states(comm, sources: List[int], what: str) -> Dict[int, np.ndarray]:
    """The compression state (float32, of a length the receiver does not know: the
    settings decide it) that each of ``sources`` sends with TAG_CODEC, by source;
    bounded. Rank 0 takes the workers' at checkpoints, a worker its own on resume."""
    received = {r: comm.matched_recv(r, TAG_CODEC, "checkpoint", what,
                                     lambda nbytes: np.empty(nbytes // 4, np.float32))
                for r in sources}
    comm.wait_all(list(received.values()), IDLE)
    return {r: cast(np.ndarray, m.buffer) for r, m in received.items()}


def diverged_at(ctx: Context, world_ranks: List[int], step: int) -> Divergence:
    where = ", ".join(ctx.comm.name(r) if ctx.comm.size > 1 else "the single rank"
                      for r in world_ranks)
    return diverged(f"{where} at step {step} (epoch {step / ctx.steps_per_epoch:.2f})")


class SyncServer:
    """Rank 0 in sync mode: evaluates and checkpoints what the workers report.

    A worker sends something at least about once a second while it trains or
    waits in the allreduce (heartbeats), and otherwise only during a step longer
    than that. So a worker that stays silent for 20x its usual interval between
    messages, at least ``--liveness-floor`` (10 s), has died, stopped or lost its
    network (a host gone without closing its connections): the server names it
    then (:class:`~mpitrain.train.leases.Liveness`, the async server's rule), not
    only after ``--timeout`` (300 s) as before, so ``mpitrain launch`` restarts
    the run without it minutes sooner. Before its first message (the first step
    traces the model) a worker gets the whole ``--timeout``.
    """

    def __init__(self, ctx: Context, clock: Stopwatch, optimizer_layout):
        self.ctx, self.clock, self.comm = ctx, clock, ctx.comm
        self.optimizer_layout = optimizer_layout  # what worker 1 checkpoints
        self.worker_ranks = list(range(1, self.comm.size))
        self.evaluator = Evaluator.for_sync(ctx, clock)
        self.headers = {w: new_message() for w in self.worker_ranks}
        self.posted = {w: self._post(w) for w in self.worker_ranks}
        self.silence = SilentPeers(self.comm, self.worker_ranks)
        self.liveness = Liveness(self.comm.timeout, floor=ctx.cfg.faults.liveness_floor)
        self.next_liveness_check = 0.0
        self.weights = np.empty(ctx.replica.n_state, np.float32)  # weights, then buffers
        self.reports: Dict[int, Dict[int, Header]] = {}
        self.finished: Set[int] = set()
        self.stop_sent: Dict[int, Tuple[Any, np.ndarray]] = {}  # (pending, buffer)
        self.wall: Optional[float] = None  # the workers' clock at the latest complete report
        self.deference = Deference(None)  # run's: this rank's priority below the workers'

    def _post(self, w: int):
        return self.comm.irecv(self.headers[w], w, TAG_REPORT, "control", "a progress report")

    def run(self, start_step: int) -> Summary:
        with deferring_to_workers(self.ctx) as self.deference:  # (the workers' steps first)
            if start_step == 0:
                self.evaluator.record(0, None, 0.0)  # the curve starts with the initial model
            self.ctx.timer.restart()  # the timed run starts with the workers' first step
            self._serve()
        return self.evaluator.summary(self.wall, server_nice=self.deference.niceness)

    def _serve(self) -> None:
        try:
            while len(self.finished) < len(self.worker_ranks):
                self._maybe_forward_stop()
                w = self._next_message()
                if w is None:  # a quiet second: check for a stop request again
                    continue
                header = Header.read(self.headers[w])
                if header.flags & WAITED and self.deference.end():
                    self.ctx.console.info("rank 0 runs at its own priority again: the workers "
                                          "waited for it (other processes keep its host busy)")
                if header.flags & REPORT:
                    self.reports.setdefault(header.step, {})[w] = header
                    if header.flags & FINAL:
                        self.finished.add(w)
                else:
                    self.evaluator.progress(header.step, header.loss)
                if w not in self.finished:
                    self.posted[w] = self._post(w)
                self._handle_complete_reports()
        finally:
            self._send_stops(stop=False)  # exactly one per worker, also when failing

    def _maybe_forward_stop(self) -> None:
        if self.ctx.stop and len(self.stop_sent) < len(self.worker_ranks):
            self._send_stops(stop=True)

    def _send_stops(self, stop: bool) -> None:
        for w in self.worker_ranks:
            if w not in self.stop_sent:
                buf = np.array([1.0 if stop else 0.0])
                self.stop_sent[w] = (self.comm.isend(buf, w, TAG_STOP, "control",
                                                     f"{self.comm.name(w)} to take the stop"),
                                     buf)
        if not stop:
            for pending, _ in self.stop_sent.values():
                self.comm.wait(pending, IDLE)

    def _next_message(self) -> Optional[int]:
        """The worker whose message arrived, or None after a quiet second; raises the
        error naming a worker silent past its liveness bound (see :class:`SyncServer`)."""
        live = [w for w in self.worker_ranks if w not in self.finished]
        with self.ctx.timer("wait"):
            w = self.silence.first({v: self.posted[v] for v in live}, IDLE, wake_every=1.0)
        if time.monotonic() >= self.next_liveness_check:  # (the others may keep talking)
            self.next_liveness_check = time.monotonic() + 1.0
            lost = self.silence.lost({v: self.posted[v] for v in live}, self.liveness)
            if lost is not None:
                late, why = lost
                raise stalled(self.comm, late, f"sent nothing: {why}",
                              waiting=[v for v in live if v != late])
        if w is None:
            return None
        self.liveness.observe(w, self.silence.silent_for(w))
        self.silence.heard(w)
        return w

    def _handle_complete_reports(self) -> None:
        for step in sorted(self.reports):
            if len(self.reports[step]) < len(self.worker_ranks):
                return
            self._handle_step(step, self.reports.pop(step))

    def _handle_step(self, step: int, reports: Dict[int, Header]) -> None:
        ctx, comm, timer = self.ctx, self.comm, self.ctx.timer
        union = 0
        for h in reports.values():
            union |= h.flags
        nonfinite = [w for w, h in reports.items() if h.flags & DIVERGED]
        with timer("comm"):
            comm.wait(comm.irecv(self.weights, 1, TAG_WEIGHTS, "pull", "the weights"), IDLE)
            state = self._receive_checkpoint_state(reports) if union & SAVE else None
        if nonfinite:
            raise diverged_at(ctx, nonfinite, step)
        self._check_replicas(step, reports)
        ctx.replica.set_state(self.weights)
        train_loss = float(np.mean([h.loss for h in reports.values()]))
        wall = self.wall = max(h.elapsed for h in reports.values())
        checkpoint = None
        if state is not None:
            optimizer, rng, codecs = state
            n = ctx.replica.n_params
            checkpoint = Checkpoint(self.weights[:n].copy(), optimizer, step, wall,
                                    meta=CheckpointMeta.sync(ctx.geometry, rng),
                                    buffers=self.weights[n:].copy(), codecs=codecs)
        evaluate_and_save(ctx, (lambda: self.evaluator.record(step, train_loss, wall))
                          if union & EVALUATE else None, checkpoint)
        timer.end_epoch(round(step / ctx.steps_per_epoch, 4))
        if union & INTERRUPTED:
            raise interrupted(ctx, f"at step {step}", self.evaluator.summary(wall))

    def _receive_checkpoint_state(self, reports: Dict[int, Header]):
        comm, replica = self.comm, self.ctx.replica
        layout = self.optimizer_layout
        packed = np.empty(packed_size(layout), np.uint8)
        comm.wait(comm.irecv(packed, 1, TAG_STATE, "checkpoint", "the optimizer state"), IDLE)
        rng = {}
        width = replica.rng_state().size
        if width:
            for w in self.worker_ranks:
                row = np.empty(width, np.int64)
                comm.wait(comm.irecv(row, w, TAG_RNG, "checkpoint", "the generator state"),
                          IDLE)
                rng[w] = row.tolist()
        # the workers' compression states, from those whose report says one follows
        # (:meth:`mpitrain.exchange.FusedExchange.codec_state`)
        codecs = receive_codec_states(self.comm, [w for w, h in reports.items()
                                                  if h.flags & CODEC], "its compression state")
        return unpack_state(packed, layout), rng, codecs

    def _check_replicas(self, step: int, reports: Dict[int, Header]) -> None:
        comm = self.comm
        sums = {w: h.aux for w, h in reports.items()}
        if checksum(self.weights) != sums[1]:
            raise ReplicaDrift(f"weights from {comm.name(1)} arrived corrupted at step {step} "
                               "(checksum mismatch in transit)")
        drifted = [w for w, s in sums.items() if s != sums[1]]
        if drifted:
            names = ", ".join(comm.name(w) for w in drifted)
            raise ReplicaDrift(f"sync replicas drifted apart at step {step}: weights on "
                               f"{names} differ from {comm.name(1)}'s; the allreduce "
                               "delivered different results to different ranks")

