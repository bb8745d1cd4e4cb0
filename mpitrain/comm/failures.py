"""The failure side channel: a rank that hits an error only it knows about (a timeout,
a crash) tells rank 0 why, in one line, before the job is aborted, so rank 0 can record
the run as failed with the reason."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..errors import PeerFailure
from .runtime import _load_mpi, world_size_if_running
from .pending import Pending, is_process_failure

#: tag of the one-line failure reports that ranks send rank 0 before the job ends
TAG_FAILURE = 77
FAILURE_BYTES = 2048


class FailureListener:
    """Rank 0's receive of a failure report from any rank of the job.

    While listening (:meth:`start`), :meth:`check`, which every wait of the
    communicator calls, raises the report as :class:`PeerFailure`. It listens on
    MPI_COMM_WORLD, where :func:`report_failure` sends, whichever communicator the job
    runs on (the world's rank 0 is the job's, also after a loss at start-up:
    :mod:`.regroup`).
    """

    def __init__(self):
        self._c = _load_mpi().COMM_WORLD
        self._buf = np.zeros(FAILURE_BYTES, np.uint8)
        #: the posted receive while listening, else None
        self.pending: Optional[Pending] = None

    def start(self) -> None:
        self.pending = Pending(self._c.Irecv(self._buf, source=_load_mpi().ANY_SOURCE,
                                             tag=TAG_FAILURE),
                               "a failure report", None, "control")

    def check(self) -> None:
        """Raise :class:`PeerFailure` if a report has arrived (and stop listening)."""
        if self.pending is not None and self.pending.test():
            raise self._failure()

    def _failure(self) -> PeerFailure:
        self.pending = None
        text = bytes(self._buf).split(b"\0", 1)[0].decode(errors="replace")
        return PeerFailure(text)


def report_failure(message: str, grace: float = 3.0) -> None:
    """Tell rank 0 why this rank is failing, then give it ``grace`` seconds to end the job.

    Rank 0 records the failure and aborts the job (which ends this process too);
    if it cannot (it is dead or stalled), this returns and the caller aborts.
    """
    if not world_size_if_running():
        return
    world = _load_mpi().COMM_WORLD  # MPI is running: already loaded
    if world.Get_rank() == 0:
        return
    payload = np.zeros(FAILURE_BYTES, np.uint8)
    raw = message.encode()[:FAILURE_BYTES - 1]
    payload[:len(raw)] = np.frombuffer(raw, np.uint8)
    deadline = time.monotonic() + grace
    try:
        request = world.Isend(payload, dest=0, tag=TAG_FAILURE)
        while time.monotonic() < deadline:
            if request.Test():
                time.sleep(max(0.0, deadline - time.monotonic()))  # rank 0 aborts us meanwhile
                return
            time.sleep(0.01)
    except Exception as error:  # noqa: BLE001 - rank 0 is dead (ULFM says so): the caller
        if not is_process_failure(error):  # aborts the job itself
            raise
