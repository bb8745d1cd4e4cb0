"""The workers' sum through shared memory (mpitrain/comm/shared.py): its pure parts.
(On real ranks: tests/mpi/test_collectives.py; from the command line, bit-identical to
MPI's sum: tests/e2e/test_overlap_mpirun.py.)"""

import mmap
import os
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.comm import SharedMemorySum, shared
from mpitrain.config import Config, resolve
from mpitrain.exchange import Plan
from mpitrain.errors import UsageError
from mpitrain import models


@pytest.mark.parametrize("count", [2, 3, 4])
def test_every_slot_gets_the_sum_in_slot_order(count):
    rng = np.random.default_rng(count)
    slots = [rng.standard_normal(1000).astype(np.float32) for _ in range(count)]
    before = [s.copy() for s in slots]
    shared.sum_into_all(slots, 10, 990, np.empty(64, np.float32))  # many blocks, one short
    expected = before[0][10:990] + before[1][10:990]
    for s in before[2:]:
        expected += s[10:990]  # in slot order, float32: the bits every worker must get
    for s, old in zip(slots, before):
        assert s[10:990].tobytes() == expected.tobytes()
        assert s[:10].tobytes() == old[:10].tobytes() and s[990:].tobytes() == old[990:].tobytes()


def test_slots_are_whole_pages():
    assert shared.slot_stride(1) == mmap.PAGESIZE
    assert shared.slot_stride(mmap.PAGESIZE // 4) == mmap.PAGESIZE
    assert shared.slot_stride(mmap.PAGESIZE // 4 + 1) == 2 * mmap.PAGESIZE


def test_only_regions_of_the_own_slot_are_summed_there():
    engine = SharedMemorySum(SimpleNamespace(rank=1, size=2), min_bytes=0)
    engine.slots = [np.zeros(100, np.float32), np.zeros(100, np.float32)]
    mine = engine.slots[1]
    assert engine._offset(mine) == 0 and engine._offset(mine[40:60]) == 40
    assert engine._offset(engine.slots[0]) is None  # another worker's
    assert engine._offset(np.zeros(10, np.float32)) is None  # private memory
    assert engine._offset(mine[::2]) is None  # not contiguous
    assert engine._offset(mine.view(np.int32)) is None


def workers_on(*hosts):
    """A stand-in for the workers' communicator: what the engine choice looks at."""
    return SimpleNamespace(size=len(hosts), hosts=list(hosts), rank=0)


def config(**kw):
    return resolve(Config.of(**kw), models.get("lr").defaults, 3)


@pytest.mark.parametrize("settings,hosts,shares", [
    ({}, ("a", "a"), True),
    ({}, ("a", "b"), False),  # workers on two hosts: MPI
    (dict(shared_memory="off"), ("a", "a"), False),
    (dict(compression="fp16"), ("a", "a"), False),  # float16 on the wire: MPI's
])
def test_the_mpi_engine_shares_memory_where_every_worker_is_on_one_host(settings, hosts, shares):
    decided = Plan.of(config(**settings), [(0, 10)], workers_on(*hosts))
    assert (decided.engine == "shared") == shares and not decided.every_part
    if not shares:
        assert decided.engine == "mpi"
    assert Plan.of(config(shared_memory="on"), [(0, 10)], workers_on("a", "a")).every_part


def test_shared_memory_on_across_hosts_is_one_line():
    with pytest.raises(UsageError, match=r"needs every worker on one host; these run on 2 "
                                         r"\(a, b\): use --shared-memory auto"):
        Plan.of(config(shared_memory="on"), [(0, 10)], workers_on("a", "b"))


@pytest.mark.parametrize("settings,message", [
    (dict(compression="fp16"), "drop --compression fp16"),
    (dict(overlap="off"), "drop --overlap off"),
    (dict(compiler="xla"), "use --compile auto or graph"),
])
def test_shared_memory_on_needs_the_sync_float32_buckets(settings, message):
    with pytest.raises(UsageError, match="--shared-memory on is for the sync mpi engine's "
                                         "float32 buckets; .*" + message):
        config(shared_memory="on", **settings)
    config(shared_memory="auto", **settings)  # auto never refuses



def test_async_takes_shared_memory_on_with_any_compression():
    # the async pushes and leases lie in shared slots whatever their encoding
    for compression in ("none", "fp16"):
        config(shared_memory="on", async_mode=True, compression=compression)


def test_a_memory_file_opened_through_proc_is_the_same_memory():
    nbytes = 3 * shared.PAGE
    fd, mine = shared.new_memory_file("mpitrain-test", nbytes)
    other_fd, theirs = shared.open_memory_file(os.getpid(), fd, nbytes)
    try:
        assert theirs is not None and other_fd >= 0
        lengths = [5, shared.PAGE // 4 + 1]  # the second spills onto a second page
        sizes = [shared.slot_stride(n) for n in lengths]
        written, read = shared._slots(mine, lengths, sizes), shared._slots(theirs, lengths, sizes)
        assert [a.ctypes.data % shared.PAGE for a in written] == [0, 0]
        written[1][:] = np.arange(lengths[1])
        np.testing.assert_array_equal(read[1], np.arange(lengths[1], dtype=np.float32))
        assert read[0].sum() == 0  # slots do not overlap
    finally:
        os.close(fd)
        os.close(other_fd)
    assert shared.open_memory_file(os.getpid(), 10**6, nbytes) == (-1, None)


def test_async_shared_memory_on_with_a_worker_on_another_host_is_one_line():
    from mpitrain.train.asynchronous import mailbox

    hosts = ["a", "a", "b"]
    comm = SimpleNamespace(size=3, hosts=hosts,
                           ranks_on_host=lambda h: [r for r, x in enumerate(hosts) if x == h])
    ctx = SimpleNamespace(comm=comm, cfg=Config.of(shared_memory="on"))
    with pytest.raises(UsageError, match=r"--shared-memory on needs every worker on rank 0's "
                                         r"host \(a\); workers run on b: use --shared-memory "
                                         r"auto"):
        mailbox.share_mailboxes(ctx, [])


def resident_pages(segment: mmap.mmap, nbytes: int) -> int:
    """Pages of ``segment``'s first ``nbytes`` in this process's page tables (its resident
    memory), from /proc/self/pagemap (bit 63: present)."""
    import ctypes
    import struct

    address = ctypes.addressof(ctypes.c_char.from_buffer(segment))
    pages = -(-nbytes // shared.PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // shared.PAGE * 8)
        entries = struct.unpack(f"{pages}Q", f.read(8 * pages))
    return sum(e >> 63 for e in entries)


def test_a_server_forgets_a_slots_pages_and_the_worker_keeps_its_data():
    """A pooled server (mpitrain/train/asynchronous/pool.py) drops a push's pages from its
    page tables once applied: the worker's data stays in the file, and reads alike."""
    lengths = [5 * shared.PAGE // 4, 3]  # a push of 5 pages, a small lease
    sizes = [shared.slot_stride(n) for n in lengths]
    fd, worker = shared.new_memory_file("mpitrain-test", sum(sizes))
    other_fd, mapping = shared.open_memory_file(os.getpid(), fd, sum(sizes))
    try:
        theirs = shared.PeerSlots(other_fd, mapping, lengths, sizes)
        mine = shared._slots(worker, lengths, sizes)
        mine[0][:] = np.arange(lengths[0])
        assert theirs[0].sum() == np.arange(lengths[0], dtype=np.float32).sum()
        touched = resident_pages(mapping, sizes[0])
        theirs.forget(0)
        assert touched == 5 and resident_pages(mapping, sizes[0]) == 0
        np.testing.assert_array_equal(mine[0], np.arange(lengths[0], dtype=np.float32))
        np.testing.assert_array_equal(theirs[0], mine[0])  # mapped again on reading
    finally:
        os.close(fd)


def test_a_server_writes_a_lease_through_the_file_without_mapping_it():
    lengths = [3, 8 + 2 * shared.PAGE // 4]  # a push, a lease of a header and two pages
    sizes = [shared.slot_stride(n) for n in lengths]
    fd, worker = shared.new_memory_file("mpitrain-test", sum(sizes))
    other_fd, mapping = shared.open_memory_file(os.getpid(), fd, sum(sizes))
    try:
        theirs = shared.PeerSlots(other_fd, mapping, lengths, sizes)
        window, lease = theirs.window(1), shared._slots(worker, lengths, sizes)[1]
        assert (window.size, window.nbytes) == (lease.size, lease.nbytes)
        weights = np.arange(lengths[1] - 10, dtype=np.float32)
        window[8:lengths[1] - 2] = weights  # as the store writes a lease: weights...
        window[lengths[1] - 2:] = np.array([-1, -2], np.float32)  # ...then buffers
        np.testing.assert_array_equal(lease[8:-2], weights)  # the worker sees them
        np.testing.assert_array_equal(lease[-2:], [-1, -2])
        assert lease[:8].sum() == 0  # (its header: MPI's)
        assert resident_pages(mapping, sum(sizes)) == 0  # never mapped by the writer
        with pytest.raises(ValueError, match="step 1 and as many values"):
            window[8:10] = np.zeros(3, np.float32)
        with pytest.raises(ValueError, match="step 1"):
            window[0:4:2] = np.zeros(2, np.float32)
    finally:
        os.close(fd)
