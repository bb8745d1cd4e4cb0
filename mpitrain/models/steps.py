"""A replica's TensorFlow functions over flat float32 vectors, compiled once, and
the Keras optimizer they update with.

:class:`FlatLayout` fixes the order of a model's trainable variables and the flat
vector over them; :class:`Steps` compiles the functions a replica runs on that vector
(the flat gradient, the Keras update, both in one call, a batch's evaluation, the
assignment of flat weights, the gradient handed out in buckets); :func:`step_function`
says how the training steps compile, graph or XLA; :func:`make_optimizer` builds the
Keras optimizer. The numpy side, and the flat optimizer, are
:class:`mpitrain.models.replica.Replica`'s.

Cross-rank contract: the same model gives the same :class:`FlatLayout` on every rank
(Keras' variable order), so offset ``i`` of a flat vector is the same weight on every
rank; that is what lets one allreduce sum the ranks' gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import optim


def make_optimizer(name: str, lr: float, schedule: Optional[optim.Schedule] = None):
    """A Keras optimizer; with ``schedule``, its learning rate follows it."""
    import keras

    if schedule is not None and not schedule.constant:
        lr = keras_schedule(lr, schedule)
    if name == "sgd":
        return keras.optimizers.SGD(lr)
    if name in ("momentum", "nesterov"):
        return keras.optimizers.SGD(lr, momentum=optim.MOMENTUM[name],
                                    nesterov=name == "nesterov")
    if name == "adam":
        return keras.optimizers.Adam(lr)
    raise ValueError(f"unknown optimizer {name}")


def keras_schedule(lr: float, schedule: optim.Schedule):
    """``schedule`` (:class:`mpitrain.models.optim.Schedule`) from peak rate ``lr`` as a
    Keras learning-rate schedule: Keras' own CosineDecay where there is no warm-up (the
    same bits as before warm-up existed), else the same formulas in Keras ops."""
    import keras

    if not schedule.warmup_steps:
        return keras.optimizers.schedules.CosineDecay(lr, schedule.decay_steps)

    class WarmUp(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            ops = keras.ops
            step = ops.cast(step, "float32")
            warm = float(schedule.warmup_steps)
            rising = lr * (schedule.start + (1.0 - schedule.start) * step / warm)
            after = lr
            if schedule.decay_steps:
                span = float(max(1, schedule.decay_steps - schedule.warmup_steps))
                done = ops.minimum(ops.maximum(step - warm, 0.0), span) / span
                after = lr * 0.5 * (1.0 + ops.cos(math.pi * done))
            return ops.where(step < warm, rising, after)

        def get_config(self):
            return {"lr": lr, **dataclasses.asdict(schedule)}
    return WarmUp()


def step_function(input_signature, xla: bool, modes: Dict[str, str],
                  name: Optional[str] = None):
    """A decorator: the function as a ``tf.function``, compiled by XLA if ``xla``.

    XLA fuses a step's elementwise work into few kernels, faster than graph mode
    with Eigen's kernels; but it runs its own kernels, not oneDNN's, so against graph
    mode with oneDNN (the default, see mpitrain/__init__.py) a convolutional model's
    gradient takes longer. It compiles for every batch shape (the epoch's short last
    batch is a second one), several times as long as tracing, so it pays off on long
    runs only (docs/architecture.md, "XLA only on request"). A model XLA cannot
    compile (an op it does not support, such as a ``tf.py_function``) fails at
    that first call, before anything ran; the function then falls back to graph
    mode for good. ``modes[name]`` (``name``: the function's own name if not given)
    says which the function runs in: 'graph', 'xla', or 'graph (XLA could not
    compile it)'. Every rank runs the same model on the same software, so all ranks
    fall back, or none.
    """
    import tensorflow as tf

    def decorate(fn):
        key = name or fn.__name__
        graph = tf.function(fn, input_signature=input_signature, autograph=False)
        modes[key] = "xla" if xla else "graph"
        if not xla:
            return graph
        jit = tf.function(fn, input_signature=input_signature, autograph=False,
                          jit_compile=True)
        return XlaOrGraph(jit, graph, key, modes)

    return decorate


class XlaOrGraph:
    """A step compiled by XLA, or in graph mode for good if XLA fails at its first call
    (see :func:`step_function`); ``modes[key]`` says which."""

    def __init__(self, jit, graph, key: str, modes: Dict[str, str]):
        self.jit, self.graph, self.key, self.modes = jit, graph, key, modes
        self.chosen = None  # the one that ran the first call

    def __call__(self, *args):
        import tensorflow as tf

        if self.chosen is not None:
            return self.chosen(*args)
        try:
            out = self.jit(*args)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError,
                tf.errors.NotFoundError):
            self.chosen = self.graph
            self.modes[self.key] = "graph (XLA could not compile it)"
            return self.graph(*args)
        self.chosen = self.jit
        return out


class FlatLayout:
    """A model's trainable variables in their fixed order, and the flat float32 vector
    over them: variable ``i`` is ``sizes[i]`` values from the sum of the sizes before it."""

    def __init__(self, variables):
        self.variables = list(variables)
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.n_params = int(sum(self.sizes))

    def unflatten(self, flat):
        """A flat tensor as one tensor per variable, in the variables' shapes."""
        import tensorflow as tf

        return [tf.reshape(p, s) for p, s in zip(tf.split(flat, self.sizes), self.shapes)]

    def assign(self, flat) -> None:
        """The variables set from a flat tensor (TensorFlow ops: traced into a step)."""
        for v, part in zip(self.variables, self.unflatten(flat)):
            v.assign(part)


