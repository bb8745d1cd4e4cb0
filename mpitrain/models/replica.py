"""One replica of a model: the TensorFlow side of training, independent of MPI.

A :class:`Replica` holds a Keras model from the registry and its optimizer, and
exposes the model's trainable weights and gradients as ONE contiguous float32
vector, in a fixed variable order that is the same on every rank. That vector is
what the communication layer moves: one fused buffer, one allreduce, one message.

Cross-rank contract: replicas built from the same spec, given the same initial
flat weights (:meth:`set_weights`) and then the same sequence of flat gradients
(:meth:`apply`), hold bit-identical weights: every update is elementwise and
deterministic on CPU. :func:`checksum` lets ranks verify it.

State that is not trained comes in two kinds, kept apart from the weights:
*buffers*, the float variables a model updates itself in training (BatchNorm's
moving mean and variance), exposed as one flat float32 vector
(:meth:`buffers`); and random-generator state (Dropout's seeds, ints:
:meth:`rng_state`). Buffers follow each replica's own batches, so replicas'
buffers differ between the points where the trainers average them; the
*state* vector (:meth:`state`: weights, then buffers) is what a model is
evaluated, checkpointed and compared with.

Only ranks that apply updates (sync workers, the single rank) build the
optimizer and its slots (``applies=True``); the sync server and every async rank
(the async server updates with :mod:`mpitrain.models.optim`) never do. The
optimizer is Keras' under ``compiler='graph'`` and ``'xla'``; under ``'auto'`` (the
default) it is :mod:`mpitrain.models.optim`'s fused C pass over a flat copy of the
weights, assigned to the variables at the start of the next gradient call (see
:meth:`Replica.apply`). Both keep the same formulas, and a checkpoint's optimizer
state converts between their layouts (:func:`mpitrain.models.optim.adapt_state`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..errors import UsageError
from . import optim
from .keras_import import import_keras

EVAL_BATCH = 2000


def init_tensorflow(intra_threads: int, seed: int) -> None:
    """Quiet TensorFlow's logs and set its thread pools; call before any TF op.

    Threads are set per rank because ranks share a host's cores: TensorFlow's
    default (one thread per core in every process) oversubscribes the CPU as
    soon as two ranks share a host.
    """
    keras = import_keras()
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra_threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # TensorFlow already ran an op in this process (a test, a script
        pass              # that built a model first): its pools are fixed by now
    keras.utils.set_random_seed(seed)


def checksum(flat: np.ndarray) -> int:
    """CRC-32 of a flat weight vector's bytes: equal iff replicas are (almost surely) identical."""
    return zlib.crc32(memoryview(np.ascontiguousarray(flat)).cast("B"))


def ends_in_softmax(model, input_shape) -> bool:
    """True if ``model`` outputs probabilities: on a probe batch of random inputs every
    row of its output is non-negative and sums to 1, as a softmax's does wherever it
    sits (a last Softmax layer or activation, a nested model's head, ``tf.nn.softmax``
    or ``keras.ops.softmax`` in a functional model). Logits practically never do."""
    probe = np.random.default_rng(0).random((2,) + tuple(input_shape), dtype=np.float32)
    out = np.asarray(model(probe, training=False), np.float64)
    return (out.ndim == 2 and out.shape[1] > 1 and bool((out >= 0).all())
            and bool(np.allclose(out.sum(axis=1), 1.0, rtol=0, atol=1e-3)))


def check_outputs(model, name: str, from_logits: bool, input_shape) -> None:
    """UsageError if the loss would take ``model``'s softmax probabilities for logits."""
    if from_logits and ends_in_softmax(model, input_shape):
        raise UsageError(f"model {name} ends in a softmax: pass --outputs probabilities, or "
                         "drop the softmax and output logits (more stable in float32); its "
                         "outputs are probabilities (every row sums to 1)")


def make_optimizer(name: str, lr: float, schedule: Optional[optim.Schedule] = None):
    """A Keras optimizer; with ``schedule``, its learning rate follows it."""
    import keras

    if schedule is not None and not schedule.constant:
        lr = keras_schedule(lr, schedule)
    if name == "sgd":
        return keras.optimizers.SGD(lr)
    if name == "momentum":
        return keras.optimizers.SGD(lr, momentum=0.9)
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


