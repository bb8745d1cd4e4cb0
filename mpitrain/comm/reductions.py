"""Buffer collectives beyond the gradient sum: any reduction, gathers whose parts differ
in length, a broadcast of any dtype, and what MPI's thread level allows. Used by
:mod:`mpitrain.horovod` (Horovod's ``Min``/``Max``/``Product`` allreduces, ``allgather``,
``broadcast``); each is a function of a :class:`~.communicator.Comm`, made of its bounded
waits and counted in its traffic table, as :mod:`.objects`' exchanges are.

Cross-rank contract of each: collective over the communicator, every rank calling it
in the same order with buffers of the same dtype (and, for :func:`allreduce_`, the same
length); every wait is bounded by the communicator's timeout (:class:`CommTimeout`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from .runtime import _load_mpi
from .pending import Pending
from .waiting import HOT

if TYPE_CHECKING:
    from .communicator import Comm

#: the reductions :func:`allreduce_` knows, by name
OPS = ("sum", "min", "max", "prod")


def allreduce_(comm: "Comm", buf: np.ndarray, op: str = "sum", what: str = "an allreduce",
               kind: str = "allreduce") -> np.ndarray:
    """Replace ``buf`` on every rank by the reduction ``op`` (:data:`OPS`) of every rank's
    ``buf``, in place; bit-identical on every rank. A sum is
    :meth:`Comm.allreduce_sum_` (its blocking or polled wait); the others one
    nonblocking MPI allreduce with MPI's own operation, polled."""
    if op == "sum":
        return comm.allreduce_sum_(buf, what, kind)
    if comm.size == 1:
        return buf
    MPI = _load_mpi()
    mpi_op = {"min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op]
    comm.wait(Pending(comm.mpi4py_comm.Iallreduce(MPI.IN_PLACE, buf, op=mpi_op), what, None,
                      kind), HOT)
    comm.traffic.add_exchanged(kind, buf.nbytes, 0.0)
    return buf


def allgatherv(comm: "Comm", send: np.ndarray, counts: Sequence[int], out: np.ndarray,
               what: str = "an allgather", kind: str = "allgather") -> np.ndarray:
    """``out`` := every rank's ``send`` one after another, in rank order, where rank r's
    holds ``counts[r]`` bytes' worth of ``out``'s elements (``counts`` in elements; the
    same list on every rank). Moves bytes: any dtype, the same on every rank."""
    nbytes = np.asarray(counts, np.int64) * out.itemsize
    if comm.size == 1:
        out.reshape(-1).view(np.uint8)[:] = send.reshape(-1).view(np.uint8)
        return out
    offsets = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
    payload = np.ascontiguousarray(send).reshape(-1).view(np.uint8)
    MPI = _load_mpi()
    comm.wait(Pending(comm.mpi4py_comm.Iallgatherv(
        payload, [out.reshape(-1).view(np.uint8), nbytes, offsets, MPI.BYTE]), what, None, kind),
              HOT)
    comm.traffic.add_sent(kind, payload.nbytes)
    comm.traffic.add_recv(kind, out.nbytes)
    return out


def alltoallv(comm: "Comm", send: np.ndarray, send_counts: np.ndarray,
              recv_counts: np.ndarray, out: np.ndarray, what: str = "an alltoall",
              kind: str = "alltoall") -> np.ndarray:
    """Rank r gets the ``send_counts[r]`` elements of ``send`` that follow those for the
    ranks before it; ``out`` := what every rank sent this one, in rank order, where
    ``recv_counts[r]`` elements came from rank r (counts in elements, which must match
    the senders'). Moves bytes: any dtype, the same on every rank."""
    sent = np.asarray(send_counts, np.int64) * out.itemsize
    got = np.asarray(recv_counts, np.int64) * out.itemsize
    payload = np.ascontiguousarray(send).reshape(-1).view(np.uint8)
    received = out.reshape(-1).view(np.uint8)
    if comm.size == 1:
        received[:] = payload[:got[0]]
        return out
    MPI = _load_mpi()
    comm.wait(Pending(comm.mpi4py_comm.Ialltoallv(
        [payload, sent, np.concatenate([[0], np.cumsum(sent)[:-1]]), MPI.BYTE],
        [received, got, np.concatenate([[0], np.cumsum(got)[:-1]]), MPI.BYTE]),
        what, None, kind), HOT)
    comm.traffic.add_sent(kind, int(sent.sum()))
    comm.traffic.add_recv(kind, int(got.sum()))
    return out


def broadcast_(comm: "Comm", buf: np.ndarray, root: int, what: str = "a broadcast",
               kind: str = "broadcast") -> np.ndarray:
    """Overwrite ``buf`` (contiguous, any dtype) on every rank with root's, as bytes."""
    if comm.size > 1:
        comm.bcast_(buf.reshape(-1).view(np.uint8), root=root, kind=kind, backoff=HOT)
    return buf


def threads_supported() -> bool:
    """True if MPI runs at MPI_THREAD_MULTIPLE (any thread may call it at any time)."""
    MPI = _load_mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE
