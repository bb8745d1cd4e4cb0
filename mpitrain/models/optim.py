"""Optimizers on one flat float32 vector: the async parameter server's update, and the
sync workers' under ``--compile auto`` (:class:`mpitrain.models.replica.Replica`).

The server applies every worker's gradient the moment it arrives. A Keras
``apply_gradients`` call costs a fixed TensorFlow dispatch whatever the model
size, which at thousands of LR updates per second would keep the server on a
core all the time; these elementwise updates on the fused buffer cost
microseconds for LR and LeNet. They follow Keras 3's formulas exactly (checked
against Keras in tests/unit/test_optim.py) so ``--optimizer`` means the same in
both modes.

Contract: ``step(weights, grad)`` updates ``weights`` in place; state (momentum,
Adam moments, iteration count) lives in the optimizer and is exposed by
:meth:`state`/:meth:`load_state` for checkpoints. The gradient goes through the
same chain as on the Keras path (:class:`mpitrain.models.replica.Replica`): clipped to
``clip_norm`` by global L2 norm (``--clip-grad-norm``), then the update, so
every mode (single, sync, async) transforms gradients the same way.

Each update is one fused pass in C (``mpitrain/kernels/_optim.c``, built by ``pip
install``) where it was built, else numpy; both give the same bits (the C code
makes numpy's float32 operations in numpy's order); the C pass takes a fraction of
numpy's time (docs/architecture.md, "Flat optimizers in C").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

try:
    from ..kernels import _optim  # type: ignore[attr-defined]  # (C: no types)
except ImportError:  # not built (no compiler at install time): numpy does the updates
    _optim = None

#: True when the updates run in the compiled fused passes
FUSED = _optim is not None


def delay_compensate(grad, ms, weights, w_read, m, c, lam, eps) -> None:
    """The compiled pass of :mod:`mpitrain.train.asynchronous.compensation` (FUSED only)."""
    _optim.delay_compensate(grad, ms, weights, w_read, m, c, lam, eps)


def clip_by_global_norm_(grad: np.ndarray, clip_norm: float,
                         norm: Optional[float] = None) -> np.ndarray:
    """Scale ``grad`` in place to at most ``clip_norm`` in L2 norm, as the Keras path does:
    g * min(1, clip / (||g|| + 1e-12)), in float32. ``norm``: ||g|| when the caller knows
    it (the async servers: each holds a share of g, the worker sent the whole's norm)."""
    norm = np.float32(np.sqrt(np.dot(grad, grad)) if norm is None else norm)
    factor = min(np.float32(1.0), np.float32(clip_norm) / (norm + np.float32(1e-12)))
    if factor < 1.0:
        grad *= np.float32(factor)
    return grad


def cosine_factor(step: int, decay_steps: int) -> float:
    """Keras' CosineDecay: 0.5 (1 + cos(pi min(step, T) / T))."""
    return 0.5 * (1.0 + math.cos(math.pi * min(step, decay_steps) / decay_steps))


@dataclass(frozen=True)
class Schedule:
    """The learning rate's course over a run's updates, as a factor of the peak rate.

    Gradual warm-up (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): over the
    first ``warmup_steps`` updates the factor rises linearly from ``start`` (one
    worker's rate over the scaled one: 1/k for a k-fold scaled rate) to 1, so a
    large global batch does not begin with a step its initial weights cannot take.
    Then constant, or (``decay_steps``) cosine decay to 0 over the remaining
    ``decay_steps - warmup_steps`` updates. Without warm-up the cosine is Keras'
    CosineDecay over ``decay_steps``. The same arithmetic runs in the flat optimizers
    (:meth:`factor`) and in Keras' (:func:`mpitrain.models.steps.make_optimizer`).
    """

    warmup_steps: int = 0
    start: float = 1.0
    decay_steps: Optional[int] = None

    @property
    def constant(self) -> bool:
        return not self.warmup_steps and not self.decay_steps

    def factor(self, step: int) -> float:
        """The factor of the peak learning rate at update ``step`` (0-based)."""
        warm = self.warmup_steps
        if step < warm:
            return self.start + (1.0 - self.start) * step / warm
        if not self.decay_steps:
            return 1.0
        return cosine_factor(step - warm, max(1, self.decay_steps - warm))


#: the momentum of each optimizer that has one (Adam's is its beta_1), as Keras' defaults
MOMENTUM = {"momentum": 0.9, "nesterov": 0.9, "adam": 0.9}


class FlatOptimizer:
    """Base: in-place update of a flat weight vector from a flat gradient."""

    def __init__(self, n_params: int, lr: float, schedule: Optional[Schedule] = None,
                 clip_norm: Optional[float] = None):
        self.base_lr = lr
        self._constant_lr = np.float32(lr)  # (made once, not per update)
        #: warm-up and decay over the updates (:class:`Schedule`), or None: constant
        self.schedule = None if schedule is None or schedule.constant else schedule
        self.clip_norm = clip_norm  # --clip-grad-norm, applied before every update
        self.iterations = 0
        self.n_params = n_params
        self._work: Optional[np.ndarray] = None  # see _scratch

    def _scratch(self) -> np.ndarray:
        """A work vector of the numpy path, made at its first use: the fused path needs
        none (the 32x32 AlexNet's would be 110 MB)."""
        if self._work is None:
            self._work = np.empty(self.n_params, np.float32)
        return self._work

    @property
    def lr(self) -> np.float32:
        """The learning rate of the next update (Keras evaluates it before counting it)."""
        if self.schedule is not None:
            return np.float32(self.base_lr * self.schedule.factor(self.iterations))
        return self._constant_lr

    def step(self, weights: np.ndarray, grad: np.ndarray, norm: Optional[float] = None,
             lr_factor: float = 1.0) -> None:
        """One update of ``weights`` from ``grad`` (clipped in place first, if configured,
        by its global norm: ``norm`` when given, the norm of a whole of which ``grad`` is a
        part), at the scheduled learning rate times ``lr_factor`` (the async servers'
        staleness compensation, :mod:`mpitrain.train.asynchronous.compensation`)."""
        if self.clip_norm:
            clip_by_global_norm_(grad, self.clip_norm, norm)
        lr = self.lr
        self.update(weights, grad, lr if lr_factor == 1.0 else np.float32(lr * lr_factor))

    def update(self, weights: np.ndarray, grad: np.ndarray, lr: np.float32) -> None:
        """One update at learning rate ``lr``; counts it."""
        raise NotImplementedError

    def slots(self) -> Dict[str, np.ndarray]:
        """The per-parameter state vectors by name, themselves (no copies)."""
        return {}

    def state(self) -> Dict[str, np.ndarray]:
        """A copy of the whole state: the update count, then :meth:`slots`."""
        return {"iterations": np.array(self.iterations),
                **{name: slot.copy() for name, slot in self.slots().items()}}

    def layout(self) -> Dict[str, tuple]:
        """{name: (shape, dtype)} of :meth:`state`, without copying a slot."""
        return {"iterations": ((), "int64"),
                **{name: (slot.shape, slot.dtype.name) for name, slot in self.slots().items()}}

    def load_state(self, state: Dict[str, np.ndarray]) -> None:
        self.iterations = int(state["iterations"])
        for name, slot in self.slots().items():
            slot[:] = state[name]


class SGD(FlatOptimizer):
    """w -= lr * g"""

    def update(self, weights, grad, lr):
        if FUSED:
            _optim.sgd(weights, grad, lr)
        else:
            scratch = self._scratch()
            np.multiply(grad, lr, out=scratch)
            weights -= scratch
        self.iterations += 1


class Momentum(FlatOptimizer):
    """Keras SGD(momentum=m): v = m * v - lr * g; w += v. With ``nesterov``, Keras
    SGD(momentum=m, nesterov=True): the same v, and w += m * v - lr * g (the step taken
    from where the momentum is about to carry the weights)."""

    def __init__(self, n_params, lr, schedule=None, clip_norm=None,
                 momentum=MOMENTUM["momentum"], nesterov=False):
        super().__init__(n_params, lr, schedule, clip_norm)
        self.momentum = np.float32(momentum)
        self.nesterov = nesterov
        self.velocity = np.zeros(n_params, np.float32)

    def update(self, weights, grad, lr):
        if FUSED:
            _optim.momentum(weights, grad, self.velocity, lr, self.momentum, self.nesterov)
        else:
            scratch = self._scratch()
            self.velocity *= self.momentum
            np.multiply(grad, lr, out=scratch)
            self.velocity -= scratch
            if self.nesterov:
                weights += self.velocity * self.momentum - scratch
            else:
                weights += self.velocity
        self.iterations += 1

    def slots(self):
        return {"velocity": self.velocity}


class Adam(FlatOptimizer):
    """Keras Adam: bias-corrected step size, epsilon outside the square root."""

    def __init__(self, n_params, lr, schedule=None, clip_norm=None, beta_1=MOMENTUM["adam"],
                 beta_2=0.999, epsilon=1e-7):
        super().__init__(n_params, lr, schedule, clip_norm)
        self.beta_1, self.beta_2 = np.float32(beta_1), np.float32(beta_2)
        self.epsilon = np.float32(epsilon)
        # 1 - beta, made once (float32, as numpy computes them), for every update
        self._c1, self._c2 = 1 - self.beta_1, 1 - self.beta_2
        self.m = np.zeros(n_params, np.float32)
        self.v = np.zeros(n_params, np.float32)

    def update(self, weights, grad, lr):
        self.iterations += 1
        t = self.iterations
        alpha = np.float32(lr * np.sqrt(1 - self.beta_2 ** t) / (1 - self.beta_1 ** t))
        c1, c2 = self._c1, self._c2
        if FUSED:
            _optim.adam(weights, grad, self.m, self.v, c1, c2, self.epsilon, alpha)
            return
        scratch = self._scratch()
        self.m += (grad - self.m) * c1
        np.square(grad, out=scratch)
        self.v += (scratch - self.v) * c2
        np.sqrt(self.v, out=scratch)
        scratch += self.epsilon
        np.divide(self.m, scratch, out=scratch)
        scratch *= alpha
        weights -= scratch

    def slots(self):
        return {"m": self.m, "v": self.v}


#: per-parameter slots of each optimizer (Keras keeps them per variable, in this order)
SLOTS_PER_WEIGHT = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2}


