"""What both training protocols share: the run context, evaluation, worker batches.

A trainer (:mod:`.sync_trainer`, :mod:`.async_trainer`) is a function
``train(ctx) -> Summary`` that every rank calls; it branches once on
``ctx.role`` to the server's or the worker's loop and never on rank for I/O
(``ctx.results`` and ``ctx.console`` do nothing on ranks that must not write).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .comm import Comm, Role
from .config import Config
from .data import Dataset, batches_per_epoch, epoch_batches
from .errors import Divergence, Interrupted
from .replica import Replica
from .lifecycle import Checkpoint, StopRequest, geometry
from .telemetry import EpochTimer

#: message tags of the worker <-> server protocols (both modes)
TAG_REPORT = 21  # sync: worker -> server progress and epoch reports
TAG_WEIGHTS = 22  # sync: worker 1 -> server weights; async: server -> worker leases
TAG_GRADIENT = 23  # async: worker -> server gradient pushes
TAG_STOP = 24  # sync: server -> worker, exactly once per run (stop now / stop listening)
TAG_STATE = 25  # sync: worker 1 -> server optimizer state at checkpoints
TAG_RNG = 26  # sync: every worker -> server random-generator state at checkpoints

#: workers tell the server they are alive (and how far they are) this often, at least
HEARTBEAT_SECONDS = 1.0


@dataclass
class Context:
    """Everything a trainer needs, built once per run by :mod:`.session`."""

    cfg: Config
    comm: Comm
    role: Role
    replica: Replica
    data: Dataset  # the splits this rank needs (train shard on workers, test on the server)
    results: object  # RunResults on the serving rank, NullResults elsewhere
    console: object  # Console on the serving rank, NullConsole elsewhere
    stop: StopRequest = field(default_factory=StopRequest)  # set by SIGTERM/SIGINT/SIGUSR1
    resume_from: Optional[Checkpoint] = None  # the checkpoint being resumed (serving rank)
    run_dir: Optional[str] = None  # the run directory (rank 0's), known on every rank
    timer: EpochTimer = field(default_factory=EpochTimer)  # this rank's time breakdown
    shard_size: int = 0  # examples in each worker's shard (equal for all workers)
    worker_index: int = 0  # position among the workers (0..workers-1); 0 on the server
    #: workers the async server dropped under --enable-recovery (on rank 0; dicts with
    #: rank, host, update, step, wall_time_s, reason), also those of earlier sessions
    lost: List[dict] = field(default_factory=list)
    #: how this session continues a run saved on another number of ranks ('' if it does not)
    rescaled: str = ""

    @property
    def geometry(self) -> Dict[str, int]:
        """The units of this session's checkpoint positions (see lifecycle.remap_position)."""
        return geometry(self.cfg)

    @property
    def steps_per_epoch(self) -> int:
        """Updates a worker makes in one pass over its shard."""
        return batches_per_epoch(self.shard_size, self.cfg.batch_size)

    @property
    def workers(self) -> int:
        return self.cfg.workers

    @property
    def decay_steps(self) -> Optional[int]:
        return decay_steps(self.cfg, self.shard_size)

    @property
    def total_steps(self) -> int:
        """Steps each worker runs: all epochs, or the --steps/--dry-run cap."""
        total = self.steps_per_epoch * self.cfg.epochs
        return total if self.cfg.max_steps is None else min(total, self.cfg.max_steps)


def decay_steps(cfg: Config, shard_size: int) -> Optional[int]:
    """Updates over which a cosine schedule decays (all the run's updates), or None."""
    if cfg.lr_schedule != "cosine":
        return None
    updates_per_step = cfg.workers if cfg.mode == "async" else 1
    return batches_per_epoch(shard_size, cfg.batch_size) * cfg.epochs * updates_per_step


@dataclass
class Summary:
    """The outcome of a run, as the serving rank saw it."""

    wall_time_s: float
    steps: int
    epochs_done: float
    test_loss: float
    test_accuracy: float
    train_loss: float
    extra: Dict[str, object] = field(default_factory=dict)
    run_dir: Optional[str] = None  # where the serving rank wrote the results; None elsewhere


