"""Memory that ranks of one host share, instead of MPI messages.

Two uses, both on anonymous memory files (:func:`new_memory_file`: nothing is left
behind, even by a killed run):

* **The sync workers' sum** (:class:`SharedMemorySum`), where every worker runs
  on one host; below.
* **The async messages' payloads** (:func:`share_with_server`): each worker on
  rank 0's host keeps its pushes and leases in slots rank 0 maps too, so only
  their headers go through MPI (:class:`mpitrain.train.asynchronous.Mailbox`); a
  server of a large model keeps them out of its own resident memory
  (:class:`PeerSlots`).

Open MPI's shared-memory transport moves an allreduce's bytes through its own
buffers: each rank copies its half in, the other copies it out, sums it, and the
sum travels back the same way. Workers that map one segment need none of that:
each worker's fused gradient buffer is its slot in the segment (the gradient
step writes straight into it), and a sum is one pass: every worker adds up its
chunk of the region over all the slots, in worker order, and writes that sum into
every slot. Each value is summed once, by one worker, in one order, so every
worker ends with the bit-identical sum, as with MPI's allreduce (with two
workers the very bits of MPI's ``a + b``). Why: docs/architecture.md, "The workers'
sum through shared memory".

Cross-rank contract: :meth:`SharedMemorySum.fused_buffer` and every
:meth:`SharedMemorySum.allreduce_sum_` are collective over the workers, called in
the same order with the same region. Both waits of a sum (for every worker's
region to be written, then for every chunk to be summed) are the communicator's
bounded barriers, so a dead or stalled worker is named there as in any
allreduce, and the heartbeats go on while a worker waits.
"""

from __future__ import annotations

import mmap
import os
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .waiting import HOT, IDLE

#: regions smaller than this go through MPI ('auto'): two barriers cost more than
#: moving them
SHARED_MIN_BYTES = 1 << 20
#: values summed per pass: a block stays in the cache between its sum and its copies
BLOCK = 1 << 16
PAGE = mmap.PAGESIZE
#: the traffic table's kind for bytes summed through the shared segment
KIND = "shared"


def one_host(worker_comm) -> bool:
    """Whether every worker of ``worker_comm`` (a :class:`~.communicator.Comm`) runs on one
    host: only then can they share memory."""
    return worker_comm.size > 1 and len(set(worker_comm.hosts)) == 1


class SharedMemorySum:
    """The mpi gradient engine for workers that share a host: sums through one shared
    segment, with the contract of :meth:`~.communicator.Comm.allreduce_sum_`.

    A region is summed through the segment when it lies in this worker's slot
    (:meth:`fused_buffer`) and has ``min_bytes`` or more; any other buffer, and
    every sum when the segment could not be mapped, goes through MPI on
    ``worker_comm``, so the engine never changes what a caller gets, only how.
    """

    def __init__(self, worker_comm, min_bytes: int = SHARED_MIN_BYTES):
        self.worker_comm = worker_comm
        self.min_bytes = min_bytes
        self.slots: List[np.ndarray] = []  # every worker's buffer, by worker rank
        self._scratch = np.empty(BLOCK, np.float32)

    def fused_buffer(self, size: int) -> Optional[np.ndarray]:
        """This worker's fused buffer: ``size`` float32 in the shared segment, page
        aligned, zeroed; None (on every worker) when the workers could not map one, or
        there is one worker (nobody to share with). Collective over the workers, once."""
        self.slots = map_segment(self.worker_comm, size) if self.worker_comm.size > 1 else []
        return self.slots[self.worker_comm.rank] if self.slots else None

    def allreduce_sum_(self, buf: np.ndarray, what: str = "the gradient allreduce",
                       kind: str = "allreduce", computing: bool = False) -> np.ndarray:
        """Replace ``buf`` on every worker by the sum of every worker's, in place;
        bit-identical on every worker. Collective over the workers."""
        lo = self._offset(buf)
        if lo is None or buf.nbytes < self.min_bytes:
            return self.worker_comm.allreduce_sum_(buf, what, kind, computing)
        worker_comm, size = self.worker_comm, buf.size
        worker_comm.barrier(f"{what} (every worker's gradient written)", HOT, KIND)
        rank, count = worker_comm.rank, worker_comm.size
        sum_into_all(self.slots, lo + rank * size // count, lo + (rank + 1) * size // count,
                     self._scratch)
        worker_comm.barrier(f"{what} (every worker's chunk summed)", HOT, KIND)
        worker_comm.traffic.add_exchanged(KIND, buf.nbytes, 0.0)
        return buf

    def _offset(self, buf: np.ndarray) -> Optional[int]:
        """Where ``buf`` starts in this worker's slot, or None if it is not in it."""
        if not self.slots or buf.dtype != np.float32 or not buf.flags.c_contiguous:
            return None
        mine = self.slots[self.worker_comm.rank]
        start = buf.ctypes.data - mine.ctypes.data
        if start < 0 or start % 4 or start // 4 + buf.size > mine.size:
            return None
        return start // 4