def adapt_state(saved: Dict[str, np.ndarray], layout: Dict[str, tuple], name: str,
                sizes: Sequence[int], lr: float) -> Dict[str, np.ndarray]:
    """A checkpoint's optimizer state (``saved``: {"o0": ..., "o1": ...}, as
    :meth:`mpitrain.models.replica.Replica.optimizer_state` names it) in ``layout``'s
    form ({name: (shape, dtype)}) for optimizer ``name`` over variables of ``sizes``.

    The two forms hold the same numbers. Keras' (``--compile graph`` and ``xla``, and
    every model but the largest before the flat update became the default): the update
    count, the learning rate if it is constant, then each variable's slots in turn
    (Adam: its m, then its v). The flat optimizer's: the update count, then each slot
    over all parameters. A Keras learning rate the flat form lacks is ``lr``, the
    run's. ``saved`` comes back as it is if it fits ``layout`` already or is in neither
    form (:func:`mpitrain.run.checkpoint.optimizer_mismatch` then says so)."""
    per_weight = SLOTS_PER_WEIGHT[name]
    have, want = _in_order(saved), _in_order(layout)
    if have is None or want is None or [np.size(v) for v in have] == \
            [int(np.prod(shape, dtype=np.int64)) for shape, _ in want]:
        return saved  # not named o0, o1...; or it fits
    parts = _slot_vectors(have, per_weight, sizes)
    if parts is None:
        return saved
    count, rate, slots = parts
    values = _in_form(len(want), count, lr if rate is None else rate, slots, per_weight, sizes)
    if values is None:
        return saved
    return {f"o{i}": np.asarray(value, dtype).reshape(shape)
            for i, (value, (shape, dtype)) in enumerate(zip(values, want))}


