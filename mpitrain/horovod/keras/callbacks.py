"""Horovod's Keras callbacks for ``model.fit`` on Keras 3.

* :class:`BroadcastGlobalVariablesCallback`: every rank starts from ``root_rank``'s
  weights and optimizer state.
* :class:`MetricAverageCallback`: the epoch's logs (loss, metrics, validation) are
  averaged over every rank, for the callbacks after it (put it before them).
* :class:`LearningRateWarmupCallback`, :class:`LearningRateScheduleCallback`: Goyal et
  al.'s gradual warm-up and step schedules, Horovod's formulas.

Each is collective where it communicates: every rank runs ``fit`` with the same
callbacks (a rank-0-only ``ModelCheckpoint`` does not communicate, so it may be on
rank 0 alone).
"""

from __future__ import annotations

from typing import Set

import numpy as np

from .. import world as runtime
from ..collectives import Average
from ..ops import _call
from ..variables import broadcast_variables

import keras


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's variables and its optimizer's from ``root_rank`` to every rank
    when training begins (Keras 3 builds both before that), or after the first batch if
    something was built only then (Horovod's moment)."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local: Set[int] = set()
        for var in local_variables or ():  # Horovod's: left out of the broadcast
            self.register_local_var(var)

    def register_local_var(self, var) -> None:
        """Leave ``var`` out of the broadcast."""
        self._local.add(id(var))

    def _built(self) -> bool:
        optimizer = getattr(self.model, "optimizer", None)
        return self.model.built and (optimizer is None or optimizer.built)

    def _broadcast(self) -> None:
        broadcast_variables([v for v in self.model.variables if id(v) not in self._local],
                            self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            broadcast_variables(optimizer.variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if not self.broadcast_done and self._built():
            self._broadcast()

    def on_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def on_epoch_end(self, epoch, logs=None):
        epoch_ended(epoch, logs)


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each number in the logs by its average over
    every rank (one allreduce of them all, in sorted order). Ranks whose logs hold other
    names stop with one line naming them."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        average_logs(logs)
        epoch_ended(epoch, logs)


def epoch_ended(epoch: int, logs) -> None:
    """Tell the telemetry (``hvd.init(results_dir=...)``), if on, that an epoch ended."""
    if runtime.STATE.telemetry is not None:
        runtime.STATE.telemetry.epoch_end(epoch, logs)


def average_logs(logs) -> None:
    """Average the numbers in ``logs`` over every rank, in place (collective)."""
    if not logs:
        return
    names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _number(v))
    values = np.array([float(logs[k]) for k in names], np.float64)
    _call(lambda: runtime.engine().allreduce_(values, Average, shape=tuple(names),
                                              name="metrics"))
    for name, value in zip(names, values):
        logs[name] = float(value)


def _number(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Learning rate ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until
    ``end_epoch`` (``multiplier`` a number: ``multiplier ** (epoch - start_epoch)``); per
    epoch with ``staircase``, else per batch with fractional epochs. With
    ``momentum_correction``, each change by a factor r also scales the optimizer's
    momentum buffers by r (SGD, RMSprop): Horovod scales the momentum coefficient for
    one step, which is the same update, and Keras 3 compiles that coefficient into the
    training step."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else (
            lambda epoch: multiplier ** (epoch - start_epoch))
        self.current_epoch = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(f"{type(self).__name__} could not tell the steps per epoch: "
                                 "pass steps_per_epoch= (to the callback or to fit)")
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(epoch)
        elif not self.staircase:
            self._adjust(epoch + float(batch) / self.steps_per_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = learning_rate(optimizer)
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        if self.momentum_correction and old and new != old:
            for buffer in momentum_buffers(optimizer):
                buffer.assign(buffer * (new / old))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up (Goyal et al.): over ``warmup_epochs`` the learning rate rises
    from ``initial_lr``/size to ``initial_lr`` (which is the rate scaled by the number of
    ranks), per batch, by Horovod's formula."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            size = runtime.topology().size
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime.topology().rank == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{learning_rate(self.model.optimizer):g}.")


def learning_rate(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def momentum_buffers(optimizer) -> list:
    """The optimizer's momentum (velocity) variables: SGD's, RMSprop's; none otherwise."""
    if not getattr(optimizer, "momentum", 0):
        return []
    return list(getattr(optimizer, "momentums", None) or getattr(optimizer, "_momentums", None)
                or [])
