"""``hvd.elastic`` of ``horovod.tensorflow.keras``: :class:`KerasState` and the callbacks
that keep it current while ``model.fit`` runs (see :mod:`mpitrain.horovod.elastic` for
what a commit, a stop and a restart do here).

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(data, steps_per_epoch=..., epochs=epochs - state.epoch,
                  callbacks=callbacks)
"""

from __future__ import annotations

import keras

from ..elastic import (HorovodInternalError, HostsUpdatedInterrupt,  # noqa: F401
                       ObjectState, State, TensorFlowKerasState, TensorFlowState, run)


class KerasState(TensorFlowKerasState):
    """A Keras model (built), its optimizer (the model's own by default) and attributes."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch's end.
    Collective: every rank commits at the same batches."""

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_left = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_left = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_left -= 1
        if self.batches_left == 0:
            self.state.commit()
            self.batches_left = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the batch just trained (0 at each epoch's end); with
    ``steps_per_epoch``, the first epoch after a restart trains only the batches it
    had left."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        steps = (self.params or {}).get("steps")
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the epochs done, counted across restarts (Keras counts
    each ``fit`` from 0)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch  # type: ignore[attr-defined]  # (an ObjectState's)

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