def _in_order(named: Mapping[str, object]) -> Optional[list]:
    """The values of ``named`` in the order of their names o0, o1...; None if those are
    not exactly its names."""
    names = [f"o{i}" for i in range(len(named))]
    return [named[n] for n in names] if set(named) == set(names) else None


def _slot_vectors(values: list, per_weight: int, sizes: Sequence[int]):
    """(update count, Keras' learning rate or None, [each slot over all parameters]) of
    a state in either form, or None if it is in neither."""
    n_params = sum(sizes)
    if len(values) == 1 + per_weight and all(np.size(v) == n_params for v in values[1:]):
        return values[0], None, [np.asarray(v).reshape(-1) for v in values[1:]]
    lead = len(values) - per_weight * len(sizes)  # the count, and the rate if constant
    if lead not in (1, 2):
        return None
    body = values[lead:]
    if any(np.size(body[i * per_weight + j]) != size
           for i, size in enumerate(sizes) for j in range(per_weight)):
        return None
    slots = [np.concatenate([np.asarray(body[i * per_weight + j]).reshape(-1)
                             for i in range(len(sizes))]) for j in range(per_weight)]
    return values[0], values[1] if lead == 2 else None, slots


def _in_form(length: int, count, rate, slots: list, per_weight: int,
             sizes: Sequence[int]) -> Optional[list]:
    """The values of a state of ``length`` entries: the flat form if that is its length,
    else Keras' (with the rate if it has room for it); None if neither fits."""
    if length == 1 + per_weight:
        return [count, *slots]
    lead = length - per_weight * len(sizes)
    if lead not in (1, 2):
        return None
    offsets = np.cumsum([0, *sizes])
    return [count, *([rate] if lead == 2 else []),
            *(slots[j][offsets[i]:offsets[i + 1]]
              for i in range(len(sizes)) for j in range(per_weight))]


def make(name: str, n_params: int, lr: float, schedule: Optional[Schedule] = None,
         clip_norm: Optional[float] = None, momentum: Optional[float] = None) -> FlatOptimizer:
    """The flat optimizer for ``--optimizer name`` (its learning rate ``lr`` following
    ``schedule``, gradients clipped to ``clip_norm``); ``momentum`` replaces its
    :data:`MOMENTUM` (an async server's, :mod:`mpitrain.train.asynchronous.momentum`)."""
    if name == "sgd":
        return SGD(n_params, lr, schedule, clip_norm)
    momentum = MOMENTUM[name] if momentum is None else momentum
    if name == "adam":
        return Adam(n_params, lr, schedule, clip_norm, beta_1=momentum)
    return Momentum(n_params, lr, schedule, clip_norm, momentum=momentum,
                    nesterov=name == "nesterov")
