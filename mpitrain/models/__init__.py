"""The model registry: names -> Keras models and their training defaults; and the
user's own models, named ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``.

Trainers never look inside a model: they ask the registry for a :class:`ModelSpec`
by name, build it, and treat it as a function from images to logits with a list
of trainable variables. Registering a model is one decorated builder::

    @register("lr", defaults=dict(optimizer="sgd", lr=0.5, batch_size=100, epochs=30))
    def logistic_regression(input_shape, num_classes):
        ...return a keras.Model producing logits...

Contract for builders: ``build(input_shape, num_classes)`` returns a
``keras.Model`` whose output is (batch, num_classes) unnormalised logits (the
trainer applies softmax cross-entropy; ``--outputs probabilities`` for a model
ending in softmax). Non-trainable float state (BatchNorm statistics) is
allowed: the trainers keep it consistent (see :mod:`mpitrain.models.replica`).

A user's builder is loaded by :func:`get` from its spec: a file path (``.py``,
or any path with a ``/``) is imported as a module of its own; otherwise the
module is imported the way ``python -m`` would (the current directory first on
``sys.path``). Every problem (missing file, import error, no such function, a
result that is not a Keras model, the wrong output shape) is one UsageError
naming the spec. Specs take :data:`USER_DEFAULTS`.

The package: :mod:`.registry` (the named models), :mod:`.zoo` (the built-in ones:
LR, LeNet, AlexNet, ResNet-20; :mod:`.layers`, their fused BatchNorm), :mod:`.user`
(a user's spec), :mod:`.keras_import`
(TensorFlow and Keras imported the quick way), :mod:`.replica` (a
built model as flat weight and buffer vectors, what the trainers hold) and
:mod:`.optim` (updates on a flat vector, fused in C: the async server's, and the sync
workers' for large models).
"""

from __future__ import annotations

from typing import Dict

from ..errors import UsageError
from .registry import REGISTRY, USER_DEFAULTS, ModelSpec, names, register, specs
from .keras_import import import_keras
from ..config.model_names import canonical, is_spec, run_name, same_model
from .user import blame_user_code, from_callable, precheck, user_spec


def get(name: str) -> ModelSpec:
    """The registered model ``name``, or the user's model of spec ``name``.

    UsageError listing the choices for an unknown name, or naming the spec and
    the problem for a spec that cannot be loaded.
    """
    if is_spec(name):
        return user_spec(name)
    try:
        return REGISTRY[name]
    except KeyError:
        raise UsageError(f"unknown model {name!r}; choose one of {', '.join(names())}, or "
                         "give your own as FILE.py:FUNCTION or module:FUNCTION") from None


def defaults_for(name: str) -> Dict[str, object]:
    """The training defaults of ``name`` without loading a user's model (no import)."""
    return dict(USER_DEFAULTS) if is_spec(name) else get(name).defaults


from . import zoo  # noqa: E402,F401  (registers the built-in models; needs register above)

__all__ = ["ModelSpec", "USER_DEFAULTS", "register", "get", "names", "specs", "defaults_for",
           "canonical", "from_callable", "import_keras", "is_spec", "precheck", "run_name",
           "same_model", "UsageError", "blame_user_code"]
