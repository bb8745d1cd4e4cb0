"""The server's numpy optimizers follow Keras 3's updates (the same --optimizer in both modes)."""

import numpy as np
import pytest

from mpitrain import models
from mpitrain.models import optim
from mpitrain.models.replica import Replica, init_tensorflow


@pytest.mark.parametrize("name,lr,decay,clip", [
    ("sgd", 0.5, None, None), ("momentum", 0.1, None, None), ("adam", 0.01, None, None),
    ("momentum", 0.1, 4, None), ("adam", 0.01, 3, None),
    # --clip-grad-norm: the same clip-then-update chain on both paths (LR's gradient
    # norms here are ~0.5-2, so both clips below bind)
    ("sgd", 0.5, None, 0.05), ("momentum", 0.1, 4, 0.05), ("adam", 0.01, 3, 0.1),
    ("adam", 0.01, None, 1e-6)])
def test_flat_optimizer_matches_keras(name, lr, decay, clip):
    init_tensorflow(1, 0)
    keras_side = Replica(models.get("lr"), (28, 28, 1), 10, name, lr, clip_norm=clip,
                         decay_steps=decay)
    weights = keras_side.weights()
    flat = optim.make(name, keras_side.n_params, lr, decay, clip)
    rng = np.random.default_rng(3)
    for _ in range(5):
        x = rng.random((16, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, 16).astype(np.int32)
        grad, _, norm = keras_side.grad_at(weights, x, y)
        assert clip is None or norm > clip
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


def test_clip_by_global_norm():
    g = np.array([3.0, 4.0], np.float32)
    optim.clip_by_global_norm_(g, 1.0)
    np.testing.assert_allclose(g, [0.6, 0.8], rtol=1e-6)
    small = np.array([0.3, 0.4], np.float32)
    optim.clip_by_global_norm_(small, 1.0)
    assert small.tolist() == [np.float32(0.3), np.float32(0.4)]  # under the bound: untouched
