"""The sync protocol under real MPI, at any process count.

These drive the real :func:`mpitrain.train.sync.train` on every rank (LR on small
random batches): at one rank the single rank trains and evaluates itself; with
more, rank 0 serves (evaluates what worker 1 sends, checks every worker's
checksum) while the workers average their gradients. They check the protocol's
promises: every rank ends at the same step with the curve and checkpoints
recorded where they are due, the workers' replicas stay bit-identical, a replica
that drifts is named by rank 0, and a rank that fails alone gets its one-line
reason to rank 0.
"""

import time

import numpy as np
import pytest

from conftest import synthetic_shard
from mpitrain import models
from mpitrain.comm import Comm, report_failure
from mpitrain.config import Config, resolve
from mpitrain.run.console import NullConsole
from mpitrain.errors import PeerFailure, ReplicaDrift
from mpitrain.models.replica import Replica, checksum, init_tensorflow
from mpitrain.results.run_dir import NullResults
from mpitrain.train import Context, sync
from mpitrain.train.priority import SERVER_NICENESS, niceness

BATCH = 8
SHARD = 32  # 4 steps per epoch


@pytest.fixture(scope="module")
def comm():
    return Comm.world(timeout=60.0)


@pytest.fixture
def replica():
    return fresh_replica()


class _Recording(NullResults):
    """Writes nothing; remembers the curve rows and checkpoints it is given."""

    def __init__(self):
        self.curve, self.checkpoints = [], []

    def add_curve_row(self, row):
        self.curve.append(row)

    def save_checkpoint(self, checkpoint, meanwhile=None):
        self.checkpoints.append(checkpoint)
        super().save_checkpoint(checkpoint, meanwhile)  # runs the evaluation


def context(comm, replica, epochs, results, **settings):
    cfg = resolve(Config.of(model="lr", epochs=epochs, batch_size=BATCH, eval_every=1, **settings),
                  models.get("lr").defaults, comm.size)
    data = synthetic_shard(comm.rank, SHARD, comm.size - 1)
    return Context(cfg, comm, comm.assign_roles(1), replica, data, results, NullConsole(),
                   shard_size=SHARD, worker_index=max(0, comm.rank - 1))


def test_every_rank_ends_together_with_identical_replicas_and_the_curve_recorded(comm,
                                                                                 replica):
    written = _Recording()
    summary = sync.train(context(comm, replica, epochs=2, results=written))
    steps = comm.allgather_objects(summary.steps)
    assert steps == [8] * comm.size  # 2 epochs x 4 steps, on every rank
    sums = comm.allgather_objects(checksum(replica.state()))
    # every replica, rank 0's included (it loaded worker 1's weights at the last evaluation)
    assert len(set(sums)) == 1, sums
    if comm.role.serves:
        assert [row["step"] for row in written.curve] == [0, 4, 8]  # initial + every epoch
        assert summary.test_accuracy == written.curve[-1]["test_accuracy"]
        final = written.checkpoints[-1]
        assert final.step == 8 and final.meta.geometry.world_size == comm.size
        assert checksum(final.weights) == checksum(replica.weights())
    comm.barrier()


def test_overlapped_buckets_keep_replicas_identical(comm):
    """--overlap on with LR cut in two buckets (bias, kernel): every replica ends the
    same, and with at most two workers (a sum is one addition) the same as with the
    whole gradient in one allreduce."""
    weights = {}
    for overlap in ("off", "on"):
        replica = fresh_replica()
        assert len(replica.gradient_buckets(3e-5 * 2**20)) == 2
        # 3e-5 MB: 31 bytes, so the bias (40 bytes) and the kernel are two buckets
        sync.train(context(comm, replica, 1, NullResults(), overlap=overlap, bucket_mb=3e-5))
        weights[overlap] = replica.weights()
        assert len(set(comm.allgather_objects(checksum(replica.state())))) == 1
    if comm.size <= 3:
        assert np.array_equal(weights["on"], weights["off"])
    comm.barrier()


@pytest.mark.parametrize("compression,option", [("powersgd", {"compression_rank": 2}),
                                                ("topk", {"compression_ratio": 0.02})])
