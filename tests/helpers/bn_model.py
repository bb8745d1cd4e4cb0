"""A small test model with both kinds of state that is not trained: BatchNorm moving
statistics (float buffers, averaged across workers) and a Dropout seed (integer
random-generator state, kept per worker). Loaded as a model spec,
``tests/helpers/bn_model.py:build`` (the CLI and ``mpitrain.models.get`` alike; the
tests name it ``conftest.BN_MODEL_SPEC``)."""

import keras


def build(input_shape, num_classes):
    L = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        L.Conv2D(8, 3, padding="same", use_bias=False),
        L.BatchNormalization(momentum=0.9), L.ReLU(), L.MaxPooling2D(2),
        L.Flatten(), L.Dropout(0.2),
        L.Dense(16, use_bias=False), L.BatchNormalization(momentum=0.9), L.ReLU(),
        L.Dense(num_classes),
    ], name="bn_test_model")
