"""Horovod's collectives on TensorFlow tensors, in eager code and inside ``tf.function``.

Each is one ``tf.numpy_function`` around a call of the :class:`~.collectives.Collectives`: in
eager code it runs at once, in a graph when the graph runs, in program order with
the graph's other collectives (the function is stateful, so TensorFlow keeps their
order). Tensors of one dtype reduced together (``grouped_allreduce``, a gradient
tape's gradients) are fused: ONE concatenation into a fresh buffer, ONE allreduce
of it in place, and views of it split back into the tensors' shapes, the path
mpitrain's own sync trainer takes. A numpy function cannot run inside XLA
(``jit_compile=True``).
"""

from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..errors import UsageError
from ..models.keras_import import import_tensorflow
from . import world as runtime
from .compression import Compression, SumReplacing, compressor
from .collectives import (OP_NAMES, Adasum, Average, Max, Min, Mismatch,  # noqa: F401
                          Product, Sum)  # (re-exported)
from .world import STATE, unsupported

# the quick way unless the script imported TensorFlow already: on every rank, half the
# CPU of a plain import (mpitrain/models/keras_import.py)
if TYPE_CHECKING:
    import tensorflow as tf
else:
    tf = import_tensorflow()

#: the default process set: the only one there is
global_process_set = None
#: the public calls run as they are inside tf.function: autograph has nothing to convert
#: in them (no Python control flow on tensors), and converting them cost seconds of CPU
#: at a script's first trace
plain = tf.autograph.experimental.do_not_convert


def _taped() -> bool:
    """Whether what is built now may be differentiated: in a graph (``tf.function``, a TF1
    graph: ``tf.gradients`` may ask), or eagerly where a gradient tape may record. Only
    then does a collective carry its gradient function (tf.custom_gradient costs
    milliseconds an eager call; in a graph, once when it is built)."""
    if not tf.executing_eagerly():
        return True
    try:
        from tensorflow.python.eager import record
    except ImportError:  # (a TensorFlow that moved it: always differentiable)
        return True
    return record.could_possibly_record()


def _carrying_gradient(t, forward, gradient):
    """``forward(t)``, with ``gradient`` (dy -> the gradient of ``t``) as its gradient
    where it may be differentiated (:func:`_taped`) and ``t`` is floating."""
    return _carrying_gradients([t], [(forward, gradient)])[0]


def _carrying_gradients(ts, calls):
    """Each ``forward(t)`` of ``calls``' (forward, gradient) pairs, one after another, and
    where differentiated their gradients (dy -> the gradient of t) one after another
    too (:func:`_one_after_another`, :func:`_differentiable`)."""
    def forward(xs):
        return _one_after_another([partial(f, x) for x, (f, _) in zip(xs, calls)])

    def gradient(dys, outs):
        return _one_after_another([partial(g, dy) for dy, (_, g) in zip(dys, calls)])
    return _differentiable(ts, forward, gradient)


def _differentiable(ts, forward, gradient):
    """``forward(ts)`` (a list of tensors), with ``gradient(dys, outs)`` (the list of the
    ``ts``' gradients) as its gradient where it may be differentiated and every t is
    floating; plain otherwise (a custom gradient costs milliseconds an eager call:
    :func:`_taped`). An output no gradient reached gets zeros, as Horovod's; the
    gradient's collectives run after the forward's (a TF1 graph would not order them
    where the dys do not depend on the outputs)."""
    if not (_taped() and all(t.dtype.is_floating for t in ts)):
        return forward(ts)

    @tf.custom_gradient
    def differentiable(*xs):
        outs = forward(list(xs))

        def grad(*dys):
            with tf.control_dependencies(outs):
                return gradient([tf.zeros_like(o) if dy is None else dy
                                 for dy, o in zip(dys, outs)], outs)
        return outs, grad
    return list(differentiable(*ts))


def _check_process_set(process_set) -> None:
    if process_set is not None:
        raise unsupported("process sets", "every collective runs on all ranks; run the "
                                          "groups as separate jobs")