def step_function(input_signature, xla: bool, modes: Dict[str, str]):
    """A decorator: the function as a ``tf.function``, compiled by XLA if ``xla``.

    XLA fuses a step's elementwise work into few kernels, faster than graph mode
    with Eigen's kernels; but it runs its own kernels, not oneDNN's, so against graph
    mode with oneDNN (the default, see mpitrain/__init__.py) a convolutional model's
    gradient takes longer. It compiles for every batch shape (the epoch's short last
    batch is a second one), several times as long as tracing, so it pays off on long
    runs only (docs/architecture.md, "XLA only on request"). A model XLA cannot
    compile (an op it does not support, such as a ``tf.py_function``) fails at
    that first call, before anything ran; the function then falls back to graph
    mode for good. ``modes[name]`` says which the function runs in: 'graph',
    'xla', or 'graph (XLA could not compile it)'. Every rank runs the same model
    on the same software, so all ranks fall back, or none.
    """
    import tensorflow as tf

    def decorate(fn):
        graph = tf.function(fn, input_signature=input_signature, autograph=False)
        modes[fn.__name__] = "xla" if xla else "graph"
        if not xla:
            return graph
        jit = tf.function(fn, input_signature=input_signature, autograph=False,
                          jit_compile=True)
        chosen = []

        def call(*args):
            if chosen:
                return chosen[0](*args)
            try:
                out = jit(*args)
            except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError,
                    tf.errors.NotFoundError):
                chosen.append(graph)
                modes[fn.__name__] = "graph (XLA could not compile it)"
                return graph(*args)
            chosen.append(jit)
            return out

        return call

    return decorate


def bucket_bounds(sizes, bucket_bytes: float) -> List[Tuple[int, int]]:
    """A flat float32 vector of variables of ``sizes`` cut into buckets of whole
    variables, ``[(lo, hi), ...]`` in the order back-propagation produces them (last
    variable first): each bucket is the fewest variables that make ``bucket_bytes``,
    the last bucket whatever remains. The same on every rank for the same model."""
    offsets = np.cumsum([0] + list(sizes))
    bounds, hi = [], int(offsets[-1])
    for i in reversed(range(len(sizes))):
        if 4 * (hi - offsets[i]) >= bucket_bytes:
            bounds.append((int(offsets[i]), hi))
            hi = int(offsets[i])
    if hi > 0:
        bounds.append((0, hi))
    return bounds


