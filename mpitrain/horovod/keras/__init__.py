"""``import mpitrain.horovod.keras as hvd``: Horovod's ``horovod.tensorflow.keras`` on Keras 3.

The same names as :mod:`mpitrain.horovod` for init and topology, plus Keras' side:
:func:`DistributedOptimizer` for ``model.compile``, the callbacks in
:mod:`.callbacks` (``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``...), and
:func:`load_model`, which loads a saved model with its optimizer made distributed, and
``hvd.elastic`` (:mod:`.elastic_callbacks`: Horovod elastic's Keras state and
callbacks).
"""

from __future__ import annotations

from .. import (Average, Compression, ProcessSet, Sum, add_process_set, ccl_built,  # noqa: F401
                cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                gloo_enabled, global_process_set, init, is_initialized, local_rank,
                local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)
from .. import ops as _ops
from ..optimizer import (DistributedOptimizer, PartialDistributedOptimizer,  # noqa: F401
                         distributed_class)
from ..tape import GradientReducer
from . import callbacks  # noqa: F401
from . import elastic_callbacks as elastic  # noqa: F401


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """``value`` (a number, array or tensor) reduced over every rank; a tensor."""
    return _ops.allreduce(value, name=name, average=average, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, op=op, compression=compression)


def allgather(value, name=None):
    return _ops.allgather(value, name=name)


def broadcast(value, root_rank, name=None):
    return _ops.broadcast(value, root_rank, name=name)


def reducescatter(value, name=None, op=Average):
    return _ops.reducescatter(value, name=name, op=op)


def broadcast_global_variables(root_rank):
    raise RuntimeError("broadcast_global_variables() is TensorFlow 1's; use "
                       "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                       "hvd.broadcast_variables(model.variables, root_rank)")


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """``keras.models.load_model(filepath)`` with the model's optimizer loaded as a
    DistributedOptimizer (its saved state included), as Horovod's does:
    ``custom_optimizers`` lists optimizer classes of your own to make distributed too."""
    import keras

    # dir, not vars: keras.optimizers may be one of mpitrain's lazy API packages
    # (models/keras_import.py), whose names are bound on first use
    found = (getattr(keras.optimizers, name) for name in dir(keras.optimizers)
             if not name.startswith("_"))
    classes = [c for c in found
               if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)]
    classes += list(custom_optimizers or [])
    reducer = GradientReducer(compression)
    objects = {c.__name__: distributed_class(c, reducer) for c in classes}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)
