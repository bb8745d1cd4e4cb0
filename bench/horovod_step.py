"""Horovod's synthetic benchmark (the shape of its tensorflow2_synthetic_benchmark.py) on
mpitrain's models, run by ``python -m bench horovod_api`` under mpirun on every rank:

    mpirun -np 2 python bench/horovod_step.py --api mpitrain --model lenet
    mpirun -np 2 python bench/horovod_step.py --api mpitrain --model lenet,resnet,alexnet \
        --image-size 0,0,32 --warmup 10,5,3 --iters 10,5,4 --batches-per-iter 10,5,3

``--api horovod`` imports ``horovod.tensorflow``, ``--api mpitrain`` imports
``mpitrain.horovod``; the script is otherwise the same. One fixed random batch per rank;
a step is a ``tf.function`` with a ``DistributedGradientTape`` and ``apply_gradients``;
the first step broadcasts the variables, ``--warmup`` steps follow, then ``--iters``
timed iterations of ``--batches-per-iter`` steps. Rank 0 prints one JSON line per
model: images/s per rank (mean of the iterations) and in total (x ranks).

Several models (``--model`` a comma list; each numeric option one value for all or one
per model, ``--image-size 0`` the model's own) run one after another in this one
process, so the job's start-up (mpirun, TensorFlow's import, ``hvd.init``) is paid once.
Each model's measure is its own, as in a process of its own: its Keras state starts
blank (``clear_session``: the same layer names, seed and fresh graph), the previous
model's objects are freed (garbage-collected) before it is built, and its figure comes
from its own steps after its own first step and warm-up (where its tracing happens).
What it shares with the models before it: TensorFlow's runtime and thread pools (the
same settings for every model), oneDNN's primitive cache (keyed by shape), the memory
the allocator keeps, and the collective library's state (Horovod's background thread
and response cache, whose entries for another model's tensors are renegotiated at that
model's first, untimed step; mpitrain.horovod keeps only counters).

The tape differentiates with respect to the Keras variables' ``tf.Variable`` values
(``v.value``): Horovod 0.28.1's tape fails on Keras 3 variables themselves (it calls
``.ref()`` on them). Both APIs run the same code.
"""

import argparse
import gc
import json
import os
import timeit

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--api", choices=("horovod", "mpitrain"), required=True)
p.add_argument("--model", default="lenet", help="a model, or a comma list run in turn")
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--image-size", default="0", help="0: the model's own")
p.add_argument("--warmup", default="10")
p.add_argument("--batches-per-iter", default="10")
p.add_argument("--iters", default="10")
args = p.parse_args()
MODELS = args.model.split(",")


def per_model(option: str) -> list:
    """An option's value for each model: a comma list, or one value for every model."""
    values = [int(v) for v in getattr(args, option).split(",")]
    if len(values) == 1:
        values *= len(MODELS)
    if len(values) != len(MODELS):
        p.error(f"--{option.replace('_', '-')}: {len(values)} values for "
                f"{len(MODELS)} models")
    return values


CASES = list(zip(MODELS, *map(per_model, ("image_size", "warmup", "iters",
                                          "batches_per_iter"))))

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
        tf.config.threading.set_intra_op_parallelism_threads(
            max(1, cpus // hvd.local_size()))
        tf.config.threading.set_inter_op_parallelism_threads(1)

    for i, case in enumerate(CASES):
        if i:  # the previous model's state gone, as in a process of its own
            keras.backend.clear_session(free_memory=True)
            gc.collect()
        result = measure(hvd, keras, tf, *case)
        if hvd.rank() == 0:
            print(json.dumps(result), flush=True)


def measure(hvd, keras, tf, name: str, image_size: int, warmup: int, iters: int,
            batches_per_iter: int) -> dict:
    """One model's benchmark: its JSON line (rank 0 prints it)."""
    spec = models.get(name)
    side = image_size or spec.synthetic["image_size"]
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
    timeit.timeit(lambda: step(False), number=warmup)
    rates = []
    for _ in range(iters):
        seconds = timeit.timeit(lambda: step(False), number=batches_per_iter)
        rates.append(args.batch_size * batches_per_iter / seconds)
    return {"api": args.api, "model": name, "np": hvd.size(),
            "img_sec_per_rank": float(np.mean(rates)),
            "img_sec_conf": float(1.96 * np.std(rates)),
            "img_sec_total": float(hvd.size() * np.mean(rates)),
            "tensorflow": tf.__version__, "rates": rates}


on_every_rank(main)
