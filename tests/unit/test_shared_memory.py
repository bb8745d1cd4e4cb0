"""The workers' sum through shared memory (mpitrain/comm/shared.py): its pure parts.
(On real ranks: tests/mpi/test_collectives.py; from the command line, bit-identical to
MPI's sum: tests/e2e/test_overlap_mpirun.py.)"""

import mmap
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.comm import SharedMemorySum, shared
from mpitrain.config import Config, resolve
from mpitrain.engines import gradient_engine
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
    return resolve(Config(**kw), models.get("lr").defaults, 3)


@pytest.mark.parametrize("settings,hosts,shares", [
    ({}, ("a", "a"), True),
    ({}, ("a", "b"), False),  # workers on two hosts: MPI
    (dict(shared_memory="off"), ("a", "a"), False),
    (dict(compression="fp16"), ("a", "a"), False),  # float16 on the wire: MPI's
])
def test_the_mpi_engine_shares_memory_where_every_worker_is_on_one_host(settings, hosts, shares):
    workers = workers_on(*hosts)
    engine = gradient_engine(config(**settings), workers)
    assert isinstance(engine, SharedMemorySum) == shares
    if not shares:
        assert engine is workers
    else:
        assert engine.min_bytes == shared.SHARED_MIN_BYTES
    assert gradient_engine(config(shared_memory="on"), workers_on("a", "a")).min_bytes == 0


def test_shared_memory_on_across_hosts_is_one_line():
    with pytest.raises(UsageError, match=r"needs every worker on one host; these run on 2 "
                                         r"\(a, b\): use --shared-memory auto"):
        gradient_engine(config(shared_memory="on"), workers_on("a", "b"))


@pytest.mark.parametrize("settings,message", [
    (dict(async_mode=True), "drop --async"),
    (dict(compression="fp16"), "drop --compression fp16"),
    (dict(overlap="off"), "drop --overlap off"),
    (dict(compiler="xla"), "use --compile auto or graph"),
])
def test_shared_memory_on_needs_the_sync_float32_buckets(settings, message):
    with pytest.raises(UsageError, match="--shared-memory on is for the sync mpi engine's "
                                         "float32 buckets; .*" + message):
        config(shared_memory="on", **settings)
    config(shared_memory="auto", **settings)  # auto never refuses