def _op(op, average) -> int:
    """Horovod's ``op`` from its arguments (``average`` is the deprecated spelling)."""
    if op is not None and average is not None:
        raise ValueError("give op or average, not both")
    if op is None:
        op = Average if average is None or average else Sum
    if op == Adasum:
        raise unsupported("the Adasum reduction", "use op=hvd.Average (or Sum)")
    return op


class MismatchError(Mismatch, tf.errors.FailedPreconditionError):
    """A :class:`Mismatch` as the caller meets it: TensorFlow's FailedPreconditionError,
    as Horovod raises it (caught, it leaves the ranks in step: each raised it at the
    same call). Uncaught, it ends the job with its one line like any Mismatch. Inside a
    graph TensorFlow reports every Python exception as an UnknownError."""

    def __init__(self, error: Mismatch):
        tf.errors.FailedPreconditionError.__init__(self, None, None, str(error))
        self.summary, self.reporter = None, error.reporter


def _call(fn):
    """``fn()`` (an engine call); an mpitrain error is remembered first, so that when
    TensorFlow wraps it (inside a graph) the job still ends with its one line."""
    try:
        return fn()
    except Mismatch as error:
        STATE.last_error = MismatchError(error)
        raise STATE.last_error from None
    except runtime.MpitrainError as error:
        STATE.last_error = error
        raise


def _matching_name(name: Optional[str], tensor: tf.Tensor) -> str:
    """The name the ranks pair a collective by: the caller's, or in a TF1 graph its
    tensor's name, as Horovod names them (``Session.run`` runs independent collectives
    in any order on each rank: paired by order alone, two alike would be reduced
    together); '' in eager mode and in ``tf.function``, which run them in program
    order."""
    if name or tf.executing_eagerly() or tf.compat.v1.get_default_graph().building_function:
        return name or ""
    return tensor.name


def _one_after_another(calls: Sequence[Callable[[], Any]]) -> List:
    """``calls``' results, each call's collectives run after the previous call's results
    (a TF1 graph runs independent collectives in any order on each rank; eagerly and in
    ``tf.function`` they run in program order anyway)."""
    if tf.executing_eagerly():
        return [call() for call in calls]
    results: List = []
    for call in calls:
        previous = tf.nest.flatten(results[-1], expand_composites=True) if results else []
        with tf.control_dependencies([t for t in previous if t is not None]):
            results.append(call())
    return results


def _op_name(kind: str, name: Optional[str]) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", f"mpitrain_{kind}" + (f"_{name}" if name else ""))


# ---- allreduce ---------------------------------------------------------------------------
def _fused_allreduce(tensors: Sequence[tf.Tensor], op: int, prescale: float = 1.0,
                     postscale: float = 1.0, name: Optional[str] = None) -> List[tf.Tensor]:
    """Reduce dense ``tensors`` over every rank: one fused collective per dtype (in the
    order the dtypes first appear: the same on every rank)."""
    runtime.engine()  # NotInitialized now, at trace time, not inside the graph
    out: List[Optional[tf.Tensor]] = [None] * len(tensors)
    by_dtype: Dict[object, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    def reduce_group(dtype, indices):
        group = [tensors[i] for i in indices]
        if dtype == tf.bfloat16:  # MPI has no bfloat16 arithmetic: reduce in float32
            group = [tf.cast(t, tf.float32) for t in group]
        return [tf.cast(t, dtype) if dtype == tf.bfloat16 else t
                for t in _allreduce_group(group, op, prescale, postscale, name)]
    reduced = _one_after_another([partial(reduce_group, d, i) for d, i in by_dtype.items()])
    for indices, group in zip(by_dtype.values(), reduced):
        for i, t in zip(indices, group):
            out[i] = t
    return out


def _allreduce_group(tensors: List[tf.Tensor], op: int, prescale: float, postscale: float,
                     name: Optional[str]) -> List[tf.Tensor]:
    dtype = tensors[0].dtype
    name = _matching_name(name, tensors[0])
    if len(tensors) == 1:  # the tensor as it is: the engine reduces a copy
        t = tensors[0]

        def reduce_one(a):  # (a numpy scalar, in a graph, for a scalar tensor)
            return _call(lambda: runtime.engine().allreduce_(np.array(a), op, prescale,
                                                             postscale, name=name or ""))
        out = tf.numpy_function(reduce_one, [t], dtype, stateful=True,
                                name=_op_name("allreduce", name))
        out.set_shape(t.shape)
        return [out]
    shapes = [tuple(-1 if d is None else d for d in t.shape.as_list()) for t in tensors]
    fused = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)  # a fresh buffer, ours

    def reduce_fused(a):
        return _call(lambda: runtime.engine().allreduce_(a, op, prescale, postscale,
                                                         shape=shapes, name=name or ""))
    out = tf.numpy_function(reduce_fused, [fused], dtype, stateful=True,
                            name=_op_name("grouped_allreduce", name))
    out.set_shape(fused.shape)
    static = all(t.shape.is_fully_defined() for t in tensors)
    sizes = [t.shape.num_elements() if static else tf.size(t) for t in tensors]
    return [tf.reshape(part, t.shape if static else tf.shape(t))
            for part, t in zip(tf.split(out, sizes), tensors)]


