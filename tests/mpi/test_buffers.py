"""MPI tier: BatchNorm statistics across sync replicas (any process count).

Workers take sync steps on different batches: their trained weights stay
bit-identical while their moving statistics drift apart; after the trainer's
buffer averaging (the real :func:`mpitrain.train.sync.average_buffers`, one
allreduce on the workers' communicator) every worker holds the same buffers,
equal to the mean of what they had, so their whole state (weights + buffers)
has one checksum. The Dropout seed is generator state, not a buffer.
"""

import numpy as np
import pytest
from conftest import BN_MODEL_SPEC

from mpitrain import models
from mpitrain.comm import Comm
from mpitrain.models.replica import Replica, checksum, init_tensorflow
from mpitrain.train.sync import average_buffers

SHAPE, CLASSES = (12, 12, 1), 4


@pytest.fixture(scope="module")
def comm():
    return Comm.world(timeout=60.0)


def test_buffers_averaged_to_identical_replicas(comm):
    init_tensorflow(1, 0)
    workers = comm.workers
    replica = Replica(models.get(BN_MODEL_SPEC), SHAPE, CLASSES, "momentum", 0.05,
                      applies=workers is not None)
    assert replica.n_buffers == 2 * (8 + 16)  # moving mean and variance per channel
    assert replica.rng_state().dtype == np.int64 and replica.rng_state().size > 0
    replica.set_state(comm.bcast_(replica.state()))
    before = None
    if workers is not None:
        rng = np.random.default_rng(7 + workers.rank)  # every worker its own batches
        for _ in range(3):
            x = rng.random((16, *SHAPE), dtype=np.float32) * (1 + workers.rank)
            y = rng.integers(0, CLASSES, 16).astype(np.int32)
            grad, _, _ = replica.grad(x, y)
            workers.allreduce_mean_(grad)
            replica.apply(grad)
        before = np.stack(workers.allgather_objects(replica.buffers()))
        average_buffers(replica, workers)
    facts = comm.allgather_objects(None if workers is None else (
        checksum(replica.weights()), checksum(replica.buffers()), checksum(replica.state()),
        replica.buffers()))
    facts = [f for f in facts if f is not None]
    assert len({f[0] for f in facts}) == 1, "trained weights differ between workers"
    assert len({f[1] for f in facts}) == 1, "buffers differ after averaging"
    assert len({f[2] for f in facts}) == 1
    if before is not None:
        if workers.size > 1:  # different batches: different statistics before averaging
            assert len({checksum(row) for row in before}) == workers.size
        np.testing.assert_allclose(replica.buffers(), before.mean(axis=0), rtol=1e-6,
                                   atol=1e-7)
        initial = np.concatenate([np.zeros(8), np.ones(8), np.zeros(16), np.ones(16)])
        assert not np.allclose(before[0], initial), "the statistics never moved"
