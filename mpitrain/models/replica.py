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

The TensorFlow functions a replica runs (compiled once: gradient, update, evaluation),
and the Keras optimizer, are :mod:`mpitrain.models.steps`'; this module is the numpy
side: the flat vectors, the flat optimizer's copy of the weights, the state.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..errors import UsageError
from . import optim
from .keras_import import import_keras
from .steps import (FlatLayout, Steps, aligned_empty, as_tensor, bucket_hand_offs,
                    fused_buffer, make_optimizer)

EVAL_BATCH = 2000


def init_tensorflow(intra_threads: int, seed: int) -> None:
    """Quiet TensorFlow's logs and set its thread pools; call before any TF op.

    Threads are set per rank because ranks share a host's cores: TensorFlow's
    default (one thread per core in every process) oversubscribes the CPU as
    soon as two ranks share a host.
    """
    keras = import_keras()
    set_tensorflow_threads(intra_threads)
    keras.utils.set_random_seed(seed)


def set_tensorflow_threads(intra_threads: int) -> None:
    """TensorFlow's intra-op pool of ``intra_threads`` and one inter-op thread (the ops of
    a step run one after another; the cores go to each op's own threads)."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra_threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # TensorFlow already ran an op in this process (a test, a script
        pass              # that built a model first): its pools are fixed by now


def checksum(flat: np.ndarray) -> int:
    """CRC-32 of a flat weight vector's bytes: equal iff replicas are (almost surely) identical."""
    return zlib.crc32(np.ascontiguousarray(flat).data.cast("B"))


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


def build_optimizers(name: str, lr: float, schedule: Optional[optim.Schedule],
                     clip_norm: Optional[float], layout: FlatLayout, applies: bool,
                     compiler: str) -> Tuple[Optional[optim.FlatOptimizer], Optional[Any]]:
    """(flat optimizer, Keras optimizer) of a replica, at most one of them not None.

    Only a rank that applies updates (``applies``: sync workers, the single rank)
    gets one: the sync server and every async rank would hold its slots for nothing
    (AlexNet's momentum: 244 MB per rank). ``compiler='auto'`` gives the flat
    optimizer (one fused pass in C; Keras' update is a dispatch and a temporary per
    operation, in graph mode; docs/architecture.md, "Flat optimizers in C"); XLA fuses
    Keras' update itself, so 'xla' keeps Keras', as 'graph' does. Keras' is built
    over ``layout``'s variables at once, its slots in their order."""
    flat = applies and compiler == "auto"
    flat_optimizer = optim.make(name, layout.n_params, lr, schedule, clip_norm) \
        if flat else None
    keras_optimizer = make_optimizer(name, lr, schedule) if applies and not flat else None
    if keras_optimizer is not None:
        keras_optimizer.build(layout.variables)
    return flat_optimizer, keras_optimizer


def untrained_variables(model, trainable) -> Tuple[list, list]:
    """(buffers, random-generator state): ``model``'s variables outside ``trainable``,
    the float ones (BatchNorm's statistics) and the others (Dropout's seeds)."""
    ids = {id(v) for v in trainable}
    untrained = [v for v in model.variables if id(v) not in ids]
    return ([v for v in untrained if "float" in str(v.dtype)],
            [v for v in untrained if "float" not in str(v.dtype)])


