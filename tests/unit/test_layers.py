"""The fused BatchNormalization of the built-in models against Keras' own (TensorFlow, no MPI)."""

import numpy as np
import pytest

from mpitrain.models.replica import init_tensorflow


def twin_layers(shape):
    """Keras' BatchNormalization and the fused one, built for ``shape``, with the same
    (non-trivial) scale, offset and moving statistics."""
    init_tensorflow(1, 0)
    import keras

    from mpitrain.models.layers import FusedBatchNormalization

    keras_bn = keras.layers.BatchNormalization(momentum=0.9)
    fused_bn = FusedBatchNormalization(momentum=0.9)
    rng = np.random.default_rng(0)
    for layer in (keras_bn, fused_bn):
        layer.build(shape)
    values = [rng.uniform(0.5, 1.5, v.shape).astype(np.float32) for v in keras_bn.weights]
    for layer in (keras_bn, fused_bn):
        for v, value in zip(layer.weights, values):
            v.assign(value)
    return keras_bn, fused_bn, dict(zip(("gamma", "beta", "mean", "variance"), values))


def run(layer, x, training):
    """(output, gradients of a weighted sum of it w.r.t. input, scale, offset)."""
    import tensorflow as tf

    x = tf.constant(x)
    weights = tf.constant(np.linspace(-1, 1, int(np.prod(x.shape)), dtype=np.float32)
                          .reshape(x.shape))
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, training=training)
        loss = tf.reduce_sum(out * weights)
    grads = tape.gradient(loss, [x, layer.gamma, layer.beta])
    return out.numpy(), [g.numpy() for g in grads]


@pytest.mark.parametrize("training", [True, False])
def test_fused_batch_norm_computes_what_keras_does(training):
    x = np.random.default_rng(1).normal(2.0, 3.0, (8, 6, 5, 4)).astype(np.float32)
    keras_bn, fused_bn, before = twin_layers(x.shape)
    (ours, our_grads), (theirs, their_grads) = (run(fused_bn, x, training),
                                                run(keras_bn, x, training))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    for mine, keras_grad in zip(our_grads, their_grads):
        np.testing.assert_allclose(mine, keras_grad, rtol=1e-3, atol=1e-3)
    if not training:  # inference leaves the moving statistics alone
        for layer in (fused_bn, keras_bn):
            np.testing.assert_array_equal(layer.moving_mean.numpy(), before["mean"])
            np.testing.assert_array_equal(layer.moving_variance.numpy(), before["variance"])
        return
    n = 8 * 6 * 5  # the positions each channel's moments are over
    mean, biased = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
    for layer in (fused_bn, keras_bn):
        np.testing.assert_allclose(layer.moving_mean.numpy(),
                                   0.9 * before["mean"] + 0.1 * mean, rtol=1e-5)
    # the moving variance takes the batch's unbiased variance, Keras 3's the biased one
    np.testing.assert_allclose(keras_bn.moving_variance.numpy(),
                               0.9 * before["variance"] + 0.1 * biased, rtol=1e-5)
    np.testing.assert_allclose(fused_bn.moving_variance.numpy(),
                               0.9 * before["variance"] + 0.1 * biased * n / (n - 1),
                               rtol=1e-5)


def test_other_cases_are_keras_own_call():
    """A 2-D input (a dense layer's output) goes through Keras' call, the fused kernel
    being for images: the same numbers, the biased variance."""
    x = np.random.default_rng(2).normal(1.0, 2.0, (16, 3)).astype(np.float32)
    keras_bn, fused_bn, before = twin_layers(x.shape)
    for layer in (keras_bn, fused_bn):
        run(layer, x, True)
    np.testing.assert_allclose(fused_bn.moving_variance.numpy(),
                               keras_bn.moving_variance.numpy(), rtol=1e-6)
    np.testing.assert_allclose(fused_bn.moving_variance.numpy(),
                               0.9 * before["variance"] + 0.1 * x.var(axis=0), rtol=1e-5)


def test_resnet_uses_the_fused_layer_with_keras_variables():
    """ResNet-20 is built of the fused layer, and its variables are Keras' BatchNorm's in
    count and shape (what a checkpoint holds): 272,474 trainable parameters."""
    init_tensorflow(1, 0)
    from mpitrain import models
    from mpitrain.models.layers import FusedBatchNormalization

    model = models.get("resnet").build((32, 32, 3), 10)
    norms = [layer for layer in model.layers if "normalization" in type(layer).__name__.lower()]
    assert len(norms) == 21 and all(type(n) is FusedBatchNormalization for n in norms)
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == 272_474
    assert [v.name for v in norms[0].weights] == ["gamma", "beta", "moving_mean",
                                                  "moving_variance"]
