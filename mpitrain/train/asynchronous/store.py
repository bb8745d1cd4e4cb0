"""The parameters an async server owns, their optimizer and their version."""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from ...run.checkpoint import Checkpoint, optimizer_mismatch
from ...models import optim
from ..protocol import SLOTS
from .compensation import Compensation, chosen
from .momentum import server_momentum, server_rate_factor
from .mailbox import PushCodec, norm_slots
from .sharded.partition import partition_of


class ParameterStore:
    """What a server's updates change: its share of the flat float32 weights (all of
    them with one server), updated in place by a numpy/C optimizer
    (:mod:`mpitrain.models.optim`: microseconds per update, no TensorFlow), the
    BatchNorm statistics (server 0's: the mean of the workers' latest, taken at
    evaluations and checkpoints) and the version (updates applied so far).

    A push carries this server's share of the gradient, then the gradient's global
    norm (:func:`.mailbox.norm_slots`, with K > 1), then (server 0) the worker's
    statistics: every server clips its share by the same factor, so clipping means what
    it means with one server.
    """

    def __init__(self, ctx, server: int = 0):
        replica, cfg = ctx.replica, ctx.cfg
        self.share = partition_of(ctx).share(server)
        n = self.share.stop - self.share.start
        self.n_params = replica.n_params  # of the whole model
        self.weights = np.ascontiguousarray(replica.weights()[self.share])
        # the workers' mean at the last evaluation; only server 0 holds them
        self.buffers = replica.buffers() if server == 0 else np.zeros(0, np.float32)
        self.optimizer = optimizer_of(ctx, n)
        self.codec = PushCodec.of(ctx, server, sends=False)
        self.norm_slots = norm_slots(cfg)
        self.gradient_end = SLOTS + self.codec.slots  # a push's gradient, its norm, buffers
        self.version = 0
        self.compensation = Compensation(
            chosen(cfg.asynchronous.compensation, self.n_params, cfg.workers), n,
            cfg.asynchronous.dc_lambda)
        self._factor = self.compensation.factor  # (bound once: it runs once per update)
        self._keeps_weights = self.compensation.keeps_weights

    def apply(self, push: np.ndarray, version: int) -> Optional[np.ndarray]:
        """Apply the gradient of ``push`` (a message), computed at ``version`` (its
        staleness is compensated: :mod:`.compensation`; clipped first if configured);
        returns a copy of the BatchNorm statistics it carries, or None."""
        end = self.gradient_end
        norm = float(push[end]) if self.norm_slots else None  # (one server: its own)
        grad = self.codec.decode(push[SLOTS:end])
        if self._keeps_weights:
            self.compensation.apply_to(grad, version, self.weights)
        self.optimizer.step(self.weights, grad, norm, self._factor(self.version - version))
        self.version += 1
        end += self.norm_slots
        return push[end:].copy() if push.size > end else None

    def write_lease(self, lease: np.ndarray) -> None:
        """The weights and statistics into ``lease`` (a reply message, after its header)."""
        n = self.weights.size
        lease[SLOTS:SLOTS + n] = self.weights
        if self.buffers.size:
            lease[SLOTS + n:] = self.buffers
        if self._keeps_weights:
            self.compensation.lent(self.version, self.weights)

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

    def state(self) -> Dict[str, np.ndarray]:
        """A copy of this share's weights (``weights``) and optimizer state (its slots by
        name, ``iterations``), with the ``version``: what another server or a checkpoint
        takes it up from (:meth:`load`)."""
        return {"weights": self.weights.copy(), "version": np.array(self.version),
                **self.optimizer.state()}

    def load(self, state: Dict[str, np.ndarray]) -> None:
        """Continue from ``state`` (:meth:`state`'s form, of this share)."""
        self.weights = np.ascontiguousarray(state["weights"], np.float32)
        self.optimizer.load_state(state)
        self.version = int(state["version"])

    def restore(self, ckpt: Checkpoint, resume: str) -> None:
        """Continue from ``ckpt`` (of the run in ``resume``; it holds every parameter, so
        this store takes its share). An optimizer state that does not fit is a
        UsageError this rank alone knows (it reports, the job ends)."""
        whole = {name: ((self.n_params,) if shape else shape, dtype)
                 for name, (shape, dtype) in self.optimizer.layout().items()}
        mismatch = optimizer_mismatch(ckpt.optimizer, whole, resume,
                                      everywhere=False)  # the server alone reads it
        if mismatch is not None:
            raise mismatch
        if ckpt.buffers.size and self.buffers.size:
            self.buffers = ckpt.buffers.astype(np.float32).copy()
        self.load(share_of_checkpoint(ckpt, self.share))


def optimizer_of(ctx, n: int) -> optim.FlatOptimizer:
    """A server's optimizer over ``n`` parameters: the run's, its momentum lowered by
    asynchrony's own and its rate raised to keep the long-run step (:mod:`.momentum`)."""
    cfg = ctx.cfg
    return optim.make(cfg.optimizer.name, n, cfg.effective_lr * server_rate_factor(cfg),
                      ctx.lr_schedule, cfg.optimizer.clip_grad_norm, server_momentum(cfg))


def fresh_share_state(ctx, weights: np.ndarray, share: slice) -> Dict[str, np.ndarray]:
    """The :meth:`ParameterStore.state` of the parameters ``share`` of ``weights`` (the
    initial model) before any update."""
    optimizer = optimizer_of(ctx, share.stop - share.start)
    return {"weights": np.ascontiguousarray(weights[share]), "version": np.array(0),
            **optimizer.state()}


def share_of_checkpoint(ckpt: Checkpoint, share: slice) -> Dict[str, np.ndarray]:
    """The :meth:`ParameterStore.state` of the parameters ``share`` at ``ckpt``."""
    return {"weights": ckpt.weights[share].astype(np.float32),
            "version": np.array(ckpt.step),
            **{name: np.asarray(value)[share] if np.ndim(value) else np.asarray(value)
               for name, value in ckpt.optimizer.items()}}


def whole_state(shares: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Every server's :meth:`ParameterStore.state`, in server order, as one: the weights
    and each optimizer slot concatenated; the counts (version, iterations) server 0's."""
    first = shares[0]
    return {name: np.concatenate([s[name] for s in shares]) if np.ndim(value) else value
            for name, value in first.items()}