def sum_into_all(slots: List[np.ndarray], lo: int, hi: int, scratch: np.ndarray) -> None:
    """``slots[k][lo:hi] :=`` the sum of every slot's ``[lo:hi]``, added in slot order
    (float32), for every ``k``; a block at a time through ``scratch``."""
    for start in range(lo, hi, scratch.size):
        end = min(hi, start + scratch.size)
        total = scratch[:end - start]
        np.add(slots[0][start:end], slots[1][start:end], out=total)
        for slot in slots[2:]:
            np.add(total, slot[start:end], out=total)
        for slot in slots:
            slot[start:end] = total


def slot_stride(size: int) -> int:
    """Bytes between two workers' slots: ``size`` float32, rounded up to whole pages
    (every slot page aligned: TensorFlow takes it without a copy only when aligned)."""
    return -(-size * 4 // PAGE) * PAGE


def map_segment(worker_comm, size: int) -> List[np.ndarray]:
    """Every worker's slot of ``size`` float32 in one segment all of them map: worker
    0 makes it, the others open it (:func:`new_memory_file`). Empty on every worker if
    one could not. Collective over the workers."""
    stride = slot_stride(size)
    fd, segment = -1, None
    where = np.zeros(2, np.int64)  # worker 0's pid and the file's descriptor
    try:
        if worker_comm.rank == 0:
            fd, segment = new_memory_file("mpitrain-gradients", stride * worker_comm.size)
            where[:] = os.getpid(), fd
    except OSError:  # no memfd here: worker 0 says -1
        where[:] = -1
    worker_comm.bcast_(where, 0, "control", IDLE)
    if worker_comm.rank != 0 and where[0] >= 0:
        fd, segment = open_memory_file(int(where[0]), int(where[1]), stride * worker_comm.size)
    mapped = np.array([1.0 if segment is not None else 0.0], np.float32)
    worker_comm.allreduce_sum_(mapped, "the shared gradient segment's set-up", "control")
    if fd >= 0:  # every worker has mapped it (or given up): the mappings keep it
        os.close(fd)
    if mapped[0] != worker_comm.size or segment is None:  # (mapped everywhere: not None)
        return []
    return [np.frombuffer(segment, np.float32, size, k * stride) for k in range(worker_comm.size)]


def share_with_server(comm, lengths: Sequence[int], server: int = 0,
                      sharers: Optional[Sequence[int]] = None) -> Tuple[
        List[np.ndarray], Dict[int, List[np.ndarray]], List[int]]:
    """Message buffers that rank ``server`` maps, for the workers on its host.

    Each of ``sharers`` (default: every other rank on the server's host) makes a
    segment of page-aligned float32 slots of ``lengths`` (:func:`new_memory_file`)
    and the server opens it, so what one of them
    writes into a slot the other reads in place: a message's payload need not go
    through MPI at all, only a small message saying it is there (the async
    protocol's pushes and leases). MPI's shared-memory transport orders the
    writes before that message for the reader (its memory barriers), as it does
    its own bytes.

    Returns (this worker's slots, or [] when its messages keep going through MPI:
    on another host, or when either side could not map the segment; on the server,
    the slots of every worker that shares them, by rank, each worker's a
    :class:`PeerSlots`; on every rank, the ranks that share). Collective over ``comm``
    (the world), bounded.
    """
    if sharers is None:
        sharers = [r for r in comm.ranks_on_host(comm.hosts[server]) if r != server]
    sizes = [slot_stride(n) for n in lengths]
    fd, segment = -1, None
    if comm.rank in sharers and comm.host == comm.hosts[server]:
        try:
            fd, segment = new_memory_file("mpitrain-messages", sum(sizes))
        except OSError:
            pass
    where = (os.getpid(), fd) if segment is not None else None
    wheres = comm.gather_objects(where) if server == 0 else comm.allgather_objects(where)
    mapped = np.zeros(comm.size, np.int64)  # by rank: 1 if the server maps its segment
    theirs: Dict[int, List[np.ndarray]] = {}
    if comm.rank == server:
        for rank, peer in enumerate(wheres):  # (pid, descriptor) or None, by rank
            if rank != server and peer is not None:
                peer_fd, peer_segment = open_memory_file(peer[0], peer[1], sum(sizes))
                if peer_segment is not None:  # (its descriptor kept: see PeerSlots)
                    theirs[rank] = PeerSlots(peer_fd, peer_segment, lengths, sizes)
                    mapped[rank] = 1
    comm.bcast_(mapped, server, "control", IDLE)
    if fd >= 0:  # rank 0 has opened it (or given up): the mappings keep it
        os.close(fd)
    mine = _slots(segment, lengths, sizes) if mapped[comm.rank] else []
    return mine, theirs, [int(r) for r in np.flatnonzero(mapped)]


class PeerSlots(list):
    """A sharing worker's slots as its server maps them (a list of float32 arrays), with
    the two ways the server keeps them out of its own resident memory, for a large
    model's messages (:mod:`mpitrain.train.asynchronous.pool`):

    * :meth:`forget`: a slot's pages leave the server's page tables (MADV_DONTNEED),
      not the file: the worker's data stays, and the server's next access maps them
      again;
    * :meth:`window`: a slot written through the file (pwrite), never mapped by the
      server at all.

    Pages of the file count in the resident memory of each process that maps them
    while it maps them: kept mapped, every worker's slots would count in the server's.
    The memory file stays open while this object lives (its descriptor, for
    :meth:`window`)."""

    def __init__(self, fd: int, segment: mmap.mmap, lengths: Sequence[int],
                 sizes: Sequence[int]):
        super().__init__(_slots(segment, lengths, sizes))
        self.offsets = [int(o) for o in np.cumsum([0, *sizes[:-1]])]
        self.sizes = list(sizes)
        self._segment = segment
        self._fd = fd
        weakref.finalize(self, os.close, fd)

    def forget(self, i: int) -> None:
        """Slot ``i``'s pages out of this process's page tables (and resident memory);
        its contents stay in the file."""
        self._segment.madvise(mmap.MADV_DONTNEED, self.offsets[i], self.sizes[i])

    def window(self, i: int) -> "FileWindow":
        """Slot ``i``, written through the file (see :class:`FileWindow`)."""
        return FileWindow(self._fd, self.offsets[i], self[i].size)


class FileWindow:
    """A float32 slot of a memory file that this process writes through the file
    (``pwrite``) without mapping it: what it writes never enters its resident memory,
    and costs no page faults (a mapping it unmapped after each write would fault every
    page in again). Write-only: ``window[start:stop] = values`` (a slice of step 1 and
    as many float32 values); :attr:`nbytes` and :attr:`size` as an array's."""

    __slots__ = ("fd", "offset", "size", "nbytes")

    def __init__(self, fd: int, offset: int, size: int):
        self.fd, self.offset, self.size, self.nbytes = fd, offset, size, 4 * size

    def __setitem__(self, index: slice, values: np.ndarray) -> None:
        start, stop, step = index.indices(self.size)
        values = np.ascontiguousarray(values, np.float32)
        if step != 1 or values.size != stop - start:
            raise ValueError(f"a file window takes a slice of step 1 and as many values, "
                             f"not [{start}:{stop}:{step}] = {values.size}")
        data, at = values.data.cast("B"), self.offset + 4 * start
        done = 0
        while done < len(data):  # (one call writes at most ~2 GiB)
            done += os.pwrite(self.fd, data[done:], at + done)


def shares_with_server(comm) -> List[int]:
    """The workers of ``comm`` (the world) on rank 0's host: those that can share."""
    return [r for r in comm.ranks_on_host(comm.hosts[0]) if r != 0]


def _slots(segment, lengths: Sequence[int], sizes: Sequence[int]) -> List[np.ndarray]:
    offsets = np.cumsum([0, *sizes[:-1]])
    return [np.frombuffer(segment, np.float32, n, int(o)) for n, o in zip(lengths, offsets)]


def new_memory_file(name: str, nbytes: int) -> Tuple[int, mmap.mmap]:
    """(descriptor, mapping) of a new anonymous memory file of ``nbytes``: it has no
    name, so it is gone with the last process that maps it (nothing is left behind,
    even by a killed run); another process of this host opens it with
    :func:`open_memory_file`. Raises OSError where there is no memfd."""
    if not hasattr(os, "memfd_create"):
        raise OSError("no memfd_create on this platform")
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        raise


def open_memory_file(pid: int, fd: int, nbytes: int) -> Tuple[int, Optional[mmap.mmap]]:
    """(descriptor, mapping) of process ``pid``'s memory file ``fd`` (through /proc);
    (-1, None) if it cannot be opened or mapped."""
    try:
        mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError:
        return -1, None
    try:
        return mine, mmap.mmap(mine, nbytes)
    except OSError:
        os.close(mine)
        return -1, None
