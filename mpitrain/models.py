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
@register("lr", "logistic regression: 784 -> 10 softmax (7,850 parameters)",
          defaults=dict(optimizer="sgd", lr=0.5, batch_size=100, epochs=30, dataset="auto"))
def logistic_regression(input_shape, num_classes):
    import keras

    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Flatten(),
        keras.layers.Dense(num_classes, name="logits"),
    ], name="logistic_regression")
