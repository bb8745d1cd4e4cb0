"""One script, two Horovods in one process: run under mpirun (in .venv-horovod); it runs
the same calls with real Horovod 0.28.1 (``horovod.tensorflow``), then with
``mpitrain.horovod``, and rank 0 writes what each got to OUT-horovod.npz and
OUT-mpitrain.npz (numbers) and OUT.json (what the Keras 3 paths did), for
tests/e2e/test_horovod_api_mpirun.py to compare.

mpitrain.horovod starts MPI first (so Horovod, finding it started, leaves it running
at its shutdown); Horovod runs its part and shuts down (its background thread gone)
before mpitrain.horovod runs the same part.

Part 1 is what Horovod still runs on TensorFlow 2.18 and Keras 3: a model of plain
``tf.Variable``s (each rank initialises its own; the broadcast makes rank 0's the
start) trained with a DistributedGradientTape and an SGD update inside ``tf.function``,
its averaged loss each step (the curve), and the collectives on fixed values. Part 2
is what Horovod does not run there: the tape over a Keras model's variables, and
``model.fit`` with DistributedOptimizer and the callbacks; each is recorded as what it
returned or the exception it raised.
"""

import argparse
import json
import zlib

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--no-keras", action="store_true", help="part 1 only")
args = p.parse_args()

import horovod.tensorflow as real_hvd  # noqa: E402
import horovod.tensorflow.keras as real_hvdk  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import mpitrain.horovod as our_hvd  # noqa: E402
import mpitrain.horovod.keras as our_hvdk  # noqa: E402

our_hvd.init()  # MPI first (see above)
real_hvd.init()
r, n = our_hvd.rank(), our_hvd.size()
assert (real_hvd.rank(), real_hvd.size()) == (r, n)


def part_1(hvd) -> dict:
    """The tf.Variable model's curve and weights, and the collectives' results."""
    rng = np.random.default_rng(100 + r)
    variables = [tf.Variable(rng.standard_normal(shape).astype(np.float32) * 0.3)
                 for shape in ((20, 16), (16,), (16, 4), (4,))]
    hvd.broadcast_variables(variables, root_rank=0)
    x = rng.standard_normal((args.steps, 32, 20)).astype(np.float32)
    y = rng.integers(0, 4, (args.steps, 32)).astype(np.int64)

    def loss_of(xb, yb):
        w1, b1, w2, b2 = variables
        logits = tf.nn.relu(xb @ w1 + b1) @ w2 + b2
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_of(xb, yb)
        tape = hvd.DistributedGradientTape(tape)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.1 * g)
        return hvd.allreduce(loss, name="loss")

    out = {"losses": np.array([float(step(x[i], y[i])) for i in range(args.steps)]),
           "weights": np.concatenate([v.numpy().ravel() for v in variables])}
    values = np.random.default_rng(7 + r).standard_normal(1000).astype(np.float32)
    t = tf.constant(values)
    for name, op in (("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max),
                     ("product", hvd.Product), ("average", hvd.Average)):
        out[name] = hvd.allreduce(t, op=op).numpy()
    out["scaled"] = hvd.allreduce(t, op=hvd.Average, prescale_factor=0.3,
                                  postscale_factor=1.7).numpy()
    out["int_sum"] = hvd.allreduce(tf.constant(np.arange(10, dtype=np.int32) * (r + 1)),
                                   op=hvd.Sum).numpy()
    out["float64_average"] = hvd.allreduce(tf.constant(values.astype(np.float64) / 3)).numpy()
    out["allgather"] = hvd.allgather(tf.fill([r + 1, 3], float(r))).numpy()
    out["broadcast"] = hvd.broadcast(t, root_rank=n - 1).numpy()
    out["grouped"] = np.concatenate([g.numpy().ravel() for g in hvd.grouped_allreduce(
        [t, tf.reshape(t[:12], [3, 4])])])
    out["in_graph"] = tf.function(lambda a: hvd.allreduce(a, op=hvd.Sum))(t).numpy()
    with tf.GradientTape() as tape:
        loss = loss_of(x[0], y[0])
    out["fp16_gradients"] = np.concatenate([g.numpy().ravel() for g in hvd.DistributedGradientTape(
        tape, compression=hvd.Compression.fp16).gradient(loss, variables)])
    out["objects"] = np.array([hvd.broadcast_object({"r": r}, root_rank=n - 1)["r"]]
                              + hvd.allgather_object(r))
    return out


def part_2(hvd, hvdk) -> dict:
    """What the tape over a Keras 3 model's variables and model.fit did."""
    found = {}
    rng = np.random.default_rng(200 + r)
    x = rng.standard_normal((96, 20)).astype(np.float32)
    y = rng.integers(0, 4, 96).astype(np.int64)
    keras.utils.set_random_seed(r)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(4)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    try:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        found["tape"] = {"ok": True, "norm": float(tf.linalg.global_norm(grads))}
    except Exception as error:  # noqa: BLE001 - recorded for the test
        found["tape"] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    try:
        model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                      loss=loss_fn)
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0,
                            callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                                       hvdk.callbacks.MetricAverageCallback()])
        digest = zlib.crc32(np.concatenate([v.numpy().ravel() for v in model.variables])
                            .tobytes())
        found["fit"] = {"ok": True, "loss": history.history["loss"], "same_weights_everywhere":
                        len(set(our_hvd.allgather_object(digest))) == 1}
    except Exception as error:  # noqa: BLE001 - recorded for the test
        found["fit"] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return found


results = {"horovod": part_1(real_hvd)}
keras_paths = {} if args.no_keras else {"horovod": part_2(real_hvd, real_hvdk)}
real_hvd.shutdown()
results["mpitrain"] = part_1(our_hvd)
if not args.no_keras:
    keras_paths["mpitrain"] = part_2(our_hvd, our_hvdk)
if r == 0:
    for api, out in results.items():
        np.savez(f"{args.out}-{api}.npz", **out)
    with open(f"{args.out}.json", "w") as f:
        json.dump({"np": n, "tensorflow": tf.__version__, "keras": keras.__version__,
                   "horovod": real_hvd.__version__ if hasattr(real_hvd, "__version__") else "",
                   **keras_paths}, f)
