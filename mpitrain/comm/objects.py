"""The rare metadata exchanges, as pickled objects: never on the hot path.

:class:`ObjectExchanges` is a base class of :class:`~.communicator.Comm`: its methods
are made of the communicator's bounded, traffic-counting verbs (``wait``, ``isend``,
``irecv``, ``traffic``, ...), so this module needs nothing of the communicator's.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from ..errors import MpitrainError
from .pending import Pending
from .runtime import _load_mpi
from .waiting import IDLE

#: tag of :meth:`ObjectExchanges.gather_objects`
TAG_GATHER = 78


class ObjectExchanges:
    """The pickled exchanges of a :class:`~.communicator.Comm` (its base class)."""

    if TYPE_CHECKING:  # the communicator's, which these exchanges are made of
        rank: int
        size: int
        traffic: Any
        name: Callable[[int], str]
        wait: Callable[..., Any]
        wait_all: Callable[..., Any]
        isend: Callable[..., Pending]
        irecv: Callable[..., Pending]

        @property
        def mpi4py_comm(self) -> Any: ...

    def allgather_objects(self, obj, kind: str = "control") -> list:
        """Every rank's ``obj``, in rank order, on every rank. Collective, bounded."""
        c = self.mpi4py_comm
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        self.wait(Pending(c.Iallgather(np.array([payload.size], np.int64), sizes),
                          "a metadata exchange (sizes)", None, kind), IDLE)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.wait(Pending(c.Iallgatherv(payload, [out, sizes, offsets, _load_mpi().BYTE]),
                          "a metadata exchange", None, kind), IDLE)
        self.traffic.add_sent(kind, payload.nbytes)
        self.traffic.add_recv(kind, out.nbytes)
        return [pickle.loads(out[o:o + s].tobytes()) for o, s in zip(offsets, sizes)]

    def gather_objects(self, obj, skip: Sequence[int] = (), kind: str = "control") -> list:
        """Every rank's ``obj`` on rank 0 (None in place of the ranks in ``skip``); the
        other ranks get ``[obj]``. Point to point, bounded.

        Unlike the collectives, it still works after ranks were lost (async training
        under ``--enable-recovery``): rank 0 passes the lost ranks in ``skip`` and
        receives from the others only. The ranks that send need not know who was lost.
        """
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        if self.rank != 0:
            size = np.array([payload.size], np.int64)
            self.wait_all([self.isend(size, 0, TAG_GATHER, kind, "rank 0 to take a report"),
                           self.isend(payload, 0, TAG_GATHER, kind, "rank 0 to take a report")],
                          IDLE)
            return [obj]
        gathered = [obj] + [None] * (self.size - 1)
        for source in range(1, self.size):
            if source in skip:
                continue
            size = np.zeros(1, np.int64)
            self.wait(self.irecv(size, source, TAG_GATHER, kind, "a report"), IDLE)
            buf = np.empty(int(size[0]), np.uint8)
            self.wait(self.irecv(buf, source, TAG_GATHER, kind, "a report"), IDLE)
            gathered[source] = pickle.loads(buf.tobytes())
        return gathered

    def agree(self, error: Optional[MpitrainError]) -> None:
        """Collective check that a phase succeeded on every rank.

        Each rank passes the error it hit in the phase (or None). If any rank
        failed, every rank raises the lowest failing rank's error, prefixed with
        where it happened, so rank 0 can print it once and all exit cleanly
        instead of the others waiting forever for the failed one.
        """
        reports = self.allgather_objects(None if error is None else (type(error), str(error)))
        for rank, report in enumerate(reports):
            if report is not None:
                error_type, message = report
                where = "" if self.size == 1 else f"{self.name(rank)}: "
                raise error_type(where + message, everywhere=True)
