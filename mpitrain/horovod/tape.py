"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient`` returns the
gradients averaged over every rank (one fused allreduce per dtype), and the gradient
reduction it shares with :func:`~.optimizer.DistributedOptimizer`."""

from __future__ import annotations

from typing import List, Sequence, Set

import tensorflow as tf

from . import world as runtime
from .compression import Compression
from .collectives import GRADIENTS, Average
from .ops import _check_process_set, global_process_set, plain, reduce_list


class GradientReducer:
    """Reduces a list of gradients over every rank as Horovod's tape and optimizer do:
    None stays None; ``tf.IndexedSlices`` are allgathered (or made dense with
    ``sparse_as_dense``); the dense ones are compressed and fused, one collective per
    dtype; with Average, scaled by 1/``predivide`` before the sum and
    ``predivide``/size after it. Gradients of sources registered as local are not
    exchanged (divided by the number of ranks if ``scale_local``)."""

    def __init__(self, compression=Compression.none, sparse_as_dense: bool = False,
                 op: int = Average, gradient_predivide_factor: float = 1.0,
                 scale_local_gradients: bool = True, groups=None, num_groups: int = 0):
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op == Average")
        if groups is not None and not (isinstance(groups, list) or groups > 0):
            raise ValueError("groups should be a positive integer or a list of lists of "
                             "variables")
        # groups / num_groups only split Horovod's fusion; every dtype's gradients are
        # fused into one buffer here, which gives the same sums
        self.compression, self.sparse_as_dense, self.op = compression, sparse_as_dense, op
        self.predivide, self.scale_local = gradient_predivide_factor, scale_local_gradients
        self.local: Set[int] = set()

    def register_local(self, source) -> None:
        self.local.add(id(source))

    @plain
    def __call__(self, grads: Sequence, sources: Sequence) -> List:
        grads = [tf.convert_to_tensor(g) if self.sparse_as_dense
                 and isinstance(g, tf.IndexedSlices) else g for g in grads]
        shared = [i for i, (g, s) in enumerate(zip(grads, sources))
                  if g is not None and id(s) not in self.local]
        pre, post = ((1.0 / self.predivide, self.predivide) if self.op == Average
                     else (1.0, 1.0))
        reduced = reduce_list([grads[i] for i in shared], self.op, self.compression, pre, post,
                              name=GRADIENTS)
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self.scale_local and self.local:
            size = float(runtime.topology().size)
            for i, (g, s) in enumerate(zip(grads, sources)):
                if g is not None and id(s) in self.local:
                    out[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / size)
        return out


class _DistributedTape:
    """What DistributedGradientTape adds to the tape's own class."""

    _reducer: GradientReducer

    @plain
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        """The tape's gradients, averaged (or reduced by the tape's ``op``) over every rank.
        Collective: every rank calls it for the same sources."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = self._reducer(tf.nest.flatten(grads), flat_sources)
        return tf.nest.pack_sequence_as(grads, flat)

    def register_local_source(self, source) -> None:
        """Leave ``source``'s gradient out of the exchange (Horovod's local sources)."""
        self._reducer.register_local(source)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        grads = self.gradient(target, sources, output_gradients)
        pairs = list(zip(sources, grads))
        local = [(s, g) for s, g in pairs if id(s) in self._reducer.local]
        return local, [(s, g) for s, g in pairs if id(s) not in self._reducer.local]


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """``gradtape`` (a ``tf.GradientTape``, after or inside its ``with`` block) as a tape
    whose ``gradient`` averages the gradients over every rank (``op``: Average, or Sum,
    Min, Max, Product); ``compression=hvd.Compression.fp16`` moves them as float16.
    Every rank must call ``gradient`` for the same sources, in the same order."""
    _check_process_set(process_set)
    runtime.engine()
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              scale_local_gradients, groups, num_groups)
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedTape, base), {"__module__": base.__module__})
    tape = cls.__new__(cls)
    # the same recorded tape, not recording through this object (Horovod's copy): the
    # original's ``with`` block, if still open, stops the recording
    tape.__dict__.update(gradtape.__dict__)
    tape._recording = False
    tape._reducer = reducer
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A :func:`DistributedGradientTape` that keeps the gradients of ``local_layers``'
    weights on this rank."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    layers = [] if local_layers is None else (
        local_layers if isinstance(local_layers, (list, tuple)) else [local_layers])
    for layer in layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape
