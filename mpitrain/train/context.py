"""What both training protocols share: the run context, the summary, worker batches,
evaluation and checkpoint points, the errors that stop every rank.

A trainer (:mod:`.sync`, :mod:`.asynchronous`) is a function
``train(ctx) -> Summary`` that every rank calls; it branches once on
``ctx.role`` to the server's or the worker's loop and never on rank for I/O
(``ctx.results`` and ``ctx.console`` do nothing on ranks that must not write).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple, cast

import numpy as np

from ..comm import Comm, Role
from ..config import Config
from ..data.shards import Dataset, batches_per_epoch, epoch_batches
from ..errors import Divergence, Interrupted
from ..run.checkpoint import Checkpoint, Geometry, geometry
from ..run.signals import StopRequest
from ..models.optim import Schedule
from ..models.replica import Replica
from .protocol import PhaseTimer


class ResultsWriter(Protocol):
    """Where a trainer writes the run's results: :class:`mpitrain.results.run_dir.RunResults` on
    the serving rank, :class:`mpitrain.results.run_dir.NullResults` (the same methods, doing
    nothing) on every other, so that trainers never branch on rank for I/O. Both are
    checked against this by mypy where :mod:`mpitrain.run.session` builds the context
    (tests/unit/test_lint.py): a method added to one and not the other fails there."""

    @property
    def path(self) -> Optional[Path]: ...

    def write_json(self, name: str, obj: object) -> None: ...

    def add_curve_row(self, row: Dict) -> None: ...

    def scalars(self, step: int, values: Dict[str, Optional[float]]) -> None: ...

    def write_csv(self, name: str, columns: List[str], rows: Iterable[Dict]) -> None: ...

    def replace_csv(self, name: str, columns: List[str], rows: Iterable[Dict]) -> None: ...

    def add_run_row(self, row: Dict) -> None: ...

    def save_checkpoint(self, checkpoint: Checkpoint,
                        meanwhile: Optional[Callable[[], object]] = None) -> None: ...

    def set_status(self, status: str, reason: str = "", **facts: object) -> None: ...

    def note_progress(self, step: int) -> None: ...


class ConsoleOutput(Protocol):
    """What a trainer prints through: :class:`mpitrain.run.console.Console` on the serving
    rank, :class:`mpitrain.run.console.NullConsole` (no output) elsewhere; checked like
    :class:`ResultsWriter`."""

    quiet: bool
    accuracy: Optional[float]  # the last test accuracy, shown in the progress line

    def info(self, message: str) -> None: ...

    def note(self, message: str) -> None: ...

    def summary(self, lines: Iterable[str]) -> None: ...

    def progress(self, epoch: float, epochs: int, step: int, total: int, loss: float,
                 examples_per_s: float, eta_s: float) -> None: ...


@dataclass
class Context:
    """Everything a trainer needs, built once per run by :mod:`mpitrain.run.session`."""

    cfg: Config
    comm: Comm
    role: Role
    replica: Replica
    data: Dataset  # the splits this rank needs (train shard on workers, test on the server)
    results: ResultsWriter  # RunResults on the serving rank, NullResults elsewhere
    console: ConsoleOutput  # Console on the serving rank, NullConsole elsewhere
    stop: StopRequest = field(default_factory=StopRequest)  # set by SIGTERM/SIGINT/SIGUSR1
    resume_from: Optional[Checkpoint] = None  # the checkpoint being resumed (serving rank)
    run_dir: Optional[str] = None  # the run directory (rank 0's), known on every rank
    timer: PhaseTimer = field(default_factory=PhaseTimer)  # this rank's time breakdown
    shard_size: int = 0  # examples in each worker's shard (equal for all workers)
    worker_index: int = 0  # position among the workers (0..workers-1); 0 on the server
    #: workers the async server dropped under --enable-recovery (on rank 0; dicts with
    #: rank, host, update, step, wall_time_s, reason), also those of earlier sessions
    lost: List[dict] = field(default_factory=list)
    #: how this session continues a run saved on another number of ranks ('' if it does not)
    rescaled: str = ""
    #: the process ends with this run (the CLI's last): what the run changes about the
    #: process need not be undone (see .priority)
    ends_process: bool = False
    #: called by the trainer once it has what it needs from the other ranks (its
    #: mailboxes): the job's start-up is over, a lost worker is the trainer's to handle
    #: from then on (see mpitrain.run.startup)
    started: Callable[[], None] = lambda: None

    @property
    def geometry(self) -> Geometry:
        """The units of this session's checkpoint positions (see resume.remap_position)."""
        return geometry(self.cfg)

    @property
    def steps_per_epoch(self) -> int:
        """Updates a worker makes in one pass over its shard."""
        return batches_per_epoch(self.shard_size, cast(int, self.cfg.batch_size))

    @property
    def lr_schedule(self) -> Optional[Schedule]:
        return lr_schedule(self.cfg, self.shard_size)

    @property
    def total_steps(self) -> int:
        """Steps each worker runs: all epochs, or the --steps/--dry-run cap."""
        total = self.steps_per_epoch * cast(int, self.cfg.epochs)
        return total if self.cfg.max_steps is None else min(total, self.cfg.max_steps)


