"""A model.fit script (mpitrain.horovod.keras) that resumes from its own checkpoints and
fails once, for the ``mpitrain launch`` restart of tests/e2e/test_horovod_api_mpirun.py:

    mpitrain launch -np 2 tests/helpers/hvd_fit_fails_once.py CHECKPOINT_DIR

Rank 0 saves a checkpoint after every epoch; in the first attempt the last rank raises
after the first step of epoch 2 (after a gradient allreduce, so rank 0 has saved
epoch 1's checkpoint by then), which ends the job; the next attempt loads the newest
checkpoint and trains epoch 2 only.
"""

import sys
from pathlib import Path

import mpitrain.horovod.keras as hvd

import keras
import numpy as np

checkpoints = Path(sys.argv[1])
hvd.init()
rng = np.random.default_rng(hvd.rank())
x = rng.random((64, 8), dtype=np.float32)
y = (x[:, 0] > 0.5).astype(np.int64)
saved = sorted(checkpoints.glob("epoch-*.keras"))
if saved:
    model, done = hvd.load_model(saved[-1]), int(saved[-1].stem.split("-")[1])
else:
    model, done = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]), 0
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class FailOnce(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and hvd.rank() == hvd.size() - 1 and not saved:
            raise RuntimeError("an injected failure in epoch 2")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), FailOnce()]
if hvd.rank() == 0:
    checkpoints.mkdir(parents=True, exist_ok=True)
    callbacks.append(keras.callbacks.ModelCheckpoint(str(checkpoints / "epoch-{epoch}.keras")))
model.fit(x, y, batch_size=8, epochs=2, initial_epoch=done, callbacks=callbacks, verbose=0)
if hvd.rank() == 0:
    print(f"trained epochs {done + 1} to 2", flush=True)
