"""``import mpitrain.horovod as hvd``: Horovod's TensorFlow API (``horovod.tensorflow``) on
mpitrain's MPI engine, for TensorFlow 2.16+ and Keras 3.

Run a Horovod script with its import line changed, under mpirun as before::

    mpirun -np 4 python train.py        # import mpitrain.horovod as hvd

What is provided: ``init``, ``shutdown`` and the topology (``size``, ``rank``,
``local_*``, ``cross_*``); the collectives ``allreduce`` (Average, Sum, Min, Max,
Product; pre/postscale; compression), ``grouped_allreduce``, ``allgather``,
``broadcast``, ``broadcast_variables``, ``broadcast_object``, ``allgather_object``, ``alltoall``,
``reducescatter``, ``join``, ``barrier``, in eager code and inside ``tf.function``;
``DistributedGradientTape``; ``DistributedOptimizer`` for Keras 3 optimizers;
``Compression.none``/``fp16``; ``hvd.elastic`` (:mod:`.elastic`: a change of hosts
restarts the job, the state carried over). Keras' callbacks and ``load_model`` are in
:mod:`mpitrain.horovod.keras`. What is not (process sets, GPUs and NCCL, Gloo,
``horovodrun``/``horovod.run``, Adasum, the timeline) raises :class:`Unsupported`
naming what to use instead. docs/horovod.md has the details and the migration table.
"""

from __future__ import annotations

from .world import (NotInitialized, Unsupported, init, install_excepthook,  # noqa: F401
                    is_initialized, shutdown, topology, unsupported)
from .compression import (Compression, Compressor, FP16Compressor,  # noqa: F401
                          NoneCompressor)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather,  # noqa: F401
                  allgather_object, allreduce, barrier, broadcast,
                  broadcast_object, broadcast_object_fn, global_process_set,
                  grouped_allgather, grouped_allreduce, grouped_reducescatter, join,
                  local_rank_op, local_size_op, rank_op, reducescatter, size_op)
from .rows import alltoall  # noqa: F401
from .variables import (broadcast_, broadcast_global_variables,  # noqa: F401
                        broadcast_variables)
from .tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from . import elastic, util  # noqa: F401,E402
from .util import _executing_eagerly  # noqa: F401,E402 (Horovod's hvd._executing_eagerly)

install_excepthook()


# ---- who and where ---------------------------------------------------------------------
def size() -> int:
    """The number of ranks (processes) in the job."""
    return topology().size


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return topology().rank


def local_size() -> int:
    """The number of ranks on this host."""
    return topology().local_size


def local_rank() -> int:
    """This rank's index among the ranks of its host."""
    return topology().local_rank


def cross_size() -> int:
    """The number of ranks with this rank's local rank (one per host, on equal hosts)."""
    return topology().cross_size


def cross_rank() -> int:
    """This rank's index among the ranks with its local rank."""
    return topology().cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return topology().homogeneous


def mpi_threads_supported() -> bool:
    """Whether MPI runs at MPI_THREAD_MULTIPLE."""
    topology()
    from ..comm import reductions

    return reductions.threads_supported()


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def _false() -> bool:
    return False


gloo_enabled = gloo_built = nccl_built = ddl_built = ccl_built = cuda_built = rocm_built = _false


# ---- what is not provided --------------------------------------------------------------
class _Unprovided:
    """A Horovod name whose feature is not provided: using it raises :class:`Unsupported`."""

    def __init__(self, feature: str, instead: str):
        self._feature, self._instead = feature, instead

    def __call__(self, *args, **kwargs):
        raise unsupported(self._feature, self._instead)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise unsupported(self._feature, self._instead)


_LAUNCH = ("start the script under mpirun (mpirun -np N python script.py), or under "
           "'mpitrain launch -np N script.py', which restarts it when it fails")
_SETS = "every collective runs on all ranks; run the groups as separate jobs"
run = _Unprovided("horovod.run / horovodrun", _LAUNCH)
ProcessSet = add_process_set = remove_process_set = _Unprovided("process sets", _SETS)
process_set_included_op = _Unprovided("process sets", _SETS)
start_timeline = stop_timeline = _Unprovided(
    "Horovod's timeline", "hvd.init(results_dir=DIR) (or $MPITRAIN_RESULTS_DIR) records "
    "per-rank compute, communication and wait times, CPU, memory and traffic")
SyncBatchNormalization = _Unprovided(
    "SyncBatchNormalization", "use keras.layers.BatchNormalization (each rank normalises "
    "its own batch)")
