"""The server's numpy optimizers follow Keras 3's updates (the same --optimizer in both modes)."""

import numpy as np
import pytest

from mpitrain import models, optim
from mpitrain.replica import Replica, init_tensorflow


@pytest.mark.parametrize("name,lr,decay", [("sgd", 0.5, None), ("momentum", 0.1, None),
                                           ("adam", 0.01, None), ("momentum", 0.1, 4),
                                           ("adam", 0.01, 3)])
def test_flat_optimizer_matches_keras(name, lr, decay):
    init_tensorflow(1, 0)
    keras_side = Replica(models.get("lr"), (28, 28, 1), 10, name, lr, decay_steps=decay)
    weights = keras_side.weights()
    flat = optim.make(name, keras_side.n_params, lr, decay)
    rng = np.random.default_rng(3)
    for _ in range(5):
        x = rng.random((16, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, 16).astype(np.int32)
        grad, _, _ = keras_side.grad_at(weights, x, y)
        keras_side.apply(grad)
        flat.step(weights, grad)
        np.testing.assert_allclose(weights, keras_side.weights(), rtol=2e-5, atol=2e-7)
    assert flat.iterations == 5


def test_state_round_trip():
    a = optim.make("adam", 10, 0.1)
    w = np.zeros(10, np.float32)
    a.step(w, np.ones(10, np.float32))
    b = optim.make("adam", 10, 0.1)
    b.load_state(a.state())
    w2 = w.copy()
    a.step(w, np.ones(10, np.float32))
    b.step(w2, np.ones(10, np.float32))
    assert np.array_equal(w, w2)
