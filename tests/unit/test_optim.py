"""The server's numpy optimizers follow Keras 3's updates (the same --optimizer in both modes)."""

import numpy as np
import pytest

from mpitrain import models
from mpitrain.models import optim
from mpitrain.models.replica import Replica, init_tensorflow


COSINE_4, COSINE_3 = optim.Schedule(decay_steps=4), optim.Schedule(decay_steps=3)
#: gradual warm-up over 3 of the 5 updates from a quarter of the peak, then constant or
#: cosine over the rest (the sync large-batch recipe)
WARM, WARM_COSINE = optim.Schedule(3, 0.25), optim.Schedule(3, 0.25, 5)


@pytest.mark.parametrize("name,lr,schedule,clip", [
    ("sgd", 0.5, None, None), ("momentum", 0.1, None, None), ("adam", 0.01, None, None),
    ("momentum", 0.1, COSINE_4, None), ("adam", 0.01, COSINE_3, None),
    ("sgd", 0.5, WARM, None), ("momentum", 0.1, WARM_COSINE, None),
    ("adam", 0.01, WARM_COSINE, None), ("nesterov", 0.05, None, None),
    ("nesterov", 0.05, WARM_COSINE, None),
    # --clip-grad-norm: the same clip-then-update chain on both paths (LR's gradient
    # norms here are ~0.5-2, so both clips below bind)
    ("sgd", 0.5, None, 0.05), ("momentum", 0.1, COSINE_4, 0.05), ("adam", 0.01, COSINE_3, 0.1),
    ("adam", 0.01, None, 1e-6)])
def test_flat_optimizer_matches_keras(name, lr, schedule, clip):
    init_tensorflow(1, 0)
    keras_side = Replica(models.get("lr"), (28, 28, 1), 10, name, lr, clip_norm=clip,
                         schedule=schedule, compiler="graph")
    weights = keras_side.weights()
    flat = optim.make(name, keras_side.n_params, lr, schedule, clip)
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
    # a checkpoint's optimizer state goes from either layout to the other (resuming a
    # run saved under another --compile, or by an mpitrain that kept Keras' optimizer)
    keras_state, keras_layout = keras_side.optimizer_state(), keras_side.optimizer_layout()
    flat_state = {f"o{i}": np.asarray(v) for i, v in enumerate(flat.state().values())}
    flat_layout = {f"o{i}": (np.shape(v), np.asarray(v).dtype.name)
                   for i, v in enumerate(flat.state().values())}
    # Keras': per variable (plain SGD has no slot: with a schedule, both hold the count)
    assert len(keras_layout) > len(flat_layout) or name == "sgd" and schedule
    for saved, layout, want in ((keras_state, flat_layout, flat_state),
                                (flat_state, keras_layout, keras_state)):
        got = keras_side.adapt_optimizer_state(saved, layout)
        assert list(got) == list(want)
        for key, value in want.items():
            assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
            np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=1e-8)
        back = keras_side.adapt_optimizer_state(got, {k: (np.shape(v), v.dtype.name)
                                                      for k, v in saved.items()})
        assert all(np.array_equal(back[k], saved[k]) for k in saved)  # the same numbers


def test_a_state_in_neither_layout_is_left_for_the_mismatch_check():
    init_tensorflow(1, 0)
    replica = Replica(models.get("lr"), (28, 28, 1), 10, "adam", 0.01)
    layout = replica.optimizer_layout()
    other = {"o0": np.array(3), "o1": np.zeros(5, np.float32), "o2": np.zeros(5, np.float32)}
    assert replica.adapt_optimizer_state(other, layout) is other
    gap = {"o0": np.array(3), "o2": np.zeros(5, np.float32)}  # o1 missing: edited
    assert replica.adapt_optimizer_state(gap, layout) is gap
    mine = replica.optimizer_state()
    assert replica.adapt_optimizer_state(mine, layout) is mine  # it fits already


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


@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov", "adam"])
def test_layout_describes_the_state_without_copying(name):
    opt = optim.make(name, 7, 0.1)
    state = opt.state()
    assert opt.layout() == {k: (np.shape(v), np.asarray(v).dtype.name) for k, v in state.items()}