@plain
def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """``tensor`` reduced over every rank with ``op`` (default Average: Sum, Min, Max,
    Product too), scaled by ``prescale_factor`` before and ``postscale_factor`` after.
    A ``tf.IndexedSlices`` is allgathered (values and indices) instead, as Horovod does.
    Collective: every rank calls it with the same shape and dtype; a rank whose call
    differs stops every rank with one line naming them. Differentiable (Sum, Average)."""
    _check_process_set(process_set)
    op = _op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, prescale_factor, postscale_factor, name)
    t = tf.convert_to_tensor(tensor)

    def forward(x):
        return reduce_list([x], op, compression, prescale_factor, postscale_factor, name)[0]

    def reduce(dy):  # Horovod's gradient of a Sum or Average: the allreduce of dy, as it is
        return _fused_allreduce([dy], op, prescale_factor, postscale_factor, name)[0]
    return _carrying_gradient(t, forward, reduce) if op in (Sum, Average) else forward(t)


def _sum_replaced(tensors: Sequence[tf.Tensor], op: int, codec: SumReplacing,
                  prescale: float, postscale: float, name: Optional[str]) -> List[tf.Tensor]:
    """Reduce dense floating ``tensors`` through ``codec`` (PowerSGD, top-k): fused into
    one float32 buffer, which the codec's engine for their shapes sums."""
    runtime.engine()  # NotInitialized now, at trace time
    if not all(t.dtype.is_floating and t.shape.is_fully_defined() for t in tensors):
        raise UsageError(f"Compression.{codec.name} reduces floating tensors of known "
                         "shapes; use Compression.none for the others")
    shapes = [tuple(t.shape.as_list()) for t in tensors]
    fused = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], 0)
    name = _matching_name(name, tensors[0])

    def reduce_fused(a):
        return _call(lambda: runtime.engine().allreduce_compressed_(
            a, codec, op, prescale, postscale, shape=shapes, name=name or ""))
    out = tf.numpy_function(reduce_fused, [fused], tf.float32, stateful=True,
                            name=_op_name("grouped_allreduce", name))
    parts = tf.split(out, [t.shape.num_elements() for t in tensors])
    return [tf.cast(tf.reshape(part, t.shape), t.dtype) for part, t in zip(parts, tensors)]