class Replica:
    """A model, its optimizer, and compiled step functions over flat float32 vectors.

    Why one class of this size (over the ~250 lines we hold classes to; the module is
    over ~500 for it): the compiled steps close over the model's variables, the
    optimizer's slots and the flat buffers, in the one variable order that makes the
    flat vector the same on every rank. They are built together and must change
    together; a separate step builder would take every one of them as arguments.
    The functions around it (thread set-up, the output checks, step compilation,
    buckets) are small and used with it.
    """

    def __init__(self, spec, input_shape, num_classes: int, optimizer: str, lr: float,
                 clip_norm: Optional[float] = None, schedule: Optional[optim.Schedule] = None,
                 from_logits: bool = True, applies: bool = True, compiler: str = "graph"):
        import tensorflow as tf
        import keras

        #: how each training step function runs: 'graph' or 'xla' (see step_function)
        self.compiled: Dict[str, str] = {}
        self.model = spec.build(tuple(input_shape), num_classes)
        check_outputs(self.model, spec.name, from_logits, input_shape)
        self.variables = list(self.model.trainable_variables)
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.n_params = int(sum(self.sizes))
        # Only a rank that applies updates needs the optimizer and its slots (sync
        # workers, the single rank): the sync server and every async rank would hold
        # them for nothing (AlexNet's momentum: 244 MB per rank).
        self.applies = applies
        self._optimizer_name, self._lr = optimizer, lr  # (for adapt_optimizer_state)
        # --compile auto: the flat optimizer (one fused pass in C; Keras' update is a
        # dispatch and a temporary per operation, in graph mode; docs/architecture.md,
        # "Flat optimizers in C"). XLA fuses Keras' update itself, so --compile xla keeps it.
        flat = applies and compiler == "auto"
        #: the flat optimizer (--compile auto), else None: Keras' optimizer updates
        self.flat_optimizer = optim.make(optimizer, self.n_params, lr, schedule,
                                         clip_norm) if flat else None
        self._flat_weights: Optional[np.ndarray] = None  # its copy of the weights, if current
        self._flat_tensor = None  # TensorFlow's view of that copy
        self._assign_pending = False  # the variables lag the copy by its last update
        self.optimizer = make_optimizer(optimizer, lr, schedule) \
            if applies and not flat else None
        if self.optimizer is not None:
            self.optimizer.build(self.variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
        batch_spec = [tf.TensorSpec((None,) + tuple(input_shape), tf.float32),
                      tf.TensorSpec((None,), tf.int32)]
        flat_spec = [tf.TensorSpec((self.n_params,), tf.float32)]
        model, variables, sizes, shapes = self.model, self.variables, self.sizes, self.shapes
        # No autograph: these steps have no Python control flow on tensors, and it
        # never converts a Keras 3 model's call (it stops at Keras' modules; Keras 3
        # layers branch with keras.ops, as they also run under jax.jit). Converting
        # cost CPU in every rank of every launch (docs/architecture.md, "No autograph on
        # the training steps") and left an
        # __autograph_generated_file*.py in the temporary directory per function.
        compiled = functools.partial(tf.function, autograph=False)
        # The training steps (not evaluation, whose last batch has another shape) may be
        # compiled by XLA, which fuses their kernels: see step_function.
        xla = compiler == "xla"
        step = functools.partial(step_function, xla=xla, modes=self.compiled)
        update = functools.partial(step_function, xla=xla, modes=self.compiled)

        def loss_and_grads(x, y, scale=None):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                # the gradient of scale x loss is scale x the gradient, at the cost
                # of one scalar product instead of a pass over the flat gradient
                scaled = loss if scale is None else loss * scale
            return loss, tape.gradient(scaled, variables)

        def flat_grad_and_loss(x, y, scale=None, tail=None):
            loss, grads = loss_and_grads(x, y, scale)
            parts = [tf.reshape(g, [-1]) for g in grads]
            # one concatenation, the caller's zeros included: a second one would copy
            # the whole gradient again (AlexNet: 244 MB a step); zeros leave the norm
            flat = tf.concat(parts + ([] if tail is None else [tail]), 0)
            return flat, loss, tf.norm(flat)  # the norm: non-finite iff the gradient is

        def unflatten(flat):
            return [tf.reshape(p, s) for p, s in zip(tf.split(flat, sizes), shapes)]

        def clipped(flat):
            if not clip_norm:
                return flat
            return flat * tf.minimum(1.0, clip_norm / (tf.norm(flat) + 1e-12))

        @step(input_signature=batch_spec + [tf.TensorSpec((None,), tf.float32),
                                            tf.TensorSpec((), tf.float32)])
        def grad(x, y, tail, scale):
            return flat_grad_and_loss(x, y, scale, tail)

        @step(input_signature=flat_spec + batch_spec + [tf.TensorSpec((None,), tf.float32),
                                                        tf.TensorSpec((), tf.float32)])
        def grad_at(flat_weights, x, y, tail, scale):
            for v, part in zip(variables, unflatten(flat_weights)):
                v.assign(part)
            return flat_grad_and_loss(x, y, scale, tail)

        n_params = self.n_params

        # Any length of at least n_params: the fused buffer that grad() returned, status
        # tail and all, goes in as the tensor it is (the tail is sliced off inside), so
        # a large model's gradient is not converted from numpy again (see apply()).
        @update(input_signature=[tf.TensorSpec((None,), tf.float32)])
        def apply(fused):
            flat = fused[:n_params]
            self.optimizer.apply_gradients(zip(unflatten(clipped(flat)), variables))

        @step(input_signature=batch_spec)
        def train_step(x, y):
            flat, loss, norm = flat_grad_and_loss(x, y)
            self.optimizer.apply_gradients(zip(unflatten(clipped(flat)), variables))
            return loss, norm

        @compiled(input_signature=batch_spec)
        def eval_batch(x, y):
            logits = model(x, training=False)
            losses = keras.losses.sparse_categorical_crossentropy(y, logits,
                                                                  from_logits=from_logits)
            correct = tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), y)
            return tf.reduce_sum(losses), tf.reduce_sum(tf.cast(correct, tf.int32))

        @compiled(input_signature=flat_spec)
        def set_weights(flat):
            for v, part in zip(variables, unflatten(flat)):
                v.assign(part)

        def grad_in_buckets(x, y, scale, hand_offs):
            """The gradient handed out bucket by bucket as back-propagation produces it:
            ``hand_offs`` is [(variable indices, callback)], each callback a stateful
            ``numpy_function`` that runs as soon as its variables' gradients exist."""
            loss, grads = loss_and_grads(x, y, scale)
            for indices, hand_off in hand_offs:
                tf.numpy_function(hand_off, [grads[i] for i in indices], tf.int32,
                                  stateful=True, name="mpitrain_bucket")
            # the norm only flags a non-finite gradient: per-variable sums will do
            squares = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
            return loss, tf.sqrt(squares)

        self._grad_in_buckets_fn, self._batch_spec = grad_in_buckets, batch_spec
        self._grad, self._grad_at, self._apply, self._train_step = grad, grad_at, apply, train_step
        self._eval_batch, self._set_weights = eval_batch, set_weights
        if self.flat_optimizer is not None:
            self.compiled.update(apply="flat", train_step="graph, flat update")
        self._tail = None
        self._fused, self._fused_view = None, None  # grad()'s last output (see _keep)
        trainable = {id(v) for v in self.variables}
        untrained = [v for v in self.model.variables if id(v) not in trainable]
        self._buffer_variables = [v for v in untrained if "float" in str(v.dtype)]
        self._rng_variables = [v for v in untrained if "float" not in str(v.dtype)]
        self.n_buffers = int(sum(np.prod(v.shape) for v in self._buffer_variables))

    # ---- training -------------------------------------------------------------------
    def grad(self, x: np.ndarray, y: np.ndarray, tail: int = 0,
             scale: float = 1.0) -> Tuple[np.ndarray, float, float]:
        """(``scale`` x the flat gradient + ``tail`` zeros as one writable float32 array,
        loss, the norm of that scaled gradient).

        The zeros give the caller room for a few status values that travel in
        the same allreduce as the gradient, at no extra message. ``scale`` (a sync
        worker's 1 / workers) is applied to the loss before differentiation: free,
        where scaling the gradient after it is a pass over every parameter. After a
        flat update (:meth:`apply`), the same call assigns the updated weights first."""
        tail, scale = self._zeros(tail), np.float32(scale)
        if self.flat_optimizer is None:
            flat, loss, norm = self._grad(x, y, tail, scale)
        else:  # always the one function (a second would be traced too: seconds, once)
            self._assign_pending = False
            flat, loss, norm = self._grad_at(self._flat_copy(), x, y, tail, scale)
        return self._keep(flat), float(loss), float(norm)

    def gradient_buckets(self, bucket_bytes: float) -> List[Tuple[int, int]]:
        """This model's flat gradient in buckets: see :func:`bucket_bounds`."""
        return bucket_bounds(self.sizes, bucket_bytes)

    def bucketed_grad(self, bounds: List[Tuple[int, int]], tail: int,
                      on_ready: Callable[[int], None], out: Optional[np.ndarray] = None):
        """A gradient step that fills ONE persistent fused buffer (``n_params + tail``
        float32, the tail zeros the caller's) bucket by bucket while back-propagation
        runs, calling ``on_ready(b)`` (from a TensorFlow thread) as soon as bucket ``b``
        of ``bounds`` (:meth:`gradient_buckets`) is in it.

        Returns ``(grad, buffer)``: ``grad(x, y, scale) -> (buffer, loss, norm)``, like
        :meth:`grad`, always the same buffer, which :meth:`apply` hands TensorFlow as
        the tensor behind it, without a copy. Each gradient is copied once, into its
        place in the buffer, as :meth:`grad`'s one concatenation does.

        ``out``: the buffer to fill instead of a fresh one (zeroed float32 of that
        length, 64-byte aligned: TensorFlow takes it through DLPack, without a copy;
        where it would copy, a fresh buffer is filled instead)."""
        import tensorflow as tf

        fused = None if out is None else _as_tensor(out)
        if fused is None or fused._numpy().ctypes.data != out.ctypes.data:  # noqa: SLF001
            fused = tf.fill([self.n_params + tail], np.float32(0))  # a fresh one, ours alone
        view = fused._numpy()  # noqa: SLF001 - writable, no copy (see _keep)
        starts = np.cumsum([0] + self.sizes)
        hand_offs = []
        for b, (lo, hi) in enumerate(bounds):
            indices = [i for i in range(len(self.sizes)) if lo <= starts[i] < hi]

            def hand_off(*grads, b=b, lo=lo):
                offset = lo
                for g in grads:
                    view[offset:offset + g.size] = g.reshape(-1)
                    offset += g.size
                on_ready(b)
                return np.int32(0)

            hand_offs.append((indices, hand_off))
        fn = tf.function(lambda x, y, scale: self._grad_in_buckets_fn(x, y, scale, hand_offs),
                         input_signature=self._batch_spec + [tf.TensorSpec((), tf.float32)],
                         autograph=False)
        self.compiled["grad_in_buckets"] = "graph"

        def grad(x: np.ndarray, y: np.ndarray, scale: float) -> Tuple[np.ndarray, float, float]:
            self._assign_updated_weights()
            view[self.n_params:] = 0.0
            loss, norm = fn(x, y, np.float32(scale))
            self._fused, self._fused_view = fused, view
            return view, float(loss), float(norm)

        return grad, view

    def _keep(self, flat) -> np.ndarray:
        """A writable numpy view of the output tensor ``flat``, no copy (``.numpy()``
        copies, a large model's in tens of milliseconds). The tensor is kept, so that
        :meth:`apply` of this buffer hands it back to TensorFlow as it is instead of
        converting the array (another copy; docs/architecture.md, "The fused gradient
        kept as a tensor"). A
        function's output is a fresh buffer that TensorFlow holds nowhere else."""
        self._fused = flat
        self._fused_view = view = flat._numpy()  # noqa: SLF001 - documented above
        return view

    def _zeros(self, n: int) -> np.ndarray:
        if self._tail is None or len(self._tail) != n:
            self._tail = np.zeros(n, np.float32)
        return self._tail

    def grad_at(self, flat_weights: np.ndarray, x: np.ndarray,
                y: np.ndarray) -> Tuple[np.ndarray, float, float]:
        """Load ``flat_weights`` and return (flat gradient, loss, norm) of one batch, in one call.

        The async worker's step: weights arrive from the server every step, and
        assigning them inside the same compiled call saves a TensorFlow dispatch.
        """
        self._flat_weights, self._assign_pending = None, False  # superseded
        flat, loss, norm = self._grad_at(flat_weights, x, y, self._zeros(0), np.float32(1))
        return self._keep(flat), float(loss), float(norm)

    def apply(self, flat_grad: np.ndarray) -> None:
        """Apply one flat gradient with the optimizer (one update; clipped if configured).

        ``flat_grad`` may be the array :meth:`grad` returned, or its first
        ``n_params`` values, changed in place (the allreduce sums into it): that
        buffer goes to TensorFlow without a copy. The flat optimizer (``compiler=
        'auto'``) clips ``flat_grad`` in place and updates its copy of the weights
        only: the variables get it at the start of the next :meth:`grad`, inside that
        call (a separate assignment would cost a dispatch per step, more than LeNet's
        whole update), or before anything else reads them."""
        self._applying()
        if self.flat_optimizer is not None:
            self._apply_flat(flat_grad[:self.n_params])
            return
        view = self._fused_view
        if (view is not None and flat_grad.ctypes.data == view.ctypes.data
                and self.n_params <= flat_grad.size <= view.size):
            self._apply(self._fused)
        else:
            self._apply(flat_grad)

    def _apply_flat(self, grad: np.ndarray) -> None:
        """The flat optimizer's update of its copy of the weights; the variables are
        assigned from that copy later (handed to TensorFlow through DLPack: no
        conversion), see :meth:`apply`."""
        self._flat_copy()
        self.flat_optimizer.step(self._flat_weights, grad)
        self._assign_pending = True

    def _flat_copy(self):
        """TensorFlow's view of the flat optimizer's copy of the weights, made from the
        variables if there is none (the first step, or the weights were set since)."""
        if self._flat_weights is None:
            self._flat_weights = self.weights(out=_aligned_empty(self.n_params))
            self._flat_tensor = _as_tensor(self._flat_weights)
        return self._flat_tensor

    def _assign_updated_weights(self) -> None:
        """The variables brought up to the flat copy, if an update is not in them yet."""
        if self._assign_pending:
            self._assign_pending = False
            self._set_weights(self._flat_tensor)

    def _applying(self) -> None:
        if not self.applies:
            raise RuntimeError("this replica was built with applies=False: it has no optimizer")

    def train_step(self, x: np.ndarray, y: np.ndarray) -> Tuple[float, float]:
        """Gradient and update in one compiled call (one worker: nothing to average).

        Returns (loss, gradient norm before clipping). With the flat optimizer: the
        gradient, then :meth:`apply`."""
        self._applying()
        if self.flat_optimizer is not None:
            grad, loss, norm = self.grad(x, y)
            self.apply(grad)
            return loss, norm
        loss, norm = self._train_step(x, y)
        return float(loss), float(norm)

    # ---- state for checkpoints ------------------------------------------------------
    def optimizer_state(self, copy: bool = True) -> Dict[str, np.ndarray]:
        """The optimizer's variables (step count, slots), in their fixed order: o0, o1...
        ``copy=False``: the flat optimizer's slots themselves, for a caller that copies
        them at once (Keras' variables always come out as copies)."""
        values = self._state_values(copy=copy or self.flat_optimizer is None)
        return {f"o{i}": np.asarray(value) for i, value in enumerate(values)}

    def optimizer_layout(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """{name: (shape, dtype)} of :meth:`optimizer_state`, without copying any value."""
        return {f"o{i}": (tuple(int(d) for d in v.shape), np.dtype(v.dtype).name)
                for i, v in enumerate(self._state_values(copy=False))}

    def set_optimizer_state(self, state: Dict[str, np.ndarray]) -> None:
        expected = len(self._state_values(copy=False))
        if len(state) != expected:
            raise ValueError(f"optimizer state has {len(state)} variables, expected {expected}")
        if self.flat_optimizer is not None:
            names = ["iterations", *self.flat_optimizer.slots()]
            self.flat_optimizer.load_state({name: state[f"o{i}"] for i, name in enumerate(names)})
            return
        for i, v in enumerate(self.optimizer.variables):
            v.assign(state[f"o{i}"])

    def adapt_optimizer_state(self, saved: Dict[str, np.ndarray],
                              layout: Dict[str, Tuple[Tuple[int, ...], str]]
                              ) -> Dict[str, np.ndarray]:
        """A checkpoint's optimizer state (``saved``) in the form of ``layout`` (an
        :meth:`optimizer_layout`, of this replica or of a rank that applies updates):
        Keras' and the flat optimizer's hold the same numbers in different layouts
        (:func:`mpitrain.models.optim.adapt_state`). Any rank can call it."""
        return optim.adapt_state(saved, layout, self._optimizer_name, self.sizes, self._lr)

    def _state_values(self, copy: bool = True) -> list:
        """The optimizer's state in its order: Keras' variables, or the flat optimizer's
        update count and slots (copies, unless ``copy`` is False: for their layout)."""
        self._applying()
        if self.flat_optimizer is None:
            return [v.numpy() if copy else v for v in self.optimizer.variables]
        slots = self.flat_optimizer.slots()
        return [np.array(self.flat_optimizer.iterations, np.int64),
                *(slot.copy() if copy else slot for slot in slots.values())]

    def rng_state(self) -> np.ndarray:
        """The model's random-generator state (dropout seeds), flattened; empty for most."""
        parts = [v.numpy().ravel().astype(np.int64) for v in self._rng_variables]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def set_rng_state(self, state: np.ndarray) -> None:
        offset = 0
        for v in self._rng_variables:
            n = int(np.prod(v.shape))
            v.assign(state[offset:offset + n].reshape(v.shape).astype(v.dtype))
            offset += n

    # ---- buffers (BatchNorm statistics) and the whole state --------------------------
    def buffers(self) -> np.ndarray:
        """A flat float32 copy of the float non-trainable variables (empty for most models)."""
        parts = [np.asarray(v.numpy(), np.float32).reshape(-1) for v in self._buffer_variables]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def set_buffers(self, flat: np.ndarray) -> None:
        """Overwrite the buffers from a flat vector (inverse of :meth:`buffers`)."""
        if flat.shape != (self.n_buffers,):
            raise ValueError(f"expected {self.n_buffers} buffer values, got {flat.shape}")
        offset = 0
        for v in self._buffer_variables:
            n = int(np.prod(v.shape))
            v.assign(flat[offset:offset + n].reshape(v.shape))
            offset += n

    @property
    def n_state(self) -> int:
        return self.n_params + self.n_buffers

    def state(self) -> np.ndarray:
        """Weights then buffers, one float32 vector: what is evaluated and checkpointed."""
        if not self.n_buffers:
            return self.weights()
        return np.concatenate([self.weights(), self.buffers()])

    def set_state(self, flat: np.ndarray) -> None:
        """Inverse of :meth:`state`."""
        self.set_weights(flat[:self.n_params])
        if self.n_buffers:
            self.set_buffers(flat[self.n_params:])

    # ---- weights --------------------------------------------------------------------
    def weights(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """A flat float32 copy of the trainable weights, in the fixed variable order
        (written into ``out`` if given)."""
        if self._flat_weights is not None:  # the flat optimizer's copy is current
            if out is None:
                return self._flat_weights.copy()
            np.copyto(out, self._flat_weights)
            return out
        return np.concatenate([v.numpy().reshape(-1) for v in self.variables], out=out)

    def set_weights(self, flat: np.ndarray) -> None:
        """Overwrite the trainable weights from a flat vector (inverse of :meth:`weights`)."""
        if flat.shape != (self.n_params,):
            raise ValueError(f"expected {self.n_params} weights, got {flat.shape}")
        self._set_weights(flat)
        self._flat_weights, self._assign_pending = None, False  # the flat copy is stale

    # ---- evaluation -----------------------------------------------------------------
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> Tuple[float, float]:
        """(mean loss, accuracy) over ``x, y``."""
        self._assign_updated_weights()
        loss_sum, correct = 0.0, 0
        for start in range(0, len(y), EVAL_BATCH):
            batch_loss, batch_correct = self._eval_batch(x[start:start + EVAL_BATCH],
                                                         y[start:start + EVAL_BATCH])
            loss_sum += float(batch_loss)
            correct += int(batch_correct)
        return loss_sum / len(y), correct / len(y)


def _aligned_empty(n: int) -> np.ndarray:
    """``n`` float32 at a 64-byte aligned address (what TensorFlow needs to take memory
    through DLPack)."""
    raw = np.empty(n + 16, np.float32)
    start = (-raw.ctypes.data % 64) // raw.itemsize
    return raw[start:start + n]


def _as_tensor(flat: np.ndarray):
    """A TensorFlow tensor on ``flat``'s memory, without a copy (DLPack)."""
    import tensorflow as tf

    return tf.experimental.dlpack.from_dlpack(flat.__dlpack__())
