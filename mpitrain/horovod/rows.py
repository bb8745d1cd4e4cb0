"""``alltoall`` of ``mpitrain.horovod``: rows of a tensor sent to every rank, Horovod's
call and gradient (:mod:`.ops` has the other tensors' collectives).

Cross-rank contract: every rank calls it in the same order with tensors of the same
dtype and dimensions after the first, as every collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..models.keras_import import import_tensorflow
from . import world as runtime
from .collectives import alltoall_splits
from .ops import (_call, _check_process_set, _differentiable, _matching_name, _op_name,
                  global_process_set, plain)

if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = import_tensorflow()  # (loaded by .ops already)


@plain
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Rank r gets ``splits[r]`` rows of ``tensor`` (its first dimension, in rank order;
    without ``splits`` as many rows to each rank); returns what every rank sent this
    one, concatenated in rank order, and, where ``splits`` was given, how many rows came
    from each rank. Collective: the same dtype and dimensions after the first on every
    rank. Differentiable (the gradient goes back the way the rows came)."""
    _check_process_set(process_set)
    size = runtime.topology().size
    t = tf.convert_to_tensor(tensor)
    given = splits is not None
    counts = tf.cast(tf.reshape(splits if given else tf.zeros([0], tf.int32), [-1]), tf.int32)
    _check_alltoall(t, given, tf.get_static_value(counts) if given else None, size)
    def forward(xs):
        return list(_alltoall(xs[0], counts, given, name))

    def gradient(dys, outs):  # Horovod's: the rows' gradients sent back where they came from
        return [_alltoall(dys[0], outs[1], True, None)[0]]
    out, received = _differentiable([t], forward, gradient)
    return (out, received) if given else out


def _check_alltoall(t: tf.Tensor, given: bool, splits, size: int) -> None:
    """What can be told before the call, raised as Horovod raises it (InvalidArgumentError);
    the engine checks what is known only when the graph runs."""
    shape = t.shape.as_list() if t.shape.rank is not None else None
    if shape is None or (shape and shape[0] is None) or (given and splits is None):
        return
    try:
        alltoall_splits(shape, splits, size)
    except ValueError as error:
        raise tf.errors.InvalidArgumentError(None, None, str(error)) from None


def _alltoall(t: tf.Tensor, counts: tf.Tensor, given: bool, name: Optional[str]):
    matching = _matching_name(name, t)

    def exchange(a, c):
        return _call(lambda: runtime.engine().alltoall(a, c if given else None, matching))
    out, received = tf.numpy_function(exchange, [t, counts], [t.dtype, tf.int32],
                                      stateful=True, name=_op_name("alltoall", matching))
    out.set_shape([None] + t.shape.as_list()[1:])
    received.set_shape([runtime.topology().size])
    return out, received