def _allreduce_sparse(slices: tf.IndexedSlices, op, prescale, postscale, name):
    # (Unsupported is a NotImplementedError, as Horovod raises here)
    if op not in (Sum, Average):
        raise unsupported(f"the {OP_NAMES[op]} reduction of tf.IndexedSlices",
                          "only Sum and Average reduce them (or pass sparse_as_dense=True)")
    if prescale != 1.0 or postscale != 1.0:
        raise unsupported("prescale_factor or postscale_factor with tf.IndexedSlices",
                          "scale the values before or after")
    values, indices = _one_after_another([partial(allgather, slices.values, name=name),
                                          partial(allgather, slices.indices, name=name)])
    if op == Average:
        values = values / tf.cast(runtime.topology().size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@plain
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """:func:`allreduce` of each of ``tensors``, fused into one collective per dtype.
    Differentiable (Sum, Average) where every tensor is dense and floating."""
    _check_process_set(process_set)
    if not tensors:
        return tensors
    op = _op(op, average)
    tensors = list(tensors)

    def reduce(xs, outs=None):  # (and Horovod's gradient: the same grouped allreduce of dy)
        return reduce_list(xs, op, compression, prescale_factor, postscale_factor, name)
    if op not in (Sum, Average) or any(t is None or isinstance(t, tf.IndexedSlices)
                                       for t in tensors):
        return reduce(tensors)
    return _differentiable([tf.convert_to_tensor(t) for t in tensors], reduce, reduce)


@plain
def reduce_list(tensors: List, op: int, compression, prescale: float = 1.0,
                postscale: float = 1.0, name: Optional[str] = None) -> List:
    """Reduce a list of tensors and ``tf.IndexedSlices`` (None entries stay None): the
    slices allgathered, the dense tensors compressed and fused."""
    out = list(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if t is not None
             and not isinstance(t, tf.IndexedSlices)]
    compress = compressor(compression).compress
    compressed = [compress(tf.convert_to_tensor(tensors[i])) for i in dense]
    calls = [partial(_allreduce_sparse, tensors[i], op, prescale, postscale, name)
             for i in sparse]
    if dense:
        sums = partial(_sum_replaced, codec=compression) \
            if isinstance(compression, SumReplacing) else _fused_allreduce
        calls.append(partial(sums, [c for c, _ in compressed], op, prescale=prescale,
                             postscale=postscale, name=name))
    results = _one_after_another(calls)
    for i, slices in zip(sparse, results):
        out[i] = slices
    for i, r, (_, ctx) in zip(dense, results[-1] if dense else [], compressed):
        out[i] = compression.decompress(r, ctx)
    return out


# ---- gather, broadcast, scatter -----------------------------------------------------------
@plain
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order (the
    first dimension may differ between ranks; the others may not). Differentiable."""
    _check_process_set(process_set)
    t = tf.convert_to_tensor(tensor)
    return _carrying_gradient(t, *_allgather_calls(t, name))


def _allgather_calls(t: tf.Tensor, name: Optional[str]):
    """An allgather of ``t``: (forward, Horovod's gradient: the averaged gradient, this
    rank's rows of it)."""
    top = runtime.topology()

    def grad(dy):
        averaged, rows = _one_after_another([
            lambda: _fused_allreduce([dy], Average)[0],
            lambda: _gather(tf.reshape(tf.shape(t)[0], [1]), name)])
        return tf.split(averaged, tf.reshape(rows, [top.size]))[top.rank]
    return (lambda x: _gather(x, name)), grad


def _gather(t: tf.Tensor, name: Optional[str]) -> tf.Tensor:
    name = _matching_name(name, t)

    def gather(a):
        return _call(lambda: runtime.engine().allgather(a, name or ""))
    out = tf.numpy_function(gather, [t], t.dtype, stateful=True,
                            name=_op_name("allgather", name))
    out.set_shape([None] + t.shape.as_list()[1:])
    return out


@plain
def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """:func:`allgather` of each of ``tensors``, one after another (gradients too)."""
    _check_process_set(process_set)
    ts = [tf.convert_to_tensor(t) for t in tensors]
    return _carrying_gradients(ts, [_allgather_calls(t, name) for t in ts])


@plain
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Rank ``root_rank``'s ``tensor`` on every rank (same shape and dtype everywhere)."""
    _check_process_set(process_set)
    runtime.engine()
    t = tf.convert_to_tensor(tensor)

    def send(x):
        matching = _matching_name(name, x)

        def run(a):
            return _call(lambda: runtime.engine().broadcast_(np.array(a), root_rank,
                                                             matching))
        out = tf.numpy_function(run, [x], x.dtype, stateful=True,
                                name=_op_name("broadcast", matching))
        out.set_shape(x.shape)
        return out

    def grad(dy):  # Horovod's: the averaged gradient on the root, zero elsewhere
        averaged = _fused_allreduce([dy], Average)[0]
        return averaged if runtime.topology().rank == root_rank else averaged * 0
    return _carrying_gradient(t, send, grad)


@plain
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """``tensor`` reduced over every rank, and this rank's part of its first dimension
    (split as Horovod splits it: the first dim % size ranks get one row more).
    Reduced whole, then cut: correct, not bandwidth-optimal."""
    _check_process_set(process_set)
    t = tf.convert_to_tensor(tensor)
    return _carrying_gradient(t, *_reducescatter_calls(op, compression, name, prescale_factor,
                                                       postscale_factor))


def _reducescatter_calls(op, compression, name, prescale: float, postscale: float):
    """A reducescatter: (forward, Horovod's gradient: every rank's rows gathered, times
    size for a Sum)."""
    if op not in (Sum, Average):
        raise ValueError("reducescatter takes op=Average or Sum")
    top = runtime.topology()

    def scatter(x):
        reduced = allreduce(x, compression=compression, op=op, name=name,
                            prescale_factor=prescale, postscale_factor=postscale)
        rows = tf.shape(reduced)[0]
        base, extra = rows // top.size, rows % top.size
        start = top.rank * base + tf.minimum(top.rank, extra)
        count = base + tf.cast(top.rank < extra, rows.dtype)
        return reduced[start:start + count]

    def grad(dy):
        factor = (top.size if op == Sum else 1) * prescale * postscale
        gathered = allgather(dy, name=name)
        return gathered * tf.cast(factor, dy.dtype) if factor != 1 else gathered
    return scatter, grad


@plain
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    _check_process_set(process_set)
    ts = [tf.convert_to_tensor(t) for t in tensors]
    calls = _reducescatter_calls(op, compression, None, prescale_factor, postscale_factor)
    return _carrying_gradients(ts, [calls] * len(ts))


# ---- objects, barrier, join ---------------------------------------------------------------
def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` (any picklable object) on every rank."""
    _check_process_set(process_set)
    return _call(lambda: runtime.engine().broadcast_object(obj, root_rank))


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts its argument from ``root_rank`` (Horovod's)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (picklable), as a list in rank order."""
    _check_process_set(process_set)
    return _call(lambda: runtime.engine().allgather_object(obj))


@plain
def barrier(process_set=global_process_set):
    """Return once every rank has called it. In a graph, the op that waits."""
    _check_process_set(process_set)
    runtime.engine()
    if tf.executing_eagerly():
        return _call(runtime.engine().barrier)

    def run():
        _call(runtime.engine().barrier)
        return np.int32(0)
    return tf.numpy_function(run, [], tf.int32, stateful=True, name="mpitrain_barrier")


@plain
def join():
    """This rank has finished its data: until every rank has joined, it takes part in the
    others' allreduces with zeros (an Average still divides by every rank). Returns the
    rank that joined last (a tensor, as Horovod's)."""
    runtime.engine()

    def run():
        return np.int32(_call(runtime.engine().join))
    if tf.executing_eagerly():
        return tf.constant(run())
    return tf.numpy_function(run, [], tf.int32, stateful=True, name="mpitrain_join")


# ---- who am I, as tensors -----------------------------------------------------------------
def size_op(process_set_id=0, name=None):
    return tf.constant(runtime.topology().size, name=name)


def local_size_op(name=None):
    return tf.constant(runtime.topology().local_size, name=name)


def rank_op(name=None):
    return tf.constant(runtime.topology().rank, name=name)


def local_rank_op(name=None):
    return tf.constant(runtime.topology().local_rank, name=name)
