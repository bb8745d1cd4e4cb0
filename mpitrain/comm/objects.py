"""The rare metadata exchanges, as pickled objects: never on the hot path.

Each is a function of a :class:`Comm` (whose methods of the same names call them), made
of its bounded, traffic-counting verbs.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from ..errors import MpitrainError
from .runtime import _load_mpi
from .waiting import IDLE, Pending

if TYPE_CHECKING:
    from .communicator import Comm

#: tag of :func:`gather_objects`
TAG_GATHER = 78


def allgather_objects(comm: "Comm", obj, kind: str = "control") -> list:
    """Every rank's ``obj``, in rank order, on every rank. Collective, bounded."""
    c = comm.mpi4py_comm
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = np.zeros(comm.size, dtype=np.int64)
    comm.wait(Pending(c.Iallgather(np.array([payload.size], np.int64), sizes),
                      "a metadata exchange (sizes)", None, kind), IDLE)
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    comm.wait(Pending(c.Iallgatherv(payload, [out, sizes, offsets, _load_mpi().BYTE]),
                      "a metadata exchange", None, kind), IDLE)
    comm.traffic.add_sent(kind, payload.nbytes)
    comm.traffic.add_recv(kind, out.nbytes)
    return [pickle.loads(out[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]


def gather_objects(comm: "Comm", obj, skip: Sequence[int] = (), kind: str = "control") -> list:
    """Every rank's ``obj`` on rank 0 (None in place of the ranks in ``skip``); the
    other ranks get ``[obj]``. Point to point, bounded.

    Unlike the collectives, it still works after ranks were lost (async training
    under ``--enable-recovery``): rank 0 passes the lost ranks in ``skip`` and
    receives from the others only. The ranks that send need not know who was lost.
    """
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    if comm.rank != 0:
        size = np.array([payload.size], np.int64)
        comm.wait_all([comm.isend(size, 0, TAG_GATHER, kind, "rank 0 to take a report"),
                       comm.isend(payload, 0, TAG_GATHER, kind, "rank 0 to take a report")],
                      IDLE)
        return [obj]
    gathered = [obj] + [None] * (comm.size - 1)
    for source in range(1, comm.size):
        if source in skip:
            continue
        size = np.zeros(1, np.int64)
        comm.wait(comm.irecv(size, source, TAG_GATHER, kind, "a report"), IDLE)
        buf = np.empty(int(size[0]), np.uint8)
        comm.wait(comm.irecv(buf, source, TAG_GATHER, kind, "a report"), IDLE)
        gathered[source] = pickle.loads(buf.tobytes())
    return gathered


def agree(comm: "Comm", error: Optional[MpitrainError]) -> None:
    """Collective check that a phase succeeded on every rank.

    Each rank passes the error it hit in the phase (or None). If any rank
    failed, every rank raises the lowest failing rank's error, prefixed with
    where it happened, so rank 0 can print it once and all exit cleanly
    instead of the others waiting forever for the failed one.
    """
    reports = comm.allgather_objects(None if error is None else (type(error), str(error)))
    for rank, report in enumerate(reports):
        if report is not None:
            error_type, message = report
            where = "" if comm.size == 1 else f"{comm.name(rank)}: "
            raise error_type(where + message, everywhere=True)