class Steps:
    """One replica's compiled functions; each takes or returns flat float32 vectors in
    ``layout``'s order.

    ``grad``, ``grad_at``, ``apply`` and ``train_step`` are the training steps,
    compiled as :func:`step_function` says (``modes`` records how each runs);
    ``eval_batch`` and ``set_weights`` run in graph mode. ``apply`` and
    ``train_step`` update with ``optimizer`` (Keras'): only a replica that has one
    calls them. :meth:`bucketed` compiles a gradient handed out bucket by bucket.
    """

    def __init__(self, model, layout: FlatLayout, input_shape, from_logits: bool,
                 optimizer, clip_norm: Optional[float], compiler: str,
                 modes: Dict[str, str]):
        import tensorflow as tf
        import keras

        self.model, self.layout, self.optimizer = model, layout, optimizer
        self.from_logits, self.clip_norm, self.modes = from_logits, clip_norm, modes
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
        batch = [tf.TensorSpec((None,) + tuple(input_shape), tf.float32),
                 tf.TensorSpec((None,), tf.int32)]
        flat = [tf.TensorSpec((layout.n_params,), tf.float32)]
        tail_and_scale = [tf.TensorSpec((None,), tf.float32), tf.TensorSpec((), tf.float32)]
        self.batch_spec = batch
        # No autograph: these steps have no Python control flow on tensors, and it
        # never converts a Keras 3 model's call (it stops at Keras' modules; Keras 3
        # layers branch with keras.ops, as they also run under jax.jit). Converting
        # cost CPU in every rank of every launch (docs/architecture.md, "No autograph on
        # the training steps") and left an __autograph_generated_file*.py in the temporary
        # directory per function.
        graph = functools.partial(tf.function, autograph=False)
        # The training steps (not evaluation, whose last batch has another shape) may be
        # compiled by XLA, which fuses their kernels: see step_function.
        step = functools.partial(step_function, xla=compiler == "xla", modes=modes)
        self.grad = step(batch + tail_and_scale, name="grad")(self._grad)
        self.grad_at = step(flat + batch + tail_and_scale, name="grad_at")(self._grad_at)
        # Any length of at least n_params: the fused buffer that grad() returned, status
        # tail and all, goes in as the tensor it is (the tail is sliced off inside), so
        # a large model's gradient is not converted from numpy again (see Replica.apply).
        self.apply = step([tf.TensorSpec((None,), tf.float32)], name="apply")(self._apply)
        self.train_step = step(batch, name="train_step")(self._train_step)
        self.eval_batch = graph(self._eval_batch, input_signature=batch)
        self.set_weights = graph(layout.assign, input_signature=flat)

    # ---- the bodies, traced into the compiled functions above ------------------------
    def loss_and_grads(self, x, y, scale=None):
        """(loss, the per-variable gradients of ``scale`` x the loss) of one batch."""
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self.model(x, training=True))
            # the gradient of scale x loss is scale x the gradient, at the cost
            # of one scalar product instead of a pass over the flat gradient
            scaled = loss if scale is None else loss * scale
        return loss, tape.gradient(scaled, self.layout.variables)

    def flat_grad_and_loss(self, x, y, scale=None, tail=None):
        """(flat gradient with the zeros ``tail`` after it, loss, the gradient's norm)."""
        import tensorflow as tf

        loss, grads = self.loss_and_grads(x, y, scale)
        parts = [tf.reshape(g, [-1]) for g in grads]
        # one concatenation, the caller's zeros included: a second one would copy
        # the whole gradient again (AlexNet: 244 MB a step); zeros leave the norm
        flat = tf.concat(parts + ([] if tail is None else [tail]), 0)
        return flat, loss, tf.norm(flat)  # the norm: non-finite iff the gradient is

    def clipped(self, flat):
        """``flat`` scaled down to the global norm ``clip_norm``, if set and exceeded."""
        import tensorflow as tf

        if not self.clip_norm:
            return flat
        return flat * tf.minimum(1.0, self.clip_norm / (tf.norm(flat) + 1e-12))

    def _update(self, flat) -> None:
        """The Keras optimizer's update with a flat gradient (clipped if configured)."""
        self.optimizer.apply_gradients(zip(self.layout.unflatten(self.clipped(flat)),
                                           self.layout.variables))

    def _grad(self, x, y, tail, scale):
        """(flat gradient of ``scale`` x the loss, ``tail`` after it; loss; norm)."""
        return self.flat_grad_and_loss(x, y, scale, tail)

    def _grad_at(self, flat_weights, x, y, tail, scale):
        """:meth:`_grad` at ``flat_weights``, assigned to the variables first."""
        self.layout.assign(flat_weights)
        return self.flat_grad_and_loss(x, y, scale, tail)

    def _apply(self, fused):
        """The update with the first ``n_params`` values of ``fused``."""
        self._update(fused[:self.layout.n_params])

    def _train_step(self, x, y):
        """Gradient and update of one batch: (loss, the gradient's norm before clipping)."""
        flat, loss, norm = self.flat_grad_and_loss(x, y)
        self._update(flat)
        return loss, norm

    def _eval_batch(self, x, y):
        """(summed loss, number correct) of one batch, in inference mode."""
        import tensorflow as tf
        import keras

        logits = self.model(x, training=False)
        losses = keras.losses.sparse_categorical_crossentropy(y, logits,
                                                              from_logits=self.from_logits)
        correct = tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), y)
        return tf.reduce_sum(losses), tf.reduce_sum(tf.cast(correct, tf.int32))

    # ---- the gradient in buckets ------------------------------------------------------
    def bucketed(self, hand_offs: Sequence[Tuple[List[int], Callable]]):
        """``fn(x, y, scale) -> (loss, norm)``, compiled in graph mode: the gradient
        handed out as :meth:`grad_in_buckets` says (``hand_offs``: :func:`bucket_hand_offs`)."""
        import tensorflow as tf

        fn = tf.function(lambda x, y, scale: self.grad_in_buckets(x, y, scale, hand_offs),
                         input_signature=self.batch_spec + [tf.TensorSpec((), tf.float32)],
                         autograph=False)
        self.modes["grad_in_buckets"] = "graph"
        return fn

    def grad_in_buckets(self, x, y, scale, hand_offs):
        """The gradient handed out bucket by bucket as back-propagation produces it:
        ``hand_offs`` is [(variable indices, callback)], each callback a stateful
        ``numpy_function`` that runs as soon as its variables' gradients exist."""
        import tensorflow as tf

        loss, grads = self.loss_and_grads(x, y, scale)
        for indices, hand_off in hand_offs:
            tf.numpy_function(hand_off, [grads[i] for i in indices], tf.int32,
                              stateful=True, name="mpitrain_bucket")
        # the norm only flags a non-finite gradient: per-variable sums will do
        squares = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
        return loss, tf.sqrt(squares)


def bucket_hand_offs(view: np.ndarray, sizes, bounds: List[Tuple[int, int]],
                     on_ready: Callable[[int], None]) -> List[Tuple[List[int], "HandOff"]]:
    """[(variable indices, :class:`HandOff`)] of each bucket ``(lo, hi)`` of ``bounds``
    (variables of ``sizes``): the variables that start in it, whose gradients its
    hand-off copies into ``view`` from ``lo`` on."""
    starts = np.cumsum([0] + list(sizes))
    return [([i for i in range(len(sizes)) if lo <= starts[i] < hi],
             HandOff(view, lo, b, on_ready)) for b, (lo, hi) in enumerate(bounds)]


class HandOff:
    """One bucket's callback, run by TensorFlow (a ``numpy_function``) once its
    variables' gradients exist: they are copied into ``view`` from offset ``lo``, in
    order, then ``on_ready(bucket)`` is told."""

    def __init__(self, view: np.ndarray, lo: int, bucket: int,
                 on_ready: Callable[[int], None]):
        self.view, self.lo, self.bucket, self.on_ready = view, lo, bucket, on_ready

    def __call__(self, *grads) -> np.int32:
        offset = self.lo
        for g in grads:
            self.view[offset:offset + g.size] = g.reshape(-1)
            offset += g.size
        self.on_ready(self.bucket)
        return np.int32(0)


def fused_buffer(n: int, out: Optional[np.ndarray] = None):
    """A float32 tensor of ``n`` values that numpy writes into (``._numpy()``): ``out``'s
    memory (zeroed, 64-byte aligned) if TensorFlow takes it without a copy, else a
    fresh one of zeros, ours alone."""
    import tensorflow as tf

    fused = None if out is None else as_tensor(out)
    if out is None or fused is None or fused._numpy().ctypes.data != out.ctypes.data:
        fused = tf.fill([n], np.float32(0))
    return fused


def aligned_empty(n: int) -> np.ndarray:
    """``n`` float32 at a 64-byte aligned address (what TensorFlow needs to take memory
    through DLPack)."""
    raw = np.empty(n + 16, np.float32)
    start = (-raw.ctypes.data % 64) // raw.itemsize
    return raw[start:start + n]


def as_tensor(flat: np.ndarray):
    """A TensorFlow tensor on ``flat``'s memory, without a copy (DLPack)."""
    import tensorflow as tf

    return tf.experimental.dlpack.from_dlpack(flat.__dlpack__())
