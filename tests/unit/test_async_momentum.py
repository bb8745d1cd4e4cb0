"""Momentum under asynchrony (mpitrain/train/asynchronous/momentum.py): the server's
momentum against values computed by hand, and the flat optimizers that take it."""

import numpy as np
import pytest

from mpitrain import models
from mpitrain.config import Config, resolve
from mpitrain.errors import UsageError
from mpitrain.models import optim
from mpitrain.train.asynchronous.momentum import corrected, server_momentum, server_rate_factor


@pytest.mark.parametrize("workers,expected", [(1, 0.9), (2, 0.4), (4, 0.15), (5, 0.1),
                                              (8, 0.025), (10, 0.0), (16, 0.0), (64, 0.0)])
def test_the_momentum_left_after_asynchronys_own(workers, expected):
    assert corrected(0.9, workers) == pytest.approx(expected, abs=1e-12)


def config(model: str, world_size: int, **kw) -> Config:
    return resolve(Config.of(model=model, async_mode=True, **kw), models.get(model).defaults,
                   world_size)


def test_the_server_momentum_of_each_optimizer():
    # LeNet: Adam (beta_1 0.9); 4 workers at -np 5
    assert server_momentum(config("lenet", 5)) == pytest.approx(0.15)
    # 16 workers: unbounded, all of them compute at once; under the default bound (4) at
    # most 5 do, and 5 is what asynchrony's momentum counts
    assert server_momentum(config("lenet", 17, staleness="none")) == 0.0
    assert server_momentum(config("lenet", 17)) == pytest.approx(0.1)
    assert server_momentum(config("lenet", 17, staleness=1)) == pytest.approx(0.4)
    assert server_momentum(config("lenet", 5, staleness=10)) == pytest.approx(0.15)
    assert server_momentum(config("lenet", 5, optimizer="momentum")) == pytest.approx(0.15)
    # LR's Nesterov momentum is lowered alike; plain SGD has none to lower; off keeps the
    # optimizer's own
    assert server_momentum(config("lr", 5)) == pytest.approx(0.15)
    assert server_momentum(config("lr", 5, optimizer="sgd")) is None
    assert server_momentum(config("lenet", 5, momentum_correction="off")) is None


def test_the_setting_is_for_async_runs():
    with pytest.raises(UsageError, match="--momentum-correction off is for the async"):
        resolve(Config.of(model="lenet", momentum_correction="off"),
                models.get("lenet").defaults, 3)


def test_adam_with_a_lowered_beta_1_by_hand():
    """Two Adam updates with beta_1 0.4 (Keras' arithmetic, epsilon outside the root)."""
    lr, b1, b2, eps = 0.01, 0.4, 0.999, 1e-7
    opt = optim.make("adam", 2, lr, momentum=b1)
    w = np.array([1.0, -1.0], np.float32)
    grads = [np.array([0.5, -2.0], np.float32), np.array([-1.0, 1.0], np.float32)]
    expected, m, v = np.array([1.0, -1.0]), np.zeros(2), np.zeros(2)
    for t, g in enumerate(grads, start=1):
        opt.step(w, g.copy())
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        expected = expected - alpha * m / (np.sqrt(v) + eps)
    np.testing.assert_allclose(w, expected, rtol=1e-5)
    assert optim.make("adam", 2, lr).beta_1 == np.float32(0.9)  # the optimizer's own


def test_momentum_sgd_with_no_momentum_left_is_plain_sgd():
    g = np.array([1.0, -2.0], np.float32)
    w_momentum, w_sgd = np.ones(2, np.float32), np.ones(2, np.float32)
    corrected_opt, sgd = optim.make("momentum", 2, 0.1, momentum=0.0), optim.make("sgd", 2, 0.1)
    for _ in range(3):
        corrected_opt.step(w_momentum, g.copy())
        sgd.step(w_sgd, g.copy())
    np.testing.assert_allclose(w_momentum, w_sgd, rtol=1e-6)
    assert optim.make("sgd", 2, 0.1, momentum=0.5).__class__ is optim.SGD


@pytest.mark.parametrize("model,world_size,kw,expected", [
    # 2 workers lower momentum SGD's 0.9 to 0.4: the rate rises (1 - 0.4) / (1 - 0.9)
    ("lr", 3, {"optimizer": "nesterov"}, 6.0), ("lr", 3, {"optimizer": "momentum"}, 6.0),
    # 16 workers under the default bound: 5 at once, momentum 0.1
    ("lr", 17, {"optimizer": "nesterov"}, 9.0),
    # unbounded 16: no momentum left, plain SGD at the long-run step's rate
    ("lr", 17, {"optimizer": "momentum", "staleness": "none"}, 10.0),
    ("lr", 3, {"optimizer": "sgd"}, 1.0),                 # plain SGD: nothing lowered
    ("lenet", 5, {}, 1.0),                                # Adam: its step is its rate
    ("lr", 3, {"optimizer": "nesterov", "momentum_correction": "off"}, 1.0)])
def test_the_server_rate_keeps_the_long_run_step(model, world_size, kw, expected):
    assert server_rate_factor(config(model, world_size, **kw)) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["momentum", "nesterov"])
def test_a_lowered_momentum_at_the_raised_rate_takes_the_same_long_run_step(name):
    """A constant gradient: the step per update settles at lr / (1 - m) with the
    optimizer's own 0.9 at 0.05 and with 0.4 at 0.05 x 6 alike (0.5 a unit gradient)."""
    steps = []
    for momentum, lr in ((None, 0.05), (0.4, 0.3)):
        opt, w = optim.make(name, 1, lr, momentum=momentum), np.zeros(1, np.float32)
        for _ in range(300):
            before = float(w[0])
            opt.step(w, np.ones(1, np.float32))
        steps.append(before - float(w[0]))
    assert steps == pytest.approx([0.5, 0.5], rel=1e-3)


def test_nesterov_by_hand():
    """Two Nesterov updates (Keras: v = m v - lr g; w += m v - lr g)."""
    opt, w = optim.make("nesterov", 2, 0.1), np.array([1.0, -1.0], np.float32)
    v, expected = np.zeros(2), np.array([1.0, -1.0])
    for g in (np.array([0.5, -2.0], np.float32), np.array([-1.0, 1.0], np.float32)):
        opt.step(w, g.copy())
        v = 0.9 * v - 0.1 * g
        expected = expected + 0.9 * v - 0.1 * g
    np.testing.assert_allclose(w, expected, rtol=1e-6)
