"""The registry of named models: :class:`ModelSpec` and the :func:`register` decorator
the built-in models (:mod:`.zoo`) use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional


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
    #: a user's model: the file of its code (errors raised there are the user's to see)
    source: Optional[str] = None


REGISTRY: Dict[str, ModelSpec] = {}


def register(name: str, summary: str, defaults: Dict[str, object], **synthetic):
    """Decorator adding a builder to the registry under ``name``."""

    def add(builder: Callable) -> Callable:
        REGISTRY[name] = ModelSpec(name, builder, summary, dict(defaults), dict(synthetic))
        return builder

    return add


#: training defaults of a user's model (Config fields left unset)
#: --dataset synthetic for a user's model: MNIST's shape, as its default dataset
USER_SYNTHETIC = dict(image_size=28, channels=1, num_classes=10, n_test=512)
USER_DEFAULTS = dict(optimizer="adam", lr=0.001, batch_size=64, epochs=5, dataset="auto",
                     lr_schedule="constant")


def names():
    """The registered model names."""
    return sorted(REGISTRY)


def specs():
    return [REGISTRY[n] for n in names()]
