"""The fused flat buffer: pack/unpack round trip and gradient layout (TensorFlow, no MPI)."""

import inspect

import numpy as np
import pytest

from mpitrain import models
from mpitrain.config import Config
from mpitrain.models.replica import Replica, checksum, init_tensorflow


@pytest.fixture(scope="module")
def replica():
    init_tensorflow(1, 0)
    return Replica(models.get("lr"), (28, 28, 1), 10, "sgd", 0.1)


def test_weights_round_trip(replica):
    flat = np.random.default_rng(0).standard_normal(replica.n_params).astype(np.float32)
    replica.set_weights(flat)
    assert np.array_equal(replica.weights(), flat)
    assert replica.n_params == 784 * 10 + 10
    with pytest.raises(ValueError, match="expected 7850 weights"):
        replica.set_weights(flat[:-1])


def test_flat_gradient_matches_per_variable_layout(replica):
    import tensorflow as tf

    rng = np.random.default_rng(1)
    x = rng.random((8, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 8).astype(np.int32)
    flat, loss, norm = replica.grad(x, y)
    assert flat.dtype == np.float32 and flat.flags.writeable and flat.shape == (7850,)
    with tf.GradientTape() as tape:
        logits = replica.model(x, training=True)
        expected_loss = tf.reduce_mean(
            tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    grads = tape.gradient(expected_loss, replica.variables)
    assert loss == pytest.approx(float(expected_loss), rel=1e-5)
    assert norm == pytest.approx(float(np.linalg.norm(flat)), rel=1e-5)
    padded, _, _ = replica.grad(x, y, tail=3)
    assert padded.shape == (7853,) and np.array_equal(padded[:7850], flat)
    assert (padded[7850:] == 0).all()
    offset = 0
    for g in grads:
        n = int(np.prod(g.shape))
        np.testing.assert_allclose(flat[offset:offset + n], g.numpy().ravel(), rtol=1e-5,
                                   atol=1e-7)
        offset += n


def test_the_default_compiler_is_the_configs():
    """A replica built directly (tests, benchmarks, the Horovod API) runs the path a
    user's run gets by default."""
    default = inspect.signature(Replica).parameters["compiler"].default
    assert default == Config().compiler == "auto"


@pytest.mark.parametrize("compiler", ["auto", "graph"])
def test_apply_equals_keras_fused_step(compiler):
    """Three momentum steps as grad then apply on ``compiler``'s path (auto, the
    default: the flat optimizer's update of its copy of the weights, assigned in the
    next step; graph: Keras' optimizer) end on the weights that Keras' one-call
    train_step reaches from the same start."""
    init_tensorflow(1, 0)
    keras_fused = Replica(models.get("lr"), (28, 28, 1), 10, "momentum", 0.1, compiler="graph")
    tested = Replica(models.get("lr"), (28, 28, 1), 10, "momentum", 0.1, compiler=compiler)
    assert (tested.flat_optimizer is not None) == (compiler == "auto")
    tested.set_weights(keras_fused.weights())
    rng = np.random.default_rng(2)
    for _ in range(3):
        x = rng.random((16, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, 16).astype(np.int32)
        keras_fused.train_step(x, y)
        g, _, _ = tested.grad(x, y)
        tested.apply(g)
    # the flat update rounds as numpy does, Keras' as TensorFlow's kernels do
    np.testing.assert_allclose(tested.weights(), keras_fused.weights(), rtol=2e-5, atol=2e-7)


def test_clipping_bounds_the_update():
    init_tensorflow(1, 0)
    clipped = Replica(models.get("lr"), (28, 28, 1), 10, "sgd", 1.0, clip_norm=0.01)
    before = clipped.weights()
    rng = np.random.default_rng(4)
    x = rng.random((16, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 16).astype(np.int32)
    _, norm = clipped.train_step(x, y)
    assert norm > 0.01
    assert np.linalg.norm(clipped.weights() - before) == pytest.approx(0.01, rel=1e-3)


def test_optimizer_state_round_trip():
    init_tensorflow(1, 0)
    a = Replica(models.get("lr"), (28, 28, 1), 10, "adam", 0.01)
    rng = np.random.default_rng(5)
    x = rng.random((16, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 16).astype(np.int32)
    a.train_step(x, y)
    b = Replica(models.get("lr"), (28, 28, 1), 10, "adam", 0.01)
    b.set_weights(a.weights())
    b.set_optimizer_state(a.optimizer_state())
    a.train_step(x, y)
    b.train_step(x, y)
    assert np.array_equal(a.weights(), b.weights())


def test_checksum_detects_one_flipped_bit():
    flat = np.arange(1000, dtype=np.float32)
    other = flat.copy()
    other.view(np.uint32)[500] ^= 1
    assert checksum(flat) == checksum(flat.copy()) != checksum(other)


def _bn_spec():
    from conftest import BN_MODEL_SPEC

    return models.get(BN_MODEL_SPEC)


def test_state_that_is_not_trained_is_split_into_buffers_and_generator_state():
    """BatchNorm statistics are float buffers (one flat vector, after the weights in
    state()); Dropout's seed is integer generator state; neither is in the weights."""
    init_tensorflow(1, 0)
    replica = Replica(_bn_spec(), (12, 12, 1), 4, "adam", 0.01)
    assert replica.n_buffers == 48 and replica.n_state == replica.n_params + 48
    buffers = np.random.default_rng(5).random(48).astype(np.float32)
    replica.set_buffers(buffers)
    assert np.array_equal(replica.buffers(), buffers)
    state = replica.state()
    assert np.array_equal(state[:replica.n_params], replica.weights())
    assert np.array_equal(state[replica.n_params:], buffers)
    seeds = replica.rng_state()
    assert seeds.dtype == np.int64 and seeds.size == 2
    x = np.random.default_rng(6).random((8, 12, 12, 1), dtype=np.float32)
    replica.train_step(x, np.zeros(8, np.int32))  # training moves the statistics only
    assert not np.array_equal(replica.buffers(), buffers)
    other = Replica(_bn_spec(), (12, 12, 1), 4, "adam", 0.01)
    other.set_state(replica.state())
    assert checksum(other.state()) == checksum(replica.state())
    with pytest.raises(ValueError, match="expected 48 buffer values"):
        replica.set_buffers(buffers[:-1])


def test_ranks_that_never_apply_build_no_optimizer():
    init_tensorflow(1, 0)
    reader = Replica(models.get("lr"), (28, 28, 1), 10, "momentum", 0.1, applies=False)
    applier = Replica(models.get("lr"), (28, 28, 1), 10, "momentum", 0.1, compiler="graph")
    assert reader.optimizer is None and reader.flat_optimizer is None
    # momentum: the step count, the learning rate, one velocity per variable
    assert [shape for shape, _ in applier.optimizer_layout().values()] == \
        [(), (), (784, 10), (10,)]
    x = np.zeros((4, 28, 28, 1), np.float32)
    y = np.zeros(4, np.int32)
    grad, _, _ = reader.grad(x, y)  # gradients and evaluation work without one
    reader.evaluate(x, y)
    for call in (lambda: reader.apply(grad), lambda: reader.train_step(x, y),
                 reader.optimizer_state):
        with pytest.raises(RuntimeError, match="no optimizer"):
            call()


def test_compiled_steps_leave_no_autograph_files(tmp_path, monkeypatch):
    """The replica's steps compile without autograph (nothing in them needs it): no
    __autograph_generated_file*.py in the temporary directory, and no CPU spent
    converting, on every rank of every launch."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    replica = Replica(_bn_spec(), (12, 12, 1), 4, "adam", 0.01)
    x, y = np.ones((6, 12, 12, 1), np.float32), np.array([0, 1, 2, 3, 0, 1], np.int32)
    replica.apply(replica.grad(x, y)[0])
    replica.evaluate(x, y)
    assert list(tmp_path.iterdir()) == []


# ---- XLA-compiled steps (--compile xla) ------------------------------------------------
@pytest.mark.slow  # XLA compiles LeNet's gradient: seconds of CPU
def test_xla_steps_train_like_graph_steps():
    """The same weights and batch: XLA's gradient and update equal graph mode's up to
    float rounding (XLA fuses, so bits may differ; every replica compiles alike). LeNet:
    convolutions, pooling, no dropout (XLA draws other random masks)."""
    init_tensorflow(1, 0)
    graph = Replica(models.get("lenet"), (28, 28, 1), 10, "momentum", 0.05, compiler="graph")
    xla = Replica(models.get("lenet"), (28, 28, 1), 10, "momentum", 0.05, compiler="xla")
    xla.set_weights(graph.weights())
    rng = np.random.default_rng(3)
    x, y = rng.random((16, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, 16).astype(np.int32)
    (g1, l1, n1), (g2, l2, n2) = (r.grad(x, y, tail=2, scale=0.5) for r in (graph, xla))
    assert g2.shape == g1.shape == (graph.n_params + 2,)
    np.testing.assert_allclose(g2, g1, rtol=1e-3, atol=1e-6)
    assert l2 == pytest.approx(l1, rel=1e-5) and n2 == pytest.approx(n1, rel=1e-4)
    for replica in (graph, xla):
        replica.apply(g1[:graph.n_params])
    np.testing.assert_allclose(xla.weights(), graph.weights(), rtol=1e-5, atol=1e-7)
    assert set(xla.compiled.values()) == {"xla"} and set(graph.compiled.values()) == {"graph"}


def test_a_model_xla_cannot_compile_falls_back_to_graph_mode():
    import keras
    import tensorflow as tf

    from mpitrain.models.registry import ModelSpec

    class Host(keras.layers.Layer):  # a step on the host: XLA cannot compile it
        def call(self, x):
            out = tf.py_function(lambda t: t * 2.0, [x], tf.float32)
            out.set_shape(x.shape)
            return out

        def compute_output_shape(self, shape):
            return shape

    def build(shape, classes):
        return keras.Sequential([keras.Input(shape), keras.layers.Flatten(), Host(),
                                 keras.layers.Dense(classes)])

    init_tensorflow(1, 0)
    replica = Replica(ModelSpec("host", build, "a py_function"), (4, 4, 1), 3, "sgd", 0.1,
                      compiler="xla")
    x, y = np.ones((5, 4, 4, 1), np.float32), np.array([0, 1, 2, 0, 1], np.int32)
    grad, loss, _ = replica.grad(x, y)
    replica.apply(grad)
    assert np.isfinite(loss) and grad.shape == (replica.n_params,)
    assert replica.compiled["grad"] == "graph (XLA could not compile it)"
    assert replica.compiled["apply"] == "xla"  # the update (optimizer only) still compiles


def test_auto_updates_with_the_flat_optimizer_and_assigns_in_the_next_gradient_call():
    """--compile auto: the update is the flat optimizer's, on a flat copy of the weights
    (no Keras optimizer, no slots of its own); the variables get the copy at the start
    of the next gradient call, or when anything reads them first. It trains as Keras'
    update does (--compile graph), and its state round-trips through checkpoints."""
    init_tensorflow(1, 0)
    keras_side = Replica(models.get("lenet"), (28, 28, 1), 10, "momentum", 0.05,
                         compiler="graph")
    assert keras_side.compiled == {"grad": "graph", "grad_at": "graph", "apply": "graph",
                                   "train_step": "graph"}
    flat = Replica(models.get("lenet"), (28, 28, 1), 10, "momentum", 0.05, compiler="auto")
    assert flat.compiled["apply"] == "flat" and flat.compiled["grad"] == "graph"
    assert flat.optimizer is None and flat.flat_optimizer is not None
    flat.set_weights(keras_side.weights())
    rng = np.random.default_rng(6)
    for _ in range(3):
        x = rng.random((8, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, 8).astype(np.int32)
        grads = []
        for replica in (keras_side, flat):
            grad, _, _ = replica.grad(x, y, tail=2, scale=0.5)
            grads.append(grad.copy())
            replica.apply(grad[:replica.n_params])
        # the gradient was taken at the weights of the update before (assigned in the call)
        np.testing.assert_allclose(grads[1], grads[0], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(flat.weights(), keras_side.weights(), rtol=2e-5, atol=2e-7)
    kernel = flat.variables[0].numpy().ravel()
    assert not np.array_equal(kernel, flat.weights()[:kernel.size])  # the update is pending
    assert flat.evaluate(x, y) == pytest.approx(keras_side.evaluate(x, y), rel=1e-4)
    assert np.array_equal(flat.variables[0].numpy().ravel(), flat.weights()[:kernel.size])
    assert np.isfinite(flat.train_step(x, y)[0])  # one worker: gradient, then the update
    layout, state = flat.optimizer_layout(), flat.optimizer_state()
    assert layout == {"o0": ((), "int64"), "o1": ((flat.n_params,), "float32")}
    assert int(state["o0"]) == 4
    again = Replica(models.get("lenet"), (28, 28, 1), 10, "momentum", 0.05, compiler="auto")
    again.set_weights(flat.weights())
    again.set_optimizer_state(state)  # a resumed run continues the same updates
    for replica in (flat, again):
        replica.train_step(x, y)
    assert flat.weights().tobytes() == again.weights().tobytes()
    with pytest.raises(ValueError, match="optimizer state has 1 variables, expected 2"):
        again.set_optimizer_state({"o0": state["o0"]})


def test_the_buffer_grad_returns_is_applied_as_changed_in_place_without_a_copy(replica):
    """grad() hands out a view of TensorFlow's output (no copy); what the allreduce
    writes into it in place is what apply() applies, status tail left out."""
    start = np.random.default_rng(4).standard_normal(replica.n_params).astype(np.float32)
    x = np.random.default_rng(5).random((8, 28, 28, 1), dtype=np.float32)
    y = np.arange(8, dtype=np.int32)
    replica.set_weights(start)
    buf, _, _ = replica.grad(x, y, tail=3)
    assert buf.flags.writeable and not buf.flags.owndata  # a view, not a copy
    buf[:] = 0.25  # as an allreduce would overwrite it (the tail too)
    replica.apply(buf[:replica.n_params])
    np.testing.assert_allclose(replica.weights(), start - 0.1 * 0.25, rtol=0, atol=1e-6)
    again, _, _ = replica.grad(x, y, tail=3)  # a fresh buffer each step
    assert not np.shares_memory(again, buf) and (again[-3:] == 0).all()
    replica.apply(np.full(replica.n_params, 0.25, np.float32))  # any other array: copied in
    np.testing.assert_allclose(replica.weights(), start - 0.2 * 0.25, rtol=0, atol=1e-6)