def test_compressed_sums_keep_replicas_identical(comm, compression, option):
    """--compression powersgd (the 784 x 10 kernel as rank-2 factors) and topk (2% of
    it, gathered), from the first step, the bias whole: every replica ends the same (rank
    0 compares their checksums at every evaluation too), the training moved the weights,
    and (with two workers or more, where there is a sum) not as the exact sum would."""
    weights = {}
    for exchanged in ("none", compression):
        replica = fresh_replica()
        before = replica.weights()
        settings = dict(option, compression_warmup=0) if exchanged != "none" else {}
        sync.train(context(comm, replica, 2, NullResults(), compression=exchanged,
                           **settings))
        assert len(set(comm.allgather_objects(checksum(replica.state())))) == 1
        assert not np.array_equal(replica.weights(), before)
        weights[exchanged] = replica.weights()
    if comm.size >= 3:
        assert not np.array_equal(weights["none"], weights[compression])
    comm.barrier()


def fresh_replica():
    init_tensorflow(1, 0)  # the same seed: the same initial weights
    return Replica(models.get("lr"), (28, 28, 1), 10, "sgd", 0.1)


class _Drifting:
    """A replica whose reported state differs from its real one (as if its allreduce
    result had differed from the other workers')."""

    def __init__(self, inner):
        self._inner = inner

    def state(self):
        state = self._inner.state()
        state[0] += 1e-3
        return state

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _SlowEvaluations(_Recording):
    """Rank 0's evaluations after the first take half a second each (its host busy with
    other processes); remembers the niceness each one ran at."""

    def __init__(self):
        super().__init__()
        self.niceness = []

    def add_curve_row(self, row):
        super().add_curve_row(row)
        self.niceness.append(niceness())
        if row["step"] > 0:
            time.sleep(0.5)


def test_rank_0_on_the_workers_critical_path_gives_up_its_lower_priority(comm, replica):
    """Rank 0 serves below the workers' priority; once they wait for it to take their
    weights (its evaluations slower than their epochs), they say so in a report and it
    runs at its own priority again, for the rest of the run and after it."""
    if comm.size == 1:
        pytest.skip("needs a server and a worker: runs under mpirun -np 2+ (test_mpi_tier)")
    before = niceness()
    written = _SlowEvaluations()
    sync.train(context(comm, replica, epochs=6, results=written))
    comm.barrier()
    if comm.role.serves:
        if written.niceness[0] == before:
            pytest.skip("this rank may not raise its priority again, so it never lowered it")
        assert written.niceness[0] == SERVER_NICENESS
        assert written.niceness[-1] == before == niceness(), written.niceness


def test_rank_0_names_a_worker_whose_replica_drifted(comm, replica):
    if comm.size < 3:
        pytest.skip("needs two workers to compare: runs under mpirun -np 3+ (test_mpi_tier)")
    # one epoch: the only report is the final one, after which no worker sends again
    ctx = context(comm, _Drifting(replica) if comm.rank == 2 else replica, 1, NullResults())
    if comm.rank == 0:
        with pytest.raises(ReplicaDrift, match=r"weights on rank 2 on \S+ differ from rank 1"):
            sync.train(ctx)
    else:
        sync.train(ctx)
    comm.barrier()


def test_a_rank_failing_alone_gets_its_reason_to_rank_0(comm):
    if comm.size == 1:
        pytest.skip("needs a second rank: runs under mpirun -np 2+ (test_mpi_tier)")
    if comm.rank == 0:
        comm.listen_for_failures()
        never = comm.irecv(np.zeros(1), 1, 99, "control", "a message rank 1 never sends")
        with pytest.raises(PeerFailure, match="rank 1 on .*: out of memory in step 3"):
            comm.wait(never, timeout=30.0)
        comm.cancel(never)
        comm.stop_listening()
    elif comm.rank == 1:
        # returns after the grace: in a real job rank 0 aborts the job meanwhile
        report_failure(f"{comm.name(1)}: out of memory in step 3", grace=0.5)
    comm.barrier()
