"""When the async server evaluates and checkpoints, and what it hands its evaluator."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np

from ...run.checkpoint import Checkpoint
from ..evaluation import BackgroundEvaluator, Evaluator

class Milestones:
    """The server's evaluations (every ``--eval-every`` epochs of updates, and at the
    end) and checkpoints (every ``--checkpoint-every`` epochs, every
    ``--checkpoint-steps`` steps of each worker, and at the end), with the mean train
    loss of the pushes between evaluations. They run on a background thread
    (:class:`..evaluation.BackgroundEvaluator`), on copies: ``snapshot()`` gives the
    state to evaluate, ``checkpoint()`` the checkpoint of the current version.

    Per update the server only appends the push's loss to :attr:`losses` and compares
    the version with :attr:`next_point` (it calls :meth:`reached` there): the loop
    applies tens of thousands of updates a second when workers push zeros.
    """

    def __init__(self, ctx, clock, n_workers: int, snapshot: Callable[[], np.ndarray],
                 checkpoint: Callable[[], Checkpoint]):
        self.clock, self.snapshot, self.checkpoint = clock, snapshot, checkpoint
        #: an epoch of updates: every worker's pass over its shard
        self.updates_per_epoch = n_workers * ctx.steps_per_epoch
        self.eval_interval = ctx.cfg.eval_every * self.updates_per_epoch
        self.checkpoint_interval = ctx.cfg.checkpoint.every * self.updates_per_epoch
        # --checkpoint-steps counts each worker's steps: N of theirs are N x workers updates
        self.checkpoint_steps = (ctx.cfg.checkpoint.steps or 0) * n_workers
        self.losses: List[float] = []  # of the pushes applied since the last evaluation
        self.last_loss = float("nan")  # the latest push's, once its evaluation took them
        #: the next version to evaluate or save at (see start); math.inf once there is
        #: none (with other servers, the end's is made of their final shares: .server)
        self.next_point: float = 0
        self.evaluations = BackgroundEvaluator(Evaluator(
            ctx, clock, self.updates_per_epoch, ctx.cfg.batch_size, n_workers * ctx.total_steps))

    def start(self, version: int, fresh: bool) -> None:
        """Training starts at ``version``; a ``fresh`` run's (not resumed) with the initial
        weights' evaluation, so its curve starts at update 0."""
        if fresh:
            self.evaluations.submit(0, self.snapshot(), None, 0.0)
        self.next_point = self._point_after(version)

    def _point_after(self, version: int) -> int:
        every = [self.eval_interval, self.checkpoint_interval, self.checkpoint_steps]
        return min((version // n + 1) * n for n in every if n)

    def reached(self, version: int) -> None:
        """``version`` is :attr:`next_point`: evaluate and/or save."""
        self.queue(version, *self.due(version), self.clock())

    def due(self, point: int) -> Tuple[bool, bool]:
        """(evaluate, save) at ``point`` (:attr:`next_point`), which moves on past it."""
        evaluate = point % self.eval_interval == 0
        save = point % self.checkpoint_interval == 0 or bool(
            self.checkpoint_steps and point % self.checkpoint_steps == 0)
        self.next_point = self._point_after(point)
        return evaluate, save

    def progress(self, version: int) -> None:
        loss = self.losses[-1] if self.losses else self.last_loss
        self.evaluations.evaluator.progress(version, loss)

    def finish(self, version: int, wall: float, record: bool = True) -> None:
        """The last checkpoint and, unless ``version`` had one, the last evaluation (none
        of them unless ``record``: a diverged run's weights are not kept); waits for
        every queued one."""
        if record:
            self.queue(version, self.evaluations.last_step != version, True, wall)
        self.evaluations.close()

    def queue(self, version: int, evaluate: bool, save: bool, wall: float) -> None:
        """Queue ``version``'s evaluation and/or checkpoint (written meanwhile)."""
        checkpoint = self.checkpoint() if save else None
        self.submit(version, self.snapshot() if evaluate else None, checkpoint, wall)

    def submit(self, version: int, state: Optional[np.ndarray],
               checkpoint: Optional[Checkpoint], wall: float) -> None:
        """Queue the evaluation of ``state`` (None: none) and the writing of
        ``checkpoint`` (None: none), both of ``version``."""
        if state is not None:
            self.evaluations.submit(version, state, self._train_loss(), wall, checkpoint)
        elif checkpoint is not None:
            self.evaluations.save(checkpoint)

    def _train_loss(self) -> Optional[float]:
        if not self.losses:
            return None
        loss, self.last_loss = float(np.mean(self.losses)), self.losses[-1]
        self.losses.clear()
        return loss

    def summary(self, wall: float, **extra):
        return self.evaluations.evaluator.summary(wall, **extra)
