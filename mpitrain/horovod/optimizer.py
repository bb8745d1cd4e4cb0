"""``DistributedOptimizer`` for Keras 3 optimizers: gradients averaged over every rank
before each update, in ``model.fit`` (after ``model.compile(optimizer=...)``) and in
a custom loop's ``optimizer.apply_gradients``.

Horovod 0.28's version overrides methods Keras 3 no longer calls (``get_gradients``,
``_compute_gradients``; horovod#4290). This one overrides the method every Keras 3
update goes through, ``apply(grads, variables)`` (``apply_gradients`` calls it), in a
subclass of the optimizer's own class made on the fly, so the result is still an
``Adam``, an ``SGD``... with the same configuration, saved and loaded as one.
"""

from __future__ import annotations

import tensorflow as tf

from . import world as runtime
from .compression import Compression
from .collectives import Average
from .ops import _check_process_set, global_process_set, plain
from .world import unsupported
from .tape import GradientReducer


class _DistributedOptimizer:
    """What DistributedOptimizer adds to the optimizer's class."""

    _hvd_reducer: GradientReducer
    _hvd_passes: int = 1
    _hvd_average_aggregated: bool = False

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        if self._hvd_passes > 1:
            # the locally aggregated gradients and the passes so far: optimizer variables,
            # so they are broadcast and checkpointed with the rest of its state
            self._hvd_sums = [self.add_variable_from_reference(v, name="hvd_aggregated")
                              for v in variables]
            self._hvd_count = self.add_variable((), initializer="zeros", dtype="int64",
                                                name="hvd_passes")

    @plain
    def apply(self, grads, trainable_variables=None):
        """Average ``grads`` over every rank, then apply them as the optimizer does. With
        ``backward_passes_per_step`` k > 1: sum them locally and exchange and apply the
        sum every k-th call (divided by k with ``average_aggregated_gradients``); the
        other calls only count an iteration, as Horovod's do. Collective: every rank
        calls it, with gradients of the same variables."""
        grads = list(grads)
        variables = (list(self._trainable_variables) if trainable_variables is None
                     else list(trainable_variables))
        if self._hvd_passes == 1:
            return super().apply(self._hvd_reducer(grads, variables), trainable_variables)
        if not self.built:
            with tf.name_scope(self.name):
                self.build(variables)
        apply = super().apply
        sums = [self._hvd_sums[self._get_variable_index(v)] for v in variables]
        for g, total in zip(grads, sums):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))
        self._hvd_count.assign_add(1)

        def exchange_and_apply():
            totals = [None if g is None else tf.convert_to_tensor(s)
                      for g, s in zip(grads, sums)]
            reduced = self._hvd_reducer(totals, variables)
            if self._hvd_average_aggregated:
                reduced = [None if r is None else r / self._hvd_passes for r in reduced]
            apply(reduced, trainable_variables)
            for total in sums:
                total.assign(tf.zeros_like(total))
            self._hvd_count.assign(0)

        def count_only():
            self._iterations.assign_add(1)

        tf.cond(tf.equal(tf.convert_to_tensor(self._hvd_count), self._hvd_passes),
                exchange_and_apply, count_only)

    def register_local_var(self, var) -> None:
        """Leave ``var``'s gradient out of the exchange (Horovod's local variables)."""
        self._hvd_reducer.register_local(var)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True,
                         use_locking=False):
    """A new optimizer of ``optimizer``'s class and configuration (a Keras 3 optimizer;
    its state is not copied, as Horovod's is not) whose updates use gradients averaged
    over every rank (``op``: Average, or Sum, Min, Max, Product). Use it with
    ``model.compile(optimizer=...)`` and ``model.fit``, or ``apply_gradients`` in a loop.
    Every rank must update the same variables in the same order."""
    _check_process_set(process_set)
    runtime.engine()
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise unsupported(f"DistributedOptimizer for {type(optimizer).__name__} (not a Keras 3 "
                          "optimizer)", "use a keras.optimizers optimizer, or "
                          "hvd.DistributedGradientTape in a custom loop")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be 1 or more (got "
                         f"{backward_passes_per_step})")
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              scale_local_gradients, groups, num_groups)
    cls = distributed_class(type(optimizer), reducer, backward_passes_per_step,
                            average_aggregated_gradients)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set,
                                scale_local_gradients=True, local_layers=None):
    """:func:`DistributedOptimizer` whose updates of ``local_layers``' trainable weights
    (a Keras layer or a list of them) use this rank's own gradients, not averaged over
    the ranks: Horovod's partial distributed optimizer."""
    import keras

    distributed = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) \
        else list(local_layers or ())
    for layer in layers:
        for var in layer.trainable_weights:
            distributed.register_local_var(var)
    return distributed


def distributed_class(base, reducer: GradientReducer, passes: int = 1,
                      average_aggregated: bool = False):
    """The DistributedOptimizer class of the optimizer class ``base``: its name and module,
    so that a saved model's optimizer loads as ``base``."""
    return type(base.__name__, (_DistributedOptimizer, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__,
                 "_hvd_reducer": reducer, "_hvd_passes": int(passes),
                 "_hvd_average_aggregated": bool(average_aggregated)})