def worker_batches(ctx: Context, start_step: int = 0, endless: bool = False
                   ) -> Iterator[Tuple[int, int, np.ndarray, np.ndarray, bool]]:
    """(epoch, step, x, y, end_of_epoch) for each of this worker's steps after ``start_step``.

    Shuffled reproducibly per (seed, worker, epoch), so a resumed run sees the
    very batches the uninterrupted run would have; stops after
    :attr:`Context.total_steps`, possibly mid-epoch (then end_of_epoch is True
    for the last step so the caller reports it). ``endless`` goes on with
    further passes over the shard (the caller decides when to stop: an async
    worker whose quota grew when another worker was lost).
    """
    x, y = ctx.data.x_train, ctx.data.y_train
    total, per_epoch = (0 if endless else ctx.total_steps), ctx.steps_per_epoch
    last_epoch = None if endless else ctx.cfg.epochs
    for epoch in itertools.count(start_step // per_epoch + 1):
        if last_epoch is not None and epoch > last_epoch:
            return
        batches = epoch_batches(len(y), ctx.cfg.batch_size, ctx.cfg.seed, ctx.worker_index,
                                epoch)
        for i, idx in enumerate(batches):
            step = (epoch - 1) * per_epoch + i + 1
            if step <= start_step:
                continue
            last = step == total
            yield epoch, step, x[idx], y[idx], last or i == per_epoch - 1
            if last:
                return


def is_eval_point(ctx: Context, epoch: int, step: int) -> bool:
    """Evaluate after every ``eval_every``-th epoch and after the final step."""
    return step == ctx.total_steps or epoch % ctx.cfg.eval_every == 0


def interrupted(ctx: Context, when: str, summary: Optional[Summary] = None) -> Interrupted:
    """The serving rank's error when a stop signal ended the run (every rank stops)."""
    path = ctx.results.path
    error = Interrupted(f"stopped by {ctx.stop.name or 'a signal to a worker'} {when}; "
                        f"checkpoint saved in {path}, resume with --resume {path}",
                        everywhere=True)
    error.summary = summary
    return error


def diverged(where: str, summary: Optional[Summary] = None) -> Divergence:
    """The error when a non-finite loss or gradient stopped the run (every rank stops)."""
    error = Divergence(f"training diverged: non-finite loss or gradient on {where}; "
                       "lower --lr or set --clip-grad-norm", everywhere=True)
    error.summary = summary
    return error


def is_checkpoint_point(ctx: Context, epoch: int, step: int, end_of_epoch: bool) -> bool:
    """Checkpoint after every ``checkpoint_every``-th epoch, every ``checkpoint_steps``
    steps and after the final step. Every worker computes it alike from its step."""
    every = ctx.cfg.checkpoint_steps
    return (step == ctx.total_steps or (end_of_epoch and epoch % ctx.cfg.checkpoint_every == 0)
            or bool(every and step % every == 0))


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
        self.last: Dict[str, float] = {}
        self._since = (0, 0.0)  # (updates, wall) at the previous evaluation

    @classmethod
    def for_sync(cls, ctx: Context, clock: "Stopwatch") -> "Evaluator":
        return cls(ctx, clock, ctx.steps_per_epoch, ctx.cfg.global_batch, ctx.total_steps)

    def record(self, step: int, train_loss: Optional[float], wall_time_s: float) -> Dict:
        ctx = self.ctx
        test_loss, test_acc = ctx.replica.evaluate(ctx.data.x_test, ctx.data.y_test)
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
        """Update the progress display (throttled by the console)."""
        elapsed = self.clock()
        rate = updates / elapsed if elapsed > 0 else 0.0
        eta = (self.total_updates - updates) / rate if rate > 0 else 0.0
        self.ctx.console.progress(updates / self.updates_per_epoch, self.ctx.cfg.epochs,
                                  updates, self.total_updates, loss,
                                  rate * self.examples_per_update, eta)

    def summary(self, wall_time_s: float, **extra) -> Summary:
        row = self.last
        return Summary(wall_time_s=wall_time_s, steps=int(row["step"]),
                       epochs_done=float(row["epoch"]), test_loss=float(row["test_loss"]),
                       test_accuracy=float(row["test_accuracy"]),
                       train_loss=row["train_loss"], extra=dict(extra))


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
