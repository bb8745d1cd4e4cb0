"""Horovod's synthetic benchmark (the shape of its tensorflow2_synthetic_benchmark.py) on
mpitrain's models, run by ``python -m bench horovod_api`` under mpirun on every rank:

    mpirun -np 2 python bench/horovod_step.py --api mpitrain --model lenet

``--api horovod`` imports ``horovod.tensorflow``, ``--api mpitrain`` imports
``mpitrain.horovod``; the script is otherwise the same. One fixed random batch per rank;
a step is a ``tf.function`` with a ``DistributedGradientTape`` and ``apply_gradients``;
the first step broadcasts the variables, ``--warmup`` steps follow, then ``--iters``
timed iterations of ``--batches-per-iter`` steps. Rank 0 prints one JSON line: images/s
per rank (mean of the iterations) and in total (x ranks).

The tape differentiates with respect to the Keras variables' ``tf.Variable`` values
(``v.value``): Horovod 0.28.1's tape fails on Keras 3 variables themselves (it calls
``.ref()`` on them). Both APIs run the same code.
"""

import argparse
import json
import os
import timeit

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--api", choices=("horovod", "mpitrain"), required=True)
p.add_argument("--model", default="lenet")
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--image-size", type=int, default=None)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--batches-per-iter", type=int, default=10)
p.add_argument("--iters", type=int, default=10)
args = p.parse_args()

from bench.common import on_every_rank  # noqa: E402
from mpitrain import models  # noqa: E402  (the model zoo; sets the oneDNN default)
from mpitrain.models.replica import make_optimizer  # noqa: E402


def main() -> None:
    if args.api == "horovod":
        import horovod.tensorflow as hvd
    else:
        import mpitrain.horovod as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    if args.api == "horovod":  # the threads mpitrain.horovod's init gives a rank
        cpus = len(os.sched_getaffinity(0))
        tf.config.threading.set_intra_op_parallelism_threads(max(1, cpus // hvd.local_size()))
        tf.config.threading.set_inter_op_parallelism_threads(1)

    spec = models.get(args.model)
    side = args.image_size or spec.synthetic["image_size"]
    shape = (side, side, spec.synthetic["channels"])
    classes = spec.synthetic["num_classes"]
    keras.utils.set_random_seed(hvd.rank())
    model = spec.build(shape, classes)
    opt = make_optimizer(spec.defaults["optimizer"], spec.defaults["lr"])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.random.uniform((args.batch_size,) + shape)
    target = tf.random.uniform([args.batch_size], 0, classes, dtype=tf.int64)
    weights = [v.value for v in model.trainable_variables]

    @tf.function(autograph=False)
    def step(first):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, weights)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first:
            hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
            hvd.broadcast_variables([v.value for v in opt.variables], root_rank=0)
        return loss

    step(True)
    timeit.timeit(lambda: step(False), number=args.warmup)
    rates = []
    for _ in range(args.iters):
        seconds = timeit.timeit(lambda: step(False), number=args.batches_per_iter)
        rates.append(args.batch_size * args.batches_per_iter / seconds)
    if hvd.rank() == 0:
        print(json.dumps({"api": args.api, "model": args.model, "np": hvd.size(),
                          "img_sec_per_rank": float(np.mean(rates)),
                          "img_sec_conf": float(1.96 * np.std(rates)),
                          "img_sec_total": float(hvd.size() * np.mean(rates)),
                          "tensorflow": tf.__version__, "rates": rates}), flush=True)


on_every_rank(main)
