"""A Horovod elastic training loop (hvd.elastic.run, TensorFlowKerasState, commits and a
reset callback that scales the learning rate), as a Horovod user writes one, for
tests/e2e/test_horovod_api_mpirun.py.

    python hvd_elastic.py OUT_DIR [BATCHES]

Rank 0 appends "SIZE FIRST_BATCH" to OUT_DIR/attempts at each start of training and
writes OUT_DIR/final.json at the end. Each batch takes a little time (the test grows
the job while it trains)."""

import json
import sys
import time
from pathlib import Path

import mpitrain.horovod as hvd

hvd.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

out, batches = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 200
BASE_LR = 0.01
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(64, 8)).astype(np.float32)
y = (x @ np.arange(8, dtype=np.float32)[:, None]).astype(np.float32)

keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(BASE_LR * hvd.size(), momentum=0.9)


@tf.function
def train_step(allreduce=True):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    if allreduce:
        tape = hvd.DistributedGradientTape(tape)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables))
    return loss


train_step(allreduce=False)  # builds the optimizer's variables, as Horovod's examples do
resets = []


def on_reset():
    optimizer.learning_rate.assign(BASE_LR * hvd.size())
    resets.append(hvd.size())


@hvd.elastic.run
def train(state):
    if hvd.rank() == 0:
        with open(out / "attempts", "a") as f:
            f.write(f"{hvd.size()} {state.batch}\n")
    while state.batch < batches:
        state.loss = float(train_step())
        state.batch += 1
        time.sleep(0.02)
        if state.batch % 10 == 0:
            state.commit()


state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, loss=0.0)
state.register_reset_callbacks([on_reset])
train(state)
weights = hvd.allgather_object([w.tolist() for w in model.get_weights()])
if hvd.rank() == 0:
    (out / "final.json").write_text(json.dumps({
        "size": hvd.size(), "batch": state.batch, "loss": state.loss, "resets": resets,
        "lr": float(optimizer.learning_rate.numpy()),
        "same_weights": all(w == weights[0] for w in weights)}))
