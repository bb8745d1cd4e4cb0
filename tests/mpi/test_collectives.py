"""MPI-tier tests: they pass at ANY process count.

Plain ``pytest`` runs them at one rank; ``tests/e2e/test_mpi_tier.py`` runs this
file under real ``mpirun -np 2, 3, 4``. Every rank runs the same tests in the same
order, so collectives line up; every wait is bounded by the comm's timeout.
"""

import mmap
import threading
import time

import numpy as np
import pytest

from mpitrain import models
from mpitrain.comm import Comm, Role, SharedMemorySum, shared
from mpitrain.errors import CommTimeout, DataError
from mpitrain.models.replica import Replica, checksum, init_tensorflow

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def comm():
    return Comm.world(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def replica():
    init_tensorflow(1, 0)
    return Replica(models.get("lr"), (28, 28, 1), 10, "sgd", 0.1)


#: model -> (input shape, classes). AlexNet is left to tests/e2e/test_models.py: its
#: 61.1M parameters cost ~2 GB and ~20 s per rank at every process count here, and
#: its sync runs there check the replicas' checksums at every evaluation too.
SHAPES = {"lr": ((28, 28, 1), 10), "lenet": ((28, 28, 1), 10)}


@pytest.fixture(scope="module", params=list(SHAPES))
def any_replica(request):
    init_tensorflow(1, 0)
    shape, classes = SHAPES[request.param]
    replica = Replica(models.get(request.param), shape, classes, "sgd", 0.1)
    replica.batch = lambda seed: batch(seed, 8, shape, classes)
    return replica


def batch(seed, n=32, shape=(28, 28, 1), classes=10):
    rng = np.random.default_rng(seed)
    return (rng.random((n, *shape), dtype=np.float32),
            rng.integers(0, classes, n).astype(np.int32))


def test_roles(comm):
    roles = comm.allgather_objects(comm.assign_roles(1))
    if comm.size == 1:
        assert roles == [Role.SINGLE]
    else:
        assert roles == [Role.SERVER] + [Role.WORKER] * (comm.size - 1)
        assert (comm.workers is None) == (comm.rank == 0)
    assert len(comm.hosts) == comm.size


def test_bcast_overwrites_with_root_buffer(comm):
    buf = np.full(1000, comm.rank, np.float32)
    comm.bcast_(buf)
    assert (buf == 0).all()


def test_fused_allreduce_equals_mean_of_rank_gradients(comm, replica):
    workers = comm.workers
    if workers is None:
        pytest.skip("rank 0, the parameter server, is not part of the gradient allreduce")
    grad, _, _ = replica.grad(*batch(100 + workers.rank))
    every = np.stack(workers.allgather_objects(grad.copy()))
    before = dict(comm.traffic.sent_bytes)
    workers.allreduce_mean_(grad)
    np.testing.assert_allclose(grad, every.mean(axis=0), rtol=1e-6, atol=1e-9)
    # every rank got the bit-identical result
    assert len(set(workers.allgather_objects(checksum(grad)))) == 1
    if workers.size > 1:
        assert comm.traffic.sent_bytes["allreduce"] - before.get("allreduce", 0) == grad.nbytes


@pytest.mark.parametrize("wait", ["spin", "poll"])
def test_allreduce_sum_is_the_exact_sum_on_every_rank_however_ranks_wait(comm, wait):
    """Both ways of waiting (MPI's blocking allreduce under the watchdog, or the polled
    nonblocking one) give every rank the same bits, and count the traffic exactly."""
    world = Comm.world(timeout=60, allreduce_wait=wait)
    assert (world._spin is not None) == (wait == "spin")
    for n in (1, 7854, 61710):  # one value, LR and LeNet gradient sizes
        mine = np.arange(n, dtype=np.float32) + world.rank  # sums of small integers: exact
        before = world.traffic.sent_bytes["allreduce"]
        world.allreduce_sum_(mine)
        expected = world.size * np.arange(n, dtype=np.float32) + sum(range(world.size))
        np.testing.assert_array_equal(mine, expected)
        if world.size > 1:
            assert world.traffic.sent_bytes["allreduce"] - before == mine.nbytes
    assert len(set(world.allgather_objects(checksum(mine)))) == 1
    # however many communicators spun: one watchdog thread a process
    assert sum(t.name == "mpitrain blocking-call watchdog" for t in threading.enumerate()) <= 1


def test_auto_waits_count_the_workers_and_the_load_measured_as_the_job_starts(comm):
    """--allreduce-wait auto: the workers' communicator spins exactly where the workers
    alone (rank 0, the sync server, does not join their allreduce) plus the load every
    rank measured fit in their hosts' cores; the world's counts every rank."""
    import os

    from mpitrain.comm import spins

    world = Comm.world(timeout=TIMEOUT)
    facts = world.allgather_objects((os.cpu_count() or 1, world.others_busy,
                                     world.workers is not None and world.workers.spinning))
    cpus, loads = [f[0] for f in facts], [f[1] or 0.0 for f in facts]
    first = 1 if world.size > 1 else 0
    expected = spins("auto", world.hosts[first:], cpus[first:], [True] * len(cpus[first:]),
                     loads[first:])
    assert [f[2] for f in facts[first:]] == [expected] * (world.size - first)
    assert world.spinning == spins("auto", world.hosts, cpus, [True] * world.size, loads)
    if world.size == 3 and len(set(world.hosts)) == 1 and cpus[0] == 2 and not any(loads):
        assert expected and not world.spinning  # -np 3 on 2 idle cores: 2 workers fit


def test_a_rank_spinning_in_the_allreduce_keeps_calling_while_waiting(comm):
    """A late rank: the others wait inside MPI's blocking allreduce, and the watchdog
    calls their while_waiting about once a second meanwhile (the sync workers'
    heartbeats, which let rank 0 tell them from the one that is late)."""
    if comm.size == 1:
        pytest.skip("no one to wait for at one rank")
    world = Comm.world(timeout=60, allreduce_wait="spin")
    calls = []
    world.while_waiting = lambda: calls.append(time.monotonic())
    if world.rank == 0:
        time.sleep(2.6)
    buf = np.ones(10, np.float32)
    world.allreduce_sum_(buf)
    assert (buf == world.size).all()
    if world.rank == 0:
        assert len(calls) < 2  # it came last: it hardly waited
    else:  # waited 2.6 s or more: a call after each second, not more often
        assert len(calls) >= 2 and all(b - a > 0.8 for a, b in zip(calls, calls[1:]))


def test_half_precision_allreduce_is_the_sum_in_half_the_bytes_on_every_rank(comm):
    size = 12 * 5 * 7  # divisible by every -np up to 4 (the caller pads)
    rng = np.random.default_rng(comm.rank)
    mine = (rng.standard_normal(size) * 1e-2).astype(np.float16)
    every = np.stack(comm.allgather_objects(mine)).astype(np.float64)
    out = np.zeros(size, np.float32)
    before = comm.traffic.sent_bytes["allreduce"]
    comm.allreduce_sum_half_(mine, out)
    # the float32 sum, but for the float16 rounding of the sum on the way back
    np.testing.assert_allclose(out, every.sum(axis=0), rtol=2e-3, atol=1e-6)
    assert len(set(comm.allgather_objects(checksum(out)))) == 1  # bit-identical everywhere
    if comm.size > 1:
        assert comm.traffic.sent_bytes["allreduce"] - before == mine.nbytes == 2 * size
        with pytest.raises(ValueError, match="divisible"):  # equal segments, or no exchange
            comm.allreduce_sum_half_(np.zeros(comm.size + 1, np.float16),
                                      np.zeros(comm.size + 1, np.float32))


def test_replicas_identical_after_k_steps(comm, any_replica):
    """Every model: after k sync steps all workers hold bit-identical weights."""
    replica = any_replica
    start = np.zeros(replica.n_params, np.float32)
    if comm.rank == 0:
        start[:] = np.random.default_rng(5).standard_normal(replica.n_params) * 0.01
    comm.bcast_(start)
    replica.set_weights(start)
    workers = comm.workers
    if workers is not None:
        for step in range(3):
            grad, _, _ = replica.grad(*replica.batch(1000 * step + workers.rank))
            workers.allreduce_mean_(grad)
            replica.apply(grad)
    sums = comm.allgather_objects(checksum(replica.weights()))
    worker_sums = sums if comm.size == 1 else sums[1:]
    assert len(set(worker_sums)) == 1
    if comm.size > 1:  # the server did not train: it must still hold the start weights
        assert sums[0] == checksum(start)


def test_point_to_point_ring(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = np.full(10, comm.rank, np.float32)
    got = np.empty(10, np.float32)
    recv = comm.irecv(got, left, 7, "control", "the ring message")
    send = comm.isend(out, right, 7, "control", "the ring message")
    comm.wait_all([recv, send])
    assert (got == left).all()


def test_persistent_ring_carries_each_start_and_counts_it(comm):
    """Persistent sends and receives made once and started three times: each start
    carries that round's data, a receive may be longer than the message, and each
    start is counted like an isend's (and each completion like an irecv's)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out, got = np.empty(10, np.float32), np.empty(12, np.float32)
    send = comm.send_init(out, right, 8, "control", "the persistent ring message")
    recv = comm.recv_init(got, left, 8, "control", "the persistent ring message")
    assert send.test() and recv.test()  # not started: nothing to wait for
    before = comm.traffic.rows()
    for round_ in range(3):
        out[:] = 100 * round_ + comm.rank
        comm.wait_all([comm.start(recv), comm.start(send)])
        assert (got[:10] == 100 * round_ + left).all()
    after = {r["kind"]: r for r in comm.traffic.rows()}["control"]
    start = {r["kind"]: r for r in before}.get("control", {})
    for column in ("sent_bytes", "recv_bytes"):
        assert after[column] - start.get(column, 0) == 3 * out.nbytes
    assert after["sent_msgs"] - start.get("sent_msgs", 0) == 3


def test_a_matched_receive_takes_its_buffer_once_the_message_is_there(comm):
    """Comm.matched_recv (the pooled async server's receive): no buffer until the message
    came; then the size it asks a buffer for is the message's, and a lender that says
    None (every buffer lent) leaves the message matched, received at a later test.
    Counted like any receive; one with nothing matched cancels at once."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = np.full(10, comm.rank, np.float32)
    asked, spare = [], np.empty(16, np.float32)

    def lend(nbytes):
        asked.append(nbytes)
        return spare if len(asked) > 2 else None  # (twice none free)

    before = comm.traffic.rows()
    got = comm.matched_recv(left, 9, "control", "the ring message", lend)
    assert got.buffer is None
    comm.wait_all([got, comm.isend(out, right, 9, "control", "the ring message")])
    assert asked == [40, 40, 40] and got.buffer is spare and (spare[:10] == left).all()
    after = {r["kind"]: r for r in comm.traffic.rows()}["control"]
    start = {r["kind"]: r for r in before}.get("control", {})
    assert after["recv_bytes"] - start.get("recv_bytes", 0) == 40
    never = comm.matched_recv(left, 99, "control", "a message nobody sends", lend)
    assert not never.test()
    comm.cancel(never)
    assert never.done and never.buffer is None
    comm.barrier()


def test_a_memory_file_is_shared_with_rank_0_by_the_workers_on_its_host(comm):
    """share_with_server: every worker here runs on rank 0's host, so rank 0 maps every
    worker's slots and sees what the worker wrote into them, and the other way round."""
    lengths = [7, 3000]
    mine, theirs, sharing = shared.share_with_server(comm, lengths)
    assert sharing == list(range(1, comm.size))
    if comm.rank == 0:
        assert mine == [] and sorted(theirs) == sharing
    else:
        assert [s.size for s in mine] == lengths and theirs == {}
        assert all(s.ctypes.data % mmap.PAGESIZE == 0 for s in mine)
        mine[1][:] = comm.rank
    comm.barrier()
    if comm.rank == 0:
        for rank, slots in theirs.items():
            assert (slots[1] == rank).all()
            slots[0][:] = -rank
    comm.barrier()
    if comm.rank:
        assert (mine[0] == -comm.rank).all()


def test_agree_raises_first_failure_everywhere(comm):
    failing = comm.size - 1
    error = DataError("file x is corrupt") if comm.rank == failing else None
    where = "" if comm.size == 1 else f"rank {failing} on .*: "
    with pytest.raises(DataError, match=where + "file x is corrupt") as info:
        comm.agree(error)
    assert info.value.everywhere
    comm.agree(None)  # and a clean phase passes


def test_wait_is_bounded_and_names_the_peer(comm):
    short = comm.with_timeout(0.3)
    never = np.empty(1, np.float32)
    pending = short.irecv(never, comm.rank, 99, "control", "a message nobody sends")
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match=r"waited 0.3 s for a message nobody sends from rank"):
        short.wait(pending)
    assert time.monotonic() - t0 < 5
    assert short.wait_any([pending], timeout=0.05) is None
    short.cancel(pending)
    comm.barrier()


def test_waiting_does_not_burn_a_core(comm):
    """A rank waiting 1 s for a late peer uses a small fraction of a CPU."""
    if comm.size == 1:
        pytest.skip("needs a peer to wait for: runs under mpirun -np 2+ (test_mpi_tier)")
    buf = np.zeros(1, np.float32)
    if comm.rank == 0:
        cpu0, t0 = time.process_time(), time.perf_counter()
        comm.wait(comm.irecv(buf, 1, 5, "control", "the late message"))
        share = (time.process_time() - cpu0) / (time.perf_counter() - t0)
        assert share < 0.25, f"waiting used {share:.0%} of a core"
    elif comm.rank == 1:
        time.sleep(1.0)
        comm.wait(comm.isend(buf, 0, 5, "control", "the late message"))
    comm.barrier()


def test_gather_objects_brings_every_rank_to_rank_0(comm):
    """Point-to-point gather (telemetry after training): rank 0 gets each rank's object
    in rank order, large payloads too; the others get their own."""
    mine = {"rank": comm.rank, "rows": list(range(5000 * comm.rank))}  # > eager limit
    gathered = comm.gather_objects(mine)
    if comm.rank == 0:
        assert [g["rank"] for g in gathered] == list(range(comm.size))
        assert [len(g["rows"]) for g in gathered] == [5000 * r for r in range(comm.size)]
    else:
        assert gathered == [mine]


def test_gather_objects_skips_the_ranks_rank_0_names(comm):
    """A rank rank 0 skips (a lost async worker) sends nothing and gets None in its slot;
    the others are still gathered."""
    if comm.size < 3:
        pytest.skip("needs a rank to skip and one to gather besides rank 0")
    lost = comm.size - 1
    if comm.rank == lost:
        return_value = None  # this rank plays the lost one: it does not take part
    else:
        return_value = comm.gather_objects(comm.rank, skip=[lost])
    if comm.rank == 0:
        assert return_value == list(range(comm.size - 1)) + [None]
    comm.barrier("after the gather with a skipped rank")


def test_a_communicator_can_be_made_after_a_large_allreduce(comm):
    """The ring algorithm a large allreduce picks (mpitrain.comm.tuning) holds for that
    call only: Open MPI's own nonblocking allreduce (a new communicator's context id)
    and a user's collectives after a run get its default again. Left set, the next
    run's MPI_Comm_split in the same job hung (AlexNet sync, then any run, -np 3).
    Choosing it (MPI_T) leaves MPI's thread level as it was: Open MPI's
    MPI_T_init_thread overwrites it with the level asked for."""
    from mpi4py import MPI

    level = MPI.Query_thread()
    if comm.workers is not None and comm.workers.size > 1:
        comm.workers.allreduce_mean_(np.ones(1 << 19, np.float32))  # 2 MB: the ring
    assert MPI.Query_thread() == level
    again = Comm.world(timeout=20)
    assert again.allgather_objects(again.rank) == list(range(comm.size))


def test_shared_memory_sum_is_the_ordered_sum_on_every_worker(comm):
    """The workers' sum through their shared segment (every worker of this job runs on
    one host): the float32 sum in worker order, bit-identical on every worker, in the
    worker's own buffer; regions under its threshold and buffers outside the segment
    go through MPI. Counted under 'shared' and 'allreduce' exactly."""
    workers = comm.workers
    if workers is None:
        pytest.skip("rank 0, the parameter server, is not part of the gradient sum")
    engine = SharedMemorySum(workers, min_bytes=4096)
    size = 3 * shared.BLOCK + 1001  # several blocks, chunks of uneven length
    buf = engine.fused_buffer(size)
    if workers.size == 1:
        assert buf is None  # one worker: nobody to share with
        return
    assert buf is not None and buf.size == size and not buf.any()
    assert buf.ctypes.data % mmap.PAGESIZE == 0  # what TensorFlow takes without a copy
    rng = np.random.default_rng(workers.rank)
    buf[:] = rng.standard_normal(size).astype(np.float32)
    every = workers.allgather_objects(buf.copy())
    before = dict(comm.traffic.sent_bytes)
    region = buf[17:size - 5]  # (not at the slot's start)
    engine.allreduce_sum_(region)
    expected = every[0][17:size - 5] + every[1][17:size - 5]
    for other in every[2:]:
        expected += other[17:size - 5]
    assert region.tobytes() == expected.tobytes()
    assert buf[:17].tobytes() == every[workers.rank][:17].tobytes()  # the rest untouched
    assert len(set(workers.allgather_objects(checksum(region)))) == 1
    small, private = buf[:16], np.ones(4096, np.float32)  # under the threshold; elsewhere
    engine.allreduce_sum_(small)
    engine.allreduce_sum_(private)
    assert (private == workers.size).all()
    sent = comm.traffic.sent_bytes
    assert sent["shared"] - before.get("shared", 0) == region.nbytes
    assert sent["allreduce"] - before.get("allreduce", 0) == small.nbytes + private.nbytes
