"""The model registry: names -> Keras models and their training defaults.

Trainers never look inside a model: they ask the registry for a :class:`ModelSpec`
by name, build it, and treat it as a function from images to logits with a list
of trainable variables. Registering a model is one decorated builder::

    @register("lr", defaults=dict(optimizer="sgd", lr=0.5, batch_size=100, epochs=30))
    def logistic_regression(input_shape, num_classes):
        ...return a keras.Model producing logits...

Contract for builders: output unnormalised logits (the trainer applies softmax
cross-entropy) and hold no non-trainable state, so that replicas that apply the
same gradients hold bit-identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict

from .errors import UsageError


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: its builder, its training defaults and a one-line summary."""

    name: str
    build: Callable  # (input_shape, num_classes) -> keras.Model producing logits
    summary: str
    #: per-model defaults for Config fields left unset (epochs, batch_size, lr, optimizer, dataset)
    defaults: Dict[str, object] = field(default_factory=dict)
    #: dataset options for synthetic input (AlexNet): image size, channels, classes...
    synthetic: Dict[str, int] = field(default_factory=dict)


_REGISTRY: Dict[str, ModelSpec] = {}


def register(name: str, summary: str, defaults: Dict[str, object], **synthetic):
    """Decorator adding a builder to the registry under ``name``."""

    def add(builder: Callable) -> Callable:
        _REGISTRY[name] = ModelSpec(name, builder, summary, dict(defaults), dict(synthetic))
        return builder

    return add


def get(name: str) -> ModelSpec:
    """The spec registered as ``name``; UsageError listing the choices otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(f"unknown model {name!r}; choose one of {', '.join(names())}") from None


def names():
    return sorted(_REGISTRY)


def specs():
    return [_REGISTRY[n] for n in names()]


# ---------------------------------------------------------------------------------------
# Models. Keras is imported inside the builders so that the CLI (help, usage errors)
# answers without loading TensorFlow.
# ---------------------------------------------------------------------------------------
MNIST_LIKE = dict(image_size=28, channels=1, num_classes=10, n_test=512)


@register("lr", "logistic regression: 784 -> 10 softmax (7,850 parameters)",
          defaults=dict(optimizer="sgd", lr=0.5, batch_size=100, epochs=30, dataset="auto",
                        lr_schedule="constant"),
          **MNIST_LIKE)
def logistic_regression(input_shape, num_classes):
    import keras

    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Flatten(),
        keras.layers.Dense(num_classes, name="logits"),
    ], name="logistic_regression")


@register("lenet", "LeNet-5: conv-pool-conv-pool-120-84-10 (61,706 parameters)",
          defaults=dict(optimizer="adam", lr=0.001, batch_size=64, epochs=8,
                        dataset="auto", lr_schedule="cosine"),
          **MNIST_LIKE)
def lenet(input_shape, num_classes):
    """Defaults measured on the 20,000-image MNIST subset: Adam 1e-3 with cosine decay
    reaches 98.6% single-node and holds sync (linear lr scaling) and async at -np 4;
    momentum SGD collapsed at the scaled lr (sync -np 4) and with stale gradients."""
    import keras

    L = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        L.Conv2D(6, 5, padding="same", activation="relu"),   # 28x28x6
        L.MaxPooling2D(2),                                     # 14x14x6
        L.Conv2D(16, 5, activation="relu"),                    # 10x10x16
        L.MaxPooling2D(2),                                     # 5x5x16
        L.Flatten(),
        L.Dense(120, activation="relu"),
        L.Dense(84, activation="relu"),
        L.Dense(num_classes, name="logits"),
    ], name="lenet5")


@register("alexnet", "AlexNet: 5 conv + 3 dense (61.1M parameters at 224x224x3, 1000 "
          "classes); synthetic ImageNet-shaped data",
          defaults=dict(optimizer="momentum", lr=0.01, batch_size=64, epochs=1,
                        dataset="synthetic", lr_schedule="constant"),
          image_size=224, channels=3, num_classes=1000, n_test=256)
def alexnet(input_shape, num_classes):
    """Krizhevsky et al.'s network as torchvision defines it (one tower, no LRN).

    At 224x224 the feature maps are 55, 27, 13, 6 wide, exactly as published.
    Below 64 pixels the first convolution's stride is 1 instead of 4 so that
    small test images (32x32) still leave a 2x2 map for the dense layers.
    """
    import keras

    L = keras.layers
    size = int(input_shape[0])
    if size < 32:
        raise UsageError(f"--image-size {size} is too small for alexnet; use 32 or more")
    return keras.Sequential([
        keras.Input(input_shape),
        L.ZeroPadding2D(2),
        L.Conv2D(64, 11, strides=4 if size >= 64 else 1, activation="relu"),
        L.MaxPooling2D(3, 2),
        L.Conv2D(192, 5, padding="same", activation="relu"),
        L.MaxPooling2D(3, 2),
        L.Conv2D(384, 3, padding="same", activation="relu"),
        L.Conv2D(256, 3, padding="same", activation="relu"),
        L.Conv2D(256, 3, padding="same", activation="relu"),
        L.MaxPooling2D(3, 2),
        L.Flatten(),
        L.Dropout(0.5),
        L.Dense(4096, activation="relu"),
        L.Dropout(0.5),
        L.Dense(4096, activation="relu"),
        L.Dense(num_classes, name="logits"),
    ], name="alexnet")
