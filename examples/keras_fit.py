"""Keras model.fit, data-parallel over MPI, with mpitrain.horovod's Horovod API.

    mpirun -np 3 -hostfile hostfiles/local python examples/keras_fit.py mnist.npz --checkpoint-dir ckpt
    mpitrain launch -np 3 examples/keras_fit.py mnist.npz --checkpoint-dir ckpt

Every rank trains on its own shard of the training set (``dataset.shard``) and
validates on its shard of the test set; DistributedOptimizer averages the gradients
every step; the callbacks start every rank from rank 0's weights, average the
epoch's metrics over the ranks and warm the learning rate up; rank 0 alone writes a
checkpoint after every epoch. Started again with the same --checkpoint-dir (by hand,
or by ``mpitrain launch`` after a failure), it resumes from the last one.
``--results-dir DIR`` adds mpitrain's telemetry (CPU, memory, traffic, phase times;
``mpitrain report DIR``). The .npz holds x_train, y_train, x_test, y_test; make one
from MNIST with ``python examples/make_npz.py ../shared/data/mnist mnist.npz``. Or
give a shard set (``mpitrain data pack``'s output) instead: each rank then streams its
batches from disk (``mpitrain.stream_shards``), for data larger than memory.
"""

import argparse
import json
import re
import zipfile
from pathlib import Path

import mpitrain.horovod.keras as hvd  # first: TensorFlow then loads with oneDNN's kernels
from mpitrain import stream_shards
from mpitrain.horovod import broadcast_object  # (Horovod's is horovod.tensorflow's too)

import keras
import numpy as np
import tensorflow as tf


def build(input_shape, num_classes):
    L = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(2),
        L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(2),
        L.Flatten(), L.Dropout(0.25), L.Dense(128, activation="relu"),
        L.Dense(num_classes),
    ])


def shard(x, y, batch_size, shuffle=False):
    """This rank's part of (x, y), batched: the ranks' parts are disjoint."""
    data = tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank())
    if shuffle:
        data = data.shuffle(10_000, seed=hvd.rank(), reshuffle_each_iteration=True).repeat()
    return data.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def images(x):
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
    return x[..., None] if x.ndim == 3 else x


def latest_checkpoint(directory):
    """(path, epoch) of the newest whole checkpoint in ``directory``, or (None, 0),
    as rank 0 sees it: the other ranks take rank 0's answer, since a file rank 0 is
    still writing (or was killed writing) may already be there, half a zip."""
    found = []
    if hvd.rank() == 0:
        found = sorted((int(m.group(1)), str(p)) for p in Path(directory).glob("epoch-*.keras")
                       if (m := re.fullmatch(r"epoch-(\d+)\.keras", p.name))
                       and zipfile.is_zipfile(p))
    epoch, path = broadcast_object(found[-1] if found else (0, None), root_rank=0)
    return path, epoch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="an npz, or a shard set's directory")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.001, help="of one rank (x ranks)")
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch (smoke runs)")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--results-dir", default=None, help="mpitrain's telemetry here")
    args = parser.parse_args()

    hvd.init(results_dir=args.results_dir)
    path, done = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else (None, 0)
    if Path(args.data).is_dir():  # a shard set: every rank reads only its batches
        rank, size = hvd.rank(), hvd.size()
        train, steps = stream_shards(args.data, args.batch_size, rank, size,
                                     first_epoch=done + 1)
        test, _ = stream_shards(args.data, 1000, rank, size, split="test")
        shape = tuple(train.element_spec[0].shape[1:])
        classes = json.loads((Path(args.data) / "manifest.json").read_text())["num_classes"]
    else:
        with np.load(args.data) as f:  # every rank reads the file; each keeps its shard
            x_train, y_train = images(f["x_train"]), f["y_train"].astype(np.int64)
            x_test, y_test = images(f["x_test"]), f["y_test"].astype(np.int64)
        shape, classes = x_train.shape[1:], int(y_train.max()) + 1
        train = shard(x_train, y_train, args.batch_size, shuffle=True)
        test = shard(x_test, y_test, 1000)
        steps = len(x_train) // hvd.size() // args.batch_size
    steps = args.steps or steps
    lr = args.lr * hvd.size()  # the global batch is ranks x batch: scale the rate alike

    if path is not None:  # every rank loads rank 0's file, optimizer state included
        model = hvd.load_model(path)
    else:
        model = build(shape, classes)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(lr)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),  # before the callbacks reading them
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=1)]
    if hvd.rank() == 0 and args.checkpoint_dir:
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            f"{args.checkpoint_dir}/epoch-{{epoch:03d}}.keras"))
    history = model.fit(train, steps_per_epoch=steps, epochs=args.epochs, initial_epoch=done,
                        validation_data=test, callbacks=callbacks,
                        shuffle=False,  # (the dataset shuffles itself)
                        verbose=2 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0 and history.history:
        print(f"test accuracy {history.history['val_accuracy'][-1]:.4f}, test loss "
              f"{history.history['val_loss'][-1]:.4f} after epoch {args.epochs} on "
              f"{hvd.size()} rank(s)", flush=True)


if __name__ == "__main__":
    main()
