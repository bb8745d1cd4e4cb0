"""Staleness compensation (mpitrain/train/asynchronous/compensation.py): each rule's
arithmetic against values computed by hand, and the dc server's bookkeeping of the
weights its leases carried."""

import math

import numpy as np
import pytest

from mpitrain.models import optim
from mpitrain.train.asynchronous.compensation import TABLE, Compensation


@pytest.mark.parametrize("kind,staleness,factor", [
    ("sqrt", 0, 1.0), ("sqrt", 1, 1.0), ("sqrt", 4, 0.5), ("sqrt", 16, 0.25),
    ("sqrt", 9, 1 / 3), ("inverse", 0, 1.0), ("inverse", 1, 1.0), ("inverse", 4, 0.25),
    ("inverse", 20, 0.05), ("none", 50, 1.0), ("dc", 50, 1.0)])
def test_the_learning_rate_factor_of_a_stale_gradient(kind, staleness, factor):
    c = Compensation(kind, 3)
    assert c.factor(staleness) == pytest.approx(factor)
    assert c.damping(staleness) == pytest.approx(factor)


def test_the_table_and_the_formula_agree_beyond_the_table():
    c = Compensation("sqrt", 1)
    assert c.factor(TABLE - 1) == c.damping(TABLE - 1)
    assert c.factor(TABLE + 5) == pytest.approx(1 / math.sqrt(TABLE + 5))


def test_sqrt_damping_halves_the_step_of_a_gradient_four_updates_stale():
    """The server's update at 4 updates stale, through the flat SGD: lr x 1/2."""
    c, opt = Compensation("sqrt", 2), optim.make("sgd", 2, 0.5)
    w = np.array([1.0, 2.0], np.float32)
    opt.step(w, np.array([1.0, -2.0], np.float32), lr_factor=c.factor(4))
    np.testing.assert_array_equal(w, [0.75, 2.5])


def test_delay_compensation_by_hand():
    """DC-ASGD-a: g + lambda_0 / sqrt(ms) * g * g * (w_now - w_read), ms the moving mean
    square of the gradients (the first gradient's square to start with, then 0.95 of
    the last plus 0.05 of the new square)."""
    c = Compensation("dc", 2, dc_lambda=0.5)
    w_read = np.array([1.0, -1.0], np.float32)
    c.lent(7, w_read)
    w_read[:] = 99  # the server's weights change after the lease: a copy was kept
    w_now = np.array([0.5, -0.5], np.float32)
    g = np.array([0.2, -0.4], np.float32)
    got = c.apply_to(g.copy(), 7, w_now)
    ms = np.array([0.04, 0.16])  # the first gradient's square
    # 0.2 + 0.5 / 0.2 * 0.04 * -0.5 = 0.15; -0.4 + 0.5 / 0.4 * 0.16 * 0.5 = -0.3
    want = np.array([0.2 + 0.5 / math.sqrt(0.04 + 1e-7) * 0.04 * (0.5 - 1.0),
                     -0.4 + 0.5 / math.sqrt(0.16 + 1e-7) * 0.16 * (-0.5 + 1.0)])
    np.testing.assert_allclose(want, [0.15, -0.3], rtol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert c.kept == 0  # its one lease came back: the copy is gone
    # the second gradient: ms = 0.95 ms + 0.05 g^2; a version it never lent is not
    # corrected (a resumed run's first push), but still counts in the mean square
    g2 = np.array([1.0, 0.0], np.float32)
    np.testing.assert_array_equal(c.apply_to(g2.copy(), 3, w_now), g2)
    np.testing.assert_allclose(c._mean_square, 0.95 * ms + 0.05 * np.array([1.0, 0.0]),
                               rtol=1e-6)


def test_the_weights_of_a_version_stay_until_every_lease_of_it_came_back():
    c = Compensation("dc", 1)
    w = np.zeros(1, np.float32)
    c.lent(5, w)
    c.lent(5, w)  # a second worker leased the same version: no second copy
    c.lent(6, w)
    assert c.kept == 2
    c.apply_to(np.ones(1, np.float32), 5, w)
    assert c.kept == 2
    c.apply_to(np.ones(1, np.float32), 5, w)
    c.apply_to(np.ones(1, np.float32), 6, w)
    assert c.kept == 0


def test_only_dc_keeps_weights():
    assert Compensation("dc", 1).keeps_weights
    assert not any(Compensation(kind, 1).keeps_weights for kind in ("none", "sqrt", "inverse"))
    g = np.ones(2, np.float32)
    assert Compensation("sqrt", 2).apply_to(g, 0, g) is g  # nothing to correct


@pytest.mark.skipif(not optim.FUSED, reason="the compiled updates are not built")
def test_the_fused_delay_compensation_gives_numpys_bits(monkeypatch):
    rng = np.random.default_rng(5)
    n = 10_001  # not a multiple of any vector width: the loops' tails too
    grads = [(rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1)).astype(np.float32)
             for _ in range(4)]
    w_read, w_now = (rng.standard_normal(n).astype(np.float32) for _ in range(2))

    def corrected(fused: bool):
        monkeypatch.setattr(optim, "FUSED", fused)
        c = Compensation("dc", n)
        out = []
        for version, g in enumerate(grads):
            c.lent(version, w_read)
            out.append(c.apply_to(g.copy(), version, w_now).tobytes())
        return out + [c._mean_square.tobytes()]

    fused, numpy_side = corrected(True), corrected(False)
    assert fused[0] != grads[0].tobytes()  # it corrected
    assert fused == numpy_side


def test_auto_is_dc_where_the_weights_kept_fit_the_budget():
    from mpitrain.train.asynchronous.compensation import DC_BUDGET, chosen
    assert chosen("auto", 61_706, 64) == "dc"  # LeNet at 64 workers: 16 MB
    assert chosen("auto", 61_100_840, 2) == "sqrt"  # AlexNet: 244 MB a copy
    assert chosen("auto", DC_BUDGET // 4 // 16, 16) == "dc"  # exactly the budget
    assert chosen("auto", DC_BUDGET // 4 // 16 + 1, 16) == "sqrt"
    assert chosen("inverse", 10, 2) == "inverse"  # a setting given is taken as it is
