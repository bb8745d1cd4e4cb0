"""Bad uses of mpitrain.horovod, one per run (``python hvd_bad_use.py CASE``, under mpirun
but for ``before_init``), for tests/e2e/test_horovod_api_mpirun.py: each must end the
job with one ``mpitrain: error:`` line (or Open MPI's word on a dead rank) and a
non-zero exit, never hang. ``$MPITRAIN_TIMEOUT`` bounds the waits."""

import os
import signal
import sys

import tensorflow as tf

import mpitrain.horovod as hvd

case = sys.argv[1]
if case == "before_init":
    hvd.allreduce(tf.constant([1.0]))
hvd.init()
rank = hvd.rank()


@tf.function
def average(t):
    return hvd.allreduce(t)


average(tf.ones([3]))  # every rank once, as a training step's first call
if case == "mismatch":  # another shape on the last rank, inside tf.function
    average(tf.ones([4, 2]) if rank == hvd.size() - 1 else tf.ones([2, 4]))
elif case == "stalled":  # the last rank stops (SIGSTOP) before its next collective
    if rank == hvd.size() - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    average(tf.ones([3]))
elif case == "dies":  # the last rank is killed
    if rank == hvd.size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    average(tf.ones([3]))
elif case in ("exits", "rank0_exits"):  # a rank's script ends early (sys.exit(0))
    if rank == (0 if case == "rank0_exits" else hvd.size() - 1):
        sys.exit(0)
    average(tf.ones([3]))
elif case == "raises":  # the script fails on the last rank only
    if rank == hvd.size() - 1:
        raise RuntimeError("a bug on one rank")
    average(tf.ones([3]))
print(f"rank {rank} was not stopped", flush=True)
