"""The serving rank's evaluation: the curve, TensorBoard scalars, the progress line, the
run's clock, and (async) evaluation and checkpoint writing on a background thread."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Dict, Optional, cast

import numpy as np

from ..run.checkpoint import Checkpoint
from .context import Context, Summary


class Evaluator:
    """The serving rank's evaluation, curve, TensorBoard scalars and progress line.

    ``updates`` count server updates: a worker's steps in sync mode (each
    update uses the global batch), all workers' pushes in async mode (each
    uses one worker's batch). :meth:`record` evaluates the replica's current
    weights and appends one row to ``curve.csv``; it and :meth:`progress` are
    only called on the rank that serves.
    """

    def __init__(self, ctx: Context, clock: "Stopwatch", updates_per_epoch: int,
                 examples_per_update: int, total_updates: int):
        self.ctx, self.clock = ctx, clock
        self.updates_per_epoch = updates_per_epoch
        self.examples_per_update = examples_per_update
        self.total_updates = total_updates
        self.last: Dict[str, Any] = {}  # the latest curve row
        self._since = (0, 0.0)  # (updates, wall) at the previous evaluation

    @classmethod
    def for_sync(cls, ctx: Context, clock: "Stopwatch") -> "Evaluator":
        return cls(ctx, clock, ctx.steps_per_epoch, ctx.cfg.global_batch, ctx.total_steps)

    def record(self, step: int, train_loss: Optional[float], wall_time_s: float) -> Dict:
        ctx = self.ctx
        test_loss, test_acc = ctx.replica.evaluate(  # (the serving rank's test split)
            cast(np.ndarray, ctx.data.x_test), cast(np.ndarray, ctx.data.y_test))
        prev_step, prev_wall = self._since
        rate = ((step - prev_step) * self.examples_per_update / (wall_time_s - prev_wall)
                if wall_time_s > prev_wall else None)
        self._since = (step, wall_time_s)
        row = {"epoch": round(step / self.updates_per_epoch, 4), "step": step,
               "wall_time_s": round(wall_time_s, 4), "train_loss": train_loss,
               "test_loss": test_loss, "test_accuracy": test_acc,
               "examples_per_s": round(rate, 1) if rate else None}
        ctx.results.add_curve_row(row)
        ctx.results.scalars(step, {"train/loss": train_loss, "test/loss": test_loss,
                                   "test/accuracy": test_acc, "train/examples_per_s": rate,
                                   "epoch": row["epoch"]})
        ctx.console.accuracy = test_acc
        ctx.console.info(
            f"epoch {row['epoch']:>7g}/{ctx.cfg.epochs}  step {step:>6}  "
            + (f"train loss {train_loss:.4f}  " if train_loss is not None else "")
            + f"test loss {test_loss:.4f}  test acc {100 * test_acc:6.2f}%  "
            + (f"{rate:9,.0f} ex/s  " if rate else "") + f"{wall_time_s:8.2f} s")
        self.last = row
        return row

    def progress(self, updates: int, loss: float) -> None:
        """Update the progress display (throttled by the console) and the progress the
        run's status.json records (throttled by the results)."""
        elapsed = self.clock()
        rate = updates / elapsed if elapsed > 0 else 0.0
        eta = (self.total_updates - updates) / rate if rate > 0 else 0.0
        self.ctx.console.progress(updates / self.updates_per_epoch, cast(int, self.ctx.cfg.epochs),
                                  updates, self.total_updates, loss,
                                  rate * self.examples_per_update, eta)
        self.ctx.results.note_progress(updates)

    def summary(self, wall_time_s: Optional[float], **extra) -> Summary:
        """The run's outcome. ``wall_time_s`` is its training time: the clock at the
        last update (its final evaluation and checkpoint excluded, as TensorFlow's own
        measurements exclude theirs; None: no update was reported, so now);
        ``finish_s``, the seconds from then to now."""
        row, now = self.last, self.clock()
        wall_time_s = now if wall_time_s is None else wall_time_s
        extra = {**extra, "finish_s": round(now - wall_time_s, 3)}
        return Summary(wall_time_s=wall_time_s, steps=int(row["step"]),
                       epochs_done=float(row["epoch"]), test_loss=float(row["test_loss"]),
                       test_accuracy=float(row["test_accuracy"]),
                       train_loss=row["train_loss"], extra=dict(extra))


def evaluate_and_save(ctx: Context, evaluate: Optional[Callable[[], object]],
                      checkpoint: Optional[Checkpoint]) -> None:
    """Run ``evaluate`` (it appends a curve row) and save ``checkpoint``; either may be
    None. With both, the checkpoint is written while the evaluation runs and replaces
    the previous one after it (:meth:`mpitrain.run.checkpoint.Checkpoint.save`). Local to the
    serving rank."""
    if checkpoint is not None:
        ctx.results.save_checkpoint(checkpoint, meanwhile=evaluate)
    elif evaluate is not None:
        evaluate()


class Stopwatch:
    """Wall time since the training start (a shared point: the initial broadcast).

    ``offset`` continues the clock of a resumed run where its checkpoint left it.
    """

    def __init__(self, offset: float = 0.0):
        self.offset = offset
        self.restart()

    def restart(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return self.offset + time.perf_counter() - self.t0


class BackgroundEvaluator:
    """Evaluates weight snapshots on a thread, in order, so the protocol never waits.

    Only this thread touches TensorFlow and the curve on the server.
    """

    def __init__(self, evaluator: Evaluator):
        self.ctx = evaluator.ctx
        self.evaluator = evaluator
        self.last_step: Optional[int] = None
        self.jobs: "queue.Queue" = queue.Queue()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="evaluator", daemon=True)
        self.thread.start()

    def submit(self, version: int, state: np.ndarray, train_loss, wall: float,
               checkpoint: Optional[Checkpoint] = None) -> None:
        """Evaluate ``state`` (weights and buffers, a copy the caller will not touch) in
        the background, and save ``checkpoint`` (of the same version) meanwhile."""
        self.last_step = version
        self._put(lambda: evaluate_and_save(
            self.ctx, lambda: self._evaluate(version, state, train_loss, wall), checkpoint))

    def save(self, checkpoint: Checkpoint) -> None:
        """Write ``checkpoint`` in the background, in order with the evaluations."""
        self._put(lambda: self.ctx.results.save_checkpoint(checkpoint))

    def _put(self, job) -> None:
        if self.error is not None:
            raise self.error
        self.jobs.put(job)

    def _evaluate(self, version: int, state: np.ndarray, train_loss, wall: float) -> None:
        self.ctx.replica.set_state(state)
        self.evaluator.record(version, train_loss, wall)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # surfaced to the server loop on its next submit
                self.error = e
                return

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
