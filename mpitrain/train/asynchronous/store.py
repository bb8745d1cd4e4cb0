"""The parameters an async server owns, their optimizer and their version."""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from ...lifecycle import Checkpoint, optimizer_mismatch
from ...models import optim
from ..protocol import SLOTS
from .mailbox import PushCodec


class ParameterStore:
    """What the server's updates change: the flat float32 weights, updated in place by
    a numpy/C optimizer (:mod:`mpitrain.models.optim`: microseconds per update, no
    TensorFlow), the BatchNorm statistics (the mean of the workers' latest, taken at
    evaluations and checkpoints) and the version (updates applied so far).

    Today rank 0 owns every parameter. A server owning a slice of them would hold a
    store of that slice (its weights, its optimizer state, its version), fed the
    matching slice of each push by its :class:`.mailbox.ServerEnd`.
    """

    def __init__(self, ctx):
        replica, cfg = ctx.replica, ctx.cfg
        n = replica.n_params
        self.weights = replica.weights()
        self.buffers = replica.buffers()  # the workers' mean at the last evaluation
        self.optimizer = optim.make(cfg.optimizer, n, cfg.effective_lr, ctx.decay_steps,
                                    cfg.clip_grad_norm)
        self.codec = PushCodec(cfg.compression, n)
        self.gradient_end = SLOTS + self.codec.slots  # a push's gradient, then its buffers
        self.version = 0

    def apply(self, push: np.ndarray) -> Optional[np.ndarray]:
        """Apply the gradient of ``push`` (a message; clipped first if configured);
        returns a copy of the BatchNorm statistics it carries, or None."""
        end = self.gradient_end
        self.optimizer.step(self.weights, self.codec.decode(push[SLOTS:end]))
        self.version += 1
        return push[end:].copy() if push.size > end else None

    def write_lease(self, lease: np.ndarray) -> None:
        """The weights and statistics into ``lease`` (a reply message, after its header)."""
        n = self.weights.size
        lease[SLOTS:SLOTS + n] = self.weights
        if self.buffers.size:
            lease[SLOTS + n:] = self.buffers

    def average_buffers(self, latest: List[np.ndarray]) -> np.ndarray:
        """The mean of the workers' ``latest`` BatchNorm statistics (each worker's follow
        its own batches), kept as the store's until the next call; a copy."""
        if latest:
            self.buffers = np.mean(latest, axis=0, dtype=np.float64).astype(np.float32)
        return self.buffers.copy()

    def snapshot(self, latest: List[np.ndarray]) -> np.ndarray:
        """The weights and the averaged statistics (:meth:`average_buffers`), to evaluate."""
        buffers = self.average_buffers(latest)
        return np.concatenate([self.weights, buffers]) if buffers.size else self.weights.copy()

    def restore(self, ckpt: Checkpoint, resume: str) -> None:
        """Continue from ``ckpt`` (of the run in ``resume``). An optimizer state that does
        not fit is a UsageError this rank alone knows (it reports, the job ends)."""
        self.weights = ckpt.weights.astype(np.float32).copy()
        if ckpt.buffers.size:
            self.buffers = ckpt.buffers.astype(np.float32).copy()
        mismatch = optimizer_mismatch(ckpt.optimizer, self.optimizer.layout(), resume,
                                      everywhere=False)  # the server alone reads it
        if mismatch is not None:
            raise mismatch
        self.optimizer.load_state(ckpt.optimizer)
        self.version = ckpt.step
