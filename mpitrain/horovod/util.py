"""``hvd.util``: the helpers of ``horovod.tensorflow.util`` that scripts and Horovod's own
tests import by that name (``from horovod.tensorflow.util import _executing_eagerly``),
so that they run with the import line changed and nothing else. Horovod's internal
graph helpers (``_make_subgraph``, ``_cache``) are not among them: nothing outside
Horovod calls them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, List

from ..models.keras_import import import_tensorflow

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = import_tensorflow()


def _executing_eagerly() -> bool:
    """Whether this code runs eagerly (not while a graph or a ``tf.function`` is built):
    the same on every rank that runs the same code. Horovod's name, underscore kept."""
    return tf.executing_eagerly()


def vars_to_refs(variables: Iterable) -> List:
    """Hashable references to ``variables`` (``tf.Variable.ref()``), for sets and dict
    keys; :func:`refs_to_vars` turns them back."""
    return [variable.ref() for variable in variables]


def refs_to_vars(refs: Iterable) -> List:
    """The variables that :func:`vars_to_refs` made ``refs`` of, in their order."""
    return [ref.deref() for ref in refs]
