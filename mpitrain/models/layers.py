"""Layers the built-in models use where Keras' own would cost time: BatchNormalization
on TensorFlow's fused kernel.

Keras 3 normalises a batch with a dozen elementwise operations (the moments, then
the affine transform, in training; their gradients after them), where Keras 2 used
TensorFlow's one fused kernel, as PyTorch does. ResNet-20's 21 BatchNorm layers
become over a thousand graph nodes that every rank traces and optimises at its first
step, and run slower at every step (docs/architecture.md, "BatchNorm on TensorFlow's
fused kernel"). The fused layer
below is Keras' layer (its variables, their names and order, its configuration, and
Keras' own call for masked, non-4-D, renormalised, synchronised and mixed-precision
inputs) with the 4-D float32 call on the kernel, so a checkpoint holds the same
values in the same places either way.

Import this module inside a model's builder: it loads Keras.
"""

from __future__ import annotations

from .keras_import import import_keras

keras = import_keras()


class FusedBatchNormalization(keras.layers.BatchNormalization):  # type: ignore[name-defined]
    """``keras.layers.BatchNormalization`` on TensorFlow's fused kernel for 4-D float32
    inputs normalised over the last axis (NHWC images), with scale and offset; any
    other case is Keras' own call.

    One difference, in the moving variance only: it is updated with the batch's
    unbiased variance (n / (n - 1) times the biased one that normalises the batch),
    as Keras 2's fused layer and PyTorch's BatchNorm do; Keras 3 uses the biased one.
    At ResNet-20's smallest batch of positions (64 images x 8 x 8) that is 0.02%.
    """

    def call(self, inputs, training=None, mask=None):
        import tensorflow as tf

        if (mask is not None or len(inputs.shape) != 4 or self.axis not in (-1, 3)
                or inputs.dtype != tf.float32 or not (self.scale and self.center)
                or self.renorm or self.synchronized):
            return super().call(inputs, training=training, mask=mask)
        training = bool(training and self.trainable)
        # in training, the kernel also folds the batch's moments into the moving ones
        outputs, mean, variance, *_ = tf.raw_ops.FusedBatchNormV3(
            x=inputs, scale=self.gamma.value, offset=self.beta.value,
            mean=self.moving_mean.value, variance=self.moving_variance.value,
            epsilon=self.epsilon, exponential_avg_factor=1.0 - self.momentum if training
            else 1.0, data_format="NHWC", is_training=training)
        if training:
            self.moving_mean.assign(mean)
            self.moving_variance.assign(variance)
        return outputs
