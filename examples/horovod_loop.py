"""A custom training loop written against Horovod's API (the shape of Horovod's
tensorflow2_mnist.py), run by mpitrain.horovod on TensorFlow 2.16+ and Keras 3.

    mpirun -np 3 -hostfile hostfiles/local python examples/horovod_loop.py mnist.npz [--steps 300]

``import mpitrain.horovod as hvd`` where Horovod's script has ``import
horovod.tensorflow as hvd``; the rest is Horovod's calls: the DistributedGradientTape
averages the gradients inside the ``tf.function`` step, the variables are broadcast
from rank 0 after the first step (once the optimizer has its slots), and rank 0 alone
saves the checkpoint. Each rank reads its own shard of the data.
"""

import argparse

import mpitrain.horovod as hvd  # first: TensorFlow then loads with oneDNN's kernels

import keras
import numpy as np
import tensorflow as tf


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("npz")
    parser.add_argument("--steps", type=int, default=300, help="steps of every rank")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint", default=None, help="rank 0 saves here at the end")
    args = parser.parse_args()

    hvd.init()
    with np.load(args.npz) as f:
        x, y = f["x_train"], f["y_train"]
        x_test, y_test = f["x_test"], f["y_test"]
    images = tf.data.Dataset.from_tensor_slices(((x[..., None] / 255.0).astype(np.float32),
                                                 y.astype(np.int64)))
    dataset = images.shard(hvd.size(), hvd.rank()).repeat().shuffle(10_000).batch(
        args.batch_size)

    model = keras.Sequential([
        keras.Input(x.shape[1:] + (1,)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(0.001 * hvd.size())  # the rate scaled by the ranks

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:  # after the first step: the optimizer's variables exist by then
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)  # (a property in Keras 3)
        return loss

    for batch, (images_, labels) in enumerate(dataset.take(args.steps)):
        loss = training_step(images_, labels, batch == 0)
        if batch % 100 == 0 and hvd.rank() == 0:
            print(f"step {batch}: loss {float(loss):.4f}", flush=True)

    logits = model(x_test[..., None].astype(np.float32) / 255.0)
    correct = hvd.allreduce(tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1),
                                                            y_test.astype(np.int64)),
                                                   tf.float32)))  # the same on every rank
    if hvd.rank() == 0:
        print(f"test accuracy {float(correct):.4f} after {args.steps} steps on {hvd.size()} "
              "rank(s)", flush=True)
        if args.checkpoint:
            tf.train.Checkpoint(model=model, optimizer=opt).save(args.checkpoint)


if __name__ == "__main__":
    main()
