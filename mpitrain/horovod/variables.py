"""The variables' broadcasts of ``mpitrain.horovod``: a model's or a TF1 graph's variables
assigned the root rank's values, one fused broadcast per dtype (:mod:`.ops` has the
tensors' collectives).

Cross-rank contract: every rank calls them with the same variables (shapes and dtypes)
in the same order, as every collective.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from ..models.keras_import import import_tensorflow
from . import world as runtime
from .ops import (_call, _check_process_set, _one_after_another, _op_name, global_process_set,
                  plain)

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = import_tensorflow()  # (loaded by .ops already)


@plain
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign rank ``root_rank``'s values to ``variables`` (tf.Variable or Keras 3
    variables) on every rank: one fused broadcast per dtype. Eager: done when it
    returns; in a graph: returns the op that does it."""
    _check_process_set(process_set)
    runtime.engine()
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    by_dtype = {}
    for v in variables:
        by_dtype.setdefault(tf.as_dtype(v.dtype), []).append(v)
    if tf.executing_eagerly():
        for group in by_dtype.values():
            _broadcast_eagerly(group, root_rank)
        return None
    groups = _one_after_another([partial(_broadcast_in_graph, group, root_rank)
                                 for group in by_dtype.values()])
    return tf.group(*[assign for assigns in groups for assign in assigns])


@plain
def broadcast_global_variables(root_rank):
    """A TF1 graph's global variables (``tf.compat.v1.global_variables()``) assigned rank
    ``root_rank``'s values: the op that does it (:func:`broadcast_variables`). Eagerly a
    RuntimeError, as Horovod's."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() is TensorFlow 1's and does not "
                           "run eagerly: use hvd.broadcast_variables(<model and optimizer "
                           "variables>, root_rank)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def _broadcast_eagerly(group, root: int) -> None:
    shapes = [tuple(v.shape) for v in group]
    flat = np.concatenate([np.asarray(v.numpy()).reshape(-1) for v in group])
    _call(lambda: runtime.engine().broadcast_(flat, root, "variables"))
    offset = 0
    for v, shape in zip(group, shapes):
        n = int(np.prod(shape, dtype=np.int64))
        v.assign(flat[offset:offset + n].reshape(shape))
        offset += n


def _broadcast_in_graph(group, root: int):
    values = [tf.convert_to_tensor(v) for v in group]
    fused = tf.concat([tf.reshape(t, [-1]) for t in values], 0)
    owned = len(values) > 1

    def run(a):
        return _call(lambda: runtime.engine().broadcast_(a if owned else a.copy(), root,
                                                     "variables"))
    out = tf.numpy_function(run, [fused], fused.dtype, stateful=True,
                            name=_op_name("broadcast_variables", None))
    parts = tf.split(out, [tf.size(t) for t in values])
    return [v.assign(tf.reshape(p, tf.shape(t))) for v, p, t in zip(group, parts, values)]


@plain
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Horovod's in-place broadcast of variables (:func:`broadcast_variables`); returns
    their values after it, one tensor per variable, as Horovod does (in a graph, read
    once the broadcast has run)."""
    variables = list(variables)
    done = broadcast_variables(variables, root_rank, process_set)
    if done is None:  # eagerly: done
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies([done]):
        return [tf.identity(v) for v in variables]