def lr_schedule(cfg: Config, shard_size: int) -> Optional[Schedule]:
    """The learning rate's course over the run's updates (every worker's step in sync
    mode, every push applied in async): gradual warm-up over ``cfg.warmup`` epochs from
    one worker's rate to the scaled one (from 0 where the rate is not scaled), then
    constant or cosine decay to 0 at the last update; None: constant throughout."""
    updates_per_epoch = batches_per_epoch(shard_size, cast(int, cfg.batch_size)) * (
        cfg.workers if cfg.mode == "async" else 1)
    warmup = round(cfg.warmup * updates_per_epoch)
    decay = (updates_per_epoch * cast(int, cfg.epochs) if cfg.optimizer.schedule == "cosine"
             else None)
    if not warmup and decay is None:
        return None
    return Schedule(warmup, 1.0 / cfg.lr_scale if cfg.lr_scale > 1 else 0.0, decay)


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

    Shuffled reproducibly per (seed, worker, epoch) (a streamed shard set: per (seed,
    epoch) across the workers, see :mod:`mpitrain.data.order`), so a resumed run sees
    the very batches the uninterrupted run would have (the batches before it are not
    read); stops after :attr:`Context.total_steps`, possibly mid-epoch (then
    end_of_epoch is True for the last step so the caller reports it). ``endless`` goes
    on with further passes over the shard (the caller decides when to stop: an async
    worker whose quota grew when another worker was lost).
    """
    total, per_epoch = (0 if endless else ctx.total_steps), ctx.steps_per_epoch
    last_epoch = None if endless else ctx.cfg.epochs
    for epoch in itertools.count(start_step // per_epoch + 1):
        if last_epoch is not None and epoch > last_epoch:
            return
        first = max(0, start_step - (epoch - 1) * per_epoch)
        for i, (x, y) in enumerate(_epoch_batches(ctx, epoch, first), start=first):
            step = (epoch - 1) * per_epoch + i + 1
            last = step == total
            yield epoch, step, x, y, last or i == per_epoch - 1
            if last:
                return


def _epoch_batches(ctx: Context, epoch: int, first: int) -> Iterator[Tuple[np.ndarray,
                                                                           np.ndarray]]:
    """(x, y) of this worker's batches ``first``.. of ``epoch``."""
    batch_size = cast(int, ctx.cfg.batch_size)
    if ctx.data.stream is not None:
        yield from ctx.data.stream.epoch(batch_size, epoch, first)
        return
    x, y = cast(np.ndarray, ctx.data.x_train), cast(np.ndarray, ctx.data.y_train)  # (a worker's)
    batches = epoch_batches(len(y), batch_size, ctx.cfg.seed, ctx.worker_index, epoch)
    for idx in itertools.islice(batches, first, None):
        yield x[idx], y[idx]


def is_eval_point(ctx: Context, epoch: int, step: int) -> bool:
    """Evaluate after every ``eval_every``-th epoch and after the final step."""
    return step == ctx.total_steps or epoch % ctx.cfg.eval_every == 0


def interrupted(ctx: Context, when: str, summary: Optional[Summary] = None) -> Interrupted:
    """The serving rank's error when a stop signal ended the run (every rank stops)."""
    path = ctx.results.path
    return Interrupted(f"stopped by {ctx.stop.name or 'a signal to a worker'} {when}; "
                       f"checkpoint saved in {path}, resume with --resume {path}",
                       everywhere=True, summary=summary)


def diverged(where: str, summary: Optional[Summary] = None) -> Divergence:
    """The error when a non-finite loss or gradient stopped the run (every rank stops)."""
    return Divergence(f"training diverged: non-finite loss or gradient on {where}; "
                      "lower --lr or set --clip-grad-norm", everywhere=True, summary=summary)


def is_checkpoint_point(ctx: Context, epoch: int, step: int, end_of_epoch: bool) -> bool:
    """Checkpoint after every ``checkpoint_every``-th epoch, every ``checkpoint_steps``
    steps and after the final step. Every worker computes it alike from its step."""
    every = ctx.cfg.checkpoint.steps
    return (step == ctx.total_steps or (end_of_epoch and epoch % ctx.cfg.checkpoint.every == 0)
            or bool(every and step % every == 0))