class Replica:
    """A model, its optimizer, and compiled step functions over flat float32 vectors.

    Why one class of this size (over the ~250 lines we hold classes to): its methods
    share two pieces of state that every read or write of the weights must honour.
    Under the flat optimizer (``compiler='auto'``) the variables lag its copy of the
    weights until the next gradient call assigns it, so :meth:`weights`,
    :meth:`set_weights`, :meth:`grad`, :meth:`grad_at` and :meth:`evaluate` each deal
    with that copy; and :meth:`apply` hands TensorFlow back the gradient tensor the
    last gradient call kept (:meth:`_keep`). Split, each part would reach into the
    other's state. The compiled TensorFlow functions themselves
    are a :class:`mpitrain.models.steps.Steps`, built here from named pieces.
    """

    def __init__(self, spec, input_shape, num_classes: int, optimizer: str, lr: float,
                 clip_norm: Optional[float] = None, schedule: Optional[optim.Schedule] = None,
                 from_logits: bool = True, applies: bool = True, compiler: str = "auto"):
        # compiler: --compile's default (tests/unit/test_replica.py holds them equal), so
        # that code and tests that build a replica directly run the path users get
        #: how each training step function runs: 'graph' or 'xla' (see
        #: :func:`mpitrain.models.steps.step_function`)
        self.compiled: Dict[str, str] = {}
        self.model = spec.build(tuple(input_shape), num_classes)
        check_outputs(self.model, spec.name, from_logits, input_shape)
        layout = FlatLayout(self.model.trainable_variables)
        self.variables, self.shapes, self.sizes = layout.variables, layout.shapes, layout.sizes
        self.n_params = layout.n_params
        self.applies = applies
        self._optimizer_name, self._lr = optimizer, lr  # (for adapt_optimizer_state)
        #: the flat optimizer (--compile auto), else None: Keras' optimizer updates
        self.flat_optimizer, self.optimizer = build_optimizers(
            optimizer, lr, schedule, clip_norm, layout, applies, compiler)
        self._steps = Steps(self.model, layout, input_shape, from_logits, self.optimizer,
                            clip_norm, compiler, self.compiled)
        if self.flat_optimizer is not None:
            self.compiled.update(apply="flat", train_step="graph, flat update")
        self._flat_weights: Optional[np.ndarray] = None  # its copy of the weights, if current
        self._flat_tensor = None  # TensorFlow's view of that copy
        self._assign_pending = False  # the variables lag the copy by its last update
        self._tail: Optional[np.ndarray] = None
        self._fused = None  # grad()'s last output (see _keep), and numpy's view of it
        self._fused_view: Optional[np.ndarray] = None
        self._buffer_variables, self._rng_variables = untrained_variables(self.model,
                                                                          self.variables)
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
        zeros, scale = self._zeros(tail), np.float32(scale)
        if self.flat_optimizer is None:
            flat, loss, norm = self._steps.grad(x, y, zeros, scale)
        else:  # always the one function (a second would be traced too: seconds, once)
            self._assign_pending = False
            flat, loss, norm = self._steps.grad_at(self._flat_copy(), x, y, zeros, scale)
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
        fused = fused_buffer(self.n_params + tail, out)
        view = fused._numpy()  # noqa: SLF001 - writable, no copy (see _keep)
        fn = self._steps.bucketed(bucket_hand_offs(view, self.sizes, bounds, on_ready))
        return functools.partial(self._bucketed_step, fn, fused, view), view

    def _bucketed_step(self, fn, fused, view: np.ndarray, x: np.ndarray, y: np.ndarray,
                       scale: float) -> Tuple[np.ndarray, float, float]:
        """One call of :meth:`bucketed_grad`'s ``grad``: ``fn``
        (:meth:`mpitrain.models.steps.Steps.bucketed`) fills ``view``, ``fused``'s memory."""
        self._assign_updated_weights()
        view[self.n_params:] = 0.0
        loss, norm = fn(x, y, np.float32(scale))
        self._fused, self._fused_view = fused, view
        return view, float(loss), float(norm)

    def _keep(self, flat) -> np.ndarray:
        """A writable numpy view of the output tensor ``flat``, no copy (``.numpy()``
        copies, a large model's in tens of milliseconds). The tensor is kept, so that
        :meth:`apply` of this buffer hands it back to TensorFlow as it is instead of
        converting the array (another copy; docs/architecture.md, "The fused gradient
        kept as a tensor"). A function's output is a fresh buffer that TensorFlow holds
        nowhere else."""
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
        flat, loss, norm = self._steps.grad_at(flat_weights, x, y, self._zeros(0),
                                               np.float32(1))
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
            self._steps.apply(self._fused)
        else:
            self._steps.apply(flat_grad)

    def _apply_flat(self, grad: np.ndarray) -> None:
        """The flat optimizer's update of its copy of the weights; the variables are
        assigned from that copy later (handed to TensorFlow through DLPack: no
        conversion), see :meth:`apply`."""
        self._flat_copy()
        self.flat_optimizer.step(self._flat_weights, grad)  # type: ignore[union-attr, arg-type]
        self._assign_pending = True

    def _flat_copy(self):
        """TensorFlow's view of the flat optimizer's copy of the weights, made from the
        variables if there is none (the first step, or the weights were set since)."""
        if self._flat_weights is None:
            self._flat_weights = self.weights(out=aligned_empty(self.n_params))
            self._flat_tensor = as_tensor(self._flat_weights)
        return self._flat_tensor

    def _assign_updated_weights(self) -> None:
        """The variables brought up to the flat copy, if an update is not in them yet."""
        if self._assign_pending:
            self._assign_pending = False
            self._steps.set_weights(self._flat_tensor)

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
        loss, norm = self._steps.train_step(x, y)
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
        for i, v in enumerate(self.optimizer.variables):  # type: ignore[union-attr]
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
            return [v.numpy() if copy else v
                    for v in self.optimizer.variables]  # type: ignore[union-attr]
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
        self._steps.set_weights(flat)
        self._flat_weights, self._assign_pending = None, False  # the flat copy is stale

    # ---- evaluation -----------------------------------------------------------------
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> Tuple[float, float]:
        """(mean loss, accuracy) over ``x, y``."""
        self._assign_updated_weights()
        loss_sum, correct = 0.0, 0
        for start in range(0, len(y), EVAL_BATCH):
            batch_loss, batch_correct = self._steps.eval_batch(x[start:start + EVAL_BATCH],
                                                               y[start:start + EVAL_BATCH])
            loss_sum += float(batch_loss)
            correct += int(batch_correct)
        return loss_sum / len(y), correct / len(y)