def test_clip_by_global_norm():
    g = np.array([3.0, 4.0], np.float32)
    optim.clip_by_global_norm_(g, 1.0)
    np.testing.assert_allclose(g, [0.6, 0.8], rtol=1e-6)
    small = np.array([0.3, 0.4], np.float32)
    optim.clip_by_global_norm_(small, 1.0)
    assert small.tolist() == [np.float32(0.3), np.float32(0.4)]  # under the bound: untouched


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_shares_clipped_by_the_whole_norm_update_as_the_whole(name):
    """--servers K: each server steps its share with the norm of the whole gradient (the
    worker sends it): the shares put together are the one-server update, bit for bit."""
    rng = np.random.default_rng(0)
    weights = rng.normal(size=7850).astype(np.float32)
    grads = [rng.normal(size=7850).astype(np.float32) for _ in range(3)]
    whole = optim.make(name, 7850, 0.1, None, 1.0)
    bounds = (0, 3920, 7850)
    shares = [optim.make(name, b - a, 0.1, None, 1.0) for a, b in zip(bounds, bounds[1:])]
    one, parts = weights.copy(), [weights[a:b].copy() for a, b in zip(bounds, bounds[1:])]
    for g in grads:
        norm = float(np.sqrt(np.dot(g, g)))
        whole.step(one, g.copy())
        for opt, part, (a, b) in zip(shares, parts, zip(bounds, bounds[1:])):
            opt.step(part, g[a:b].copy(), norm)
    np.testing.assert_array_equal(np.concatenate(parts), one)


@pytest.mark.skipif(not optim.FUSED, reason="the compiled updates (mpitrain/models/_optim.c) "
                                            "are not built: no compiler at install time")
@pytest.mark.parametrize("name,schedule,clip", [
    ("sgd", None, None), ("momentum", None, None), ("adam", None, None),
    ("momentum", optim.Schedule(decay_steps=5), None), ("nesterov", None, 0.5),
    ("adam", optim.Schedule(2, 0.5, 7), 0.5)])
def test_fused_updates_give_numpys_bits(name, schedule, clip, monkeypatch):
    rng = np.random.default_rng(7)
    n = 10_001  # not a multiple of any vector width: the loops' tails too
    start = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 2)).astype(np.float32)
             for _ in range(6)]

    def trained(fused: bool):
        monkeypatch.setattr(optim, "FUSED", fused)
        opt = optim.make(name, n, 0.01, schedule, clip)
        weights = start.copy()
        for grad in grads:
            opt.step(weights, grad.copy())
        return [weights.tobytes()] + [v.tobytes() for v in opt.state().values()]

    fused, numpy_side = trained(True), trained(False)
    assert fused[0] != start.tobytes()  # it trained
    assert fused == numpy_side  # weights and every state vector, bit for bit


@pytest.mark.skipif(not optim.FUSED, reason="the compiled updates are not built")
def test_fused_updates_refuse_vectors_that_do_not_match():
    w = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="float32, of one length"):
        optim._optim.sgd(w, np.zeros(4, np.float64), 0.1)
    with pytest.raises(ValueError, match="float32, of one length"):
        optim._optim.momentum(w, np.zeros(4, np.float32), np.zeros(5, np.float32), 0.1, 0.9)
    with pytest.raises(ValueError, match="not C-contiguous"):
        optim._optim.sgd(np.zeros(4, np.float32)[::2], np.zeros(2, np.float32), 0.1)
    with pytest.raises(ValueError, match="not C-contiguous"):
        optim._optim.sgd(np.zeros(4, np.float32), np.zeros(4, np.float32)[::-1], 0.1)
    read_only = np.zeros(4, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        optim._optim.adam(read_only, w, w.copy(), w.copy(), 0.1, 0.001, 1e-7, 0.01)


def test_the_schedule_warms_up_linearly_then_decays_by_the_cosine():
    """Goyal et al.'s gradual warm-up from one worker's rate (1/k of the peak) to the peak,
    then cosine to 0 over the rest: values computed by hand."""
    k, warm, total = 8, 4, 12
    schedule = optim.Schedule(warm, 1 / k, total)
    assert [schedule.factor(t) for t in range(warm)] == pytest.approx(
        [0.125, 0.125 + 0.875 / 4, 0.125 + 0.875 / 2, 0.125 + 0.875 * 3 / 4])
    assert schedule.factor(warm) == 1.0  # the peak, where the decay begins
    assert schedule.factor(warm + 4) == pytest.approx(0.5)  # half way through 8 steps
    assert schedule.factor(total) == pytest.approx(0.0, abs=1e-12)
    assert optim.Schedule(warm, 1 / k).factor(100) == 1.0  # constant after it
    assert optim.Schedule(decay_steps=total).factor(3) == optim.cosine_factor(3, total)
    assert optim.Schedule().constant and not optim.Schedule(1).constant


def test_an_update_takes_its_lr_factor_and_the_schedule_goes_on():
    """The async servers' staleness compensation scales one update's rate (lr_factor);
    the schedule counts that update like any other."""
    opt = optim.make("sgd", 3, 0.5, optim.Schedule(2, 0.5))
    w, g = np.zeros(3, np.float32), np.ones(3, np.float32)
    opt.step(w, g.copy(), lr_factor=0.25)  # 0.5 x 0.5 (warm-up) x 0.25
    np.testing.assert_array_equal(w, [-0.0625] * 3)
    opt.step(w, g.copy())  # 0.5 x 0.75
    np.testing.assert_array_equal(w, [-0.4375] * 3)
    assert opt.iterations == 2
