"""Started nonblocking operations (:class:`Pending`, :class:`Persistent`) and the
peers' deaths MPI reports on them (ULFM). Below the waits (:mod:`.waiting`) and the
failure reports (:mod:`.failures`), which both use them; local to this rank."""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Set, Tuple

from .runtime import _load_mpi, before_finalize
from .traffic import Traffic

#: world ranks MPI has reported dead to this process (ULFM: Open MPI 5 under ``mpirun
#: --with-ft ulfm``); see :func:`note_process_failure`
FAILED_RANKS: Set[int] = set()


def process_failure_classes() -> Tuple[int, ...]:
    """The MPI error classes that mean a peer process died (ULFM's: MPI_ERR_PROC_FAILED,
    MPI_ERR_PROC_FAILED_PENDING, MPI_ERR_REVOKED); none where mpi4py has no such names."""
    MPI = _load_mpi()
    return tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                 "ERR_REVOKED") if hasattr(MPI, name))


def is_process_failure(error: BaseException) -> bool:
    """True when ``error`` is MPI saying that a peer process died (see above)."""
    MPI = _load_mpi()
    return isinstance(error, MPI.Exception) and \
        error.Get_error_class() in process_failure_classes()


def note_process_failure() -> None:
    """Acknowledge the failures MPI reported (so that receives from any source go on
    matching the live ranks, as ULFM requires) and add the dead to FAILED_RANKS. Local."""
    MPI = _load_mpi()
    world = MPI.COMM_WORLD
    try:
        world.Ack_failed()
        failed = world.Get_failed()
        try:
            FAILED_RANKS.update(r for r in MPI.Group.Translate_ranks(
                failed, list(range(failed.Get_size())), world.Get_group()) if r >= 0)
        finally:
            failed.Free()
    except (MPI.Exception, NotImplementedError, AttributeError):
        pass


class Pending:
    """A started nonblocking operation, with what it is for (used in timeout messages).

    A receive adds the bytes it actually received (from its MPI status) to the
    traffic table when it completes. One whose peer died (MPI said so: ULFM) is
    ``failed``: it never completes; the wait on it decides what that means (see
    :meth:`Comm._poll`).
    """

    __slots__ = ("request", "what", "peer", "kind", "done", "failed", "_traffic", "_status")

    def __init__(self, request, what: str, peer: Optional[int], kind: str,
                 traffic: Optional[Traffic] = None):
        self.request = request
        self.what = what
        self.peer = peer
        self.kind = kind
        self.done = False
        self.failed = False
        self._traffic = traffic  # set for receives only
        self._status: Any = _load_mpi().Status() if traffic is not None else None

    def test(self) -> bool:
        if self.done or self.failed:
            return self.done
        try:
            if not self.request.Test(self._status):
                return False
        except Exception as error:  # noqa: BLE001 - MPI.Exception, read below
            self._failure(error)
            return False
        self.done = True
        if self._traffic is not None:
            self._traffic.add_recv(self.kind, self._status.Get_count())  # (in bytes)
        return True

    def _failure(self, error: Any) -> None:  # an MPI.Exception, or another Exception
        """``error`` came out of a test: a peer's death MPI reports (ULFM) is noted,
        anything else raised."""
        if not is_process_failure(error):
            raise error
        note_process_failure()
        # a receive from any source stays posted (it matches the live ranks);
        # anything else that involved the dead rank will never complete
        pending = getattr(_load_mpi(), "ERR_PROC_FAILED_PENDING", None)
        self.failed = error.Get_error_class() != pending


class Matched(Pending):
    """A receive whose buffer is chosen once its message is there, not before: a
    matched probe (MPI_Improbe) finds the message from ``peer`` with ``tag`` and takes
    it out of matching, then ``take(nbytes)`` lends the buffer it is received into
    (MPI_Imrecv; ``buffer`` once lent). ``take`` may say None (no buffer free yet): the
    message stays matched, its bytes in its sender's buffer (a large message travels
    by rendezvous), and the next test asks again. So a server need not hold a posted
    receive buffer for every peer that may send: only for the messages that came. One
    message; completed like any :class:`Pending`."""

    __slots__ = ("_comm", "tag", "take", "message", "nbytes", "buffer")

    def __init__(self, mpi_comm, source: int, tag: int, what: str, kind: str,
                 take: Callable[[int], Optional[object]], traffic: Traffic):
        super().__init__(None, what, source, kind, traffic)
        self._comm, self.tag, self.take = mpi_comm, tag, take
        self.message = None  # matched, not received yet
        self.nbytes = 0  # its size
        self.buffer = None  # the buffer it is (being) received into

    def test(self) -> bool:
        if self.request is None and not (self.done or self.failed):
            try:
                if not self._receive():
                    return False
            except Exception as error:  # noqa: BLE001 - MPI.Exception, read in _failure
                self._failure(error)
                return False
        return super().test()

    def _receive(self) -> bool:
        """Start the receive once the message is matched and a buffer lent; whether it
        started."""
        if self.message is None:
            self.message = self._comm.Improbe(self.peer, self.tag, self._status)
            if self.message is None:
                return False
            self.nbytes = self._status.Get_count()
        buffer = self.take(self.nbytes)
        if buffer is None:
            return False
        self.buffer, message, self.message = buffer, self.message, None
        self.request = message.Irecv(buffer)
        return True

    def drop_match(self) -> bool:
        """For a cancel: False if nothing is matched (nothing to cancel); else the receive
        is started (into a buffer of its own if none was lent: a matched message cannot
        be cancelled, only received), to be completed or abandoned like a posted one."""
        if self.request is not None:
            return True
        if self.message is None:
            return False
        self.buffer, message, self.message = bytearray(self.nbytes), self.message, None
        self.request = message.Irecv(self.buffer)
        return True


class Persistent(Pending):
    """A persistent send or receive (MPI_Send_init / MPI_Recv_init on one buffer, peer
    and tag): made once, then started for each message (:meth:`Comm.start`) and
    completed like any :class:`Pending`. Starting one costs a fraction of a new
    Isend or Irecv (no request, buffer or status to make); the async protocol's
    loops start one per message, thousands of times a second. Only a completed (or
    never started) one may be started again, as with any MPI buffer in use."""

    __slots__ = ("sent_bytes",)

    #: every one made in this process and not freed yet (see :func:`free_persistent`)
    allocated: List["Persistent"] = []

    def __init__(self, request, what: str, peer: int, kind: str,
                 traffic: Optional[Traffic] = None, sent_bytes: int = 0):
        super().__init__(request, what, peer, kind, traffic)
        self.done = True  # (not started: nothing to wait for)
        self.sent_bytes = sent_bytes  # a send's bytes per start; 0 for a receive
        Persistent.allocated.append(self)


def free_persistent(cancel: Callable[[Pending], None]) -> int:
    """Free every :class:`Persistent` request of this process, each started one not yet
    complete first given to ``cancel`` (a receive nothing will match: a lost peer's);
    returns how many were freed. MPI requires persistent requests to be freed before
    MPI_Finalize (MPICH prints a line for each one left); the run's end frees them
    (:meth:`Comm.free_requests`). Local."""
    MPI = _load_mpi()
    freed = 0
    while Persistent.allocated:
        op = Persistent.allocated.pop()
        if not op.done and not op.failed:
            cancel(op)
        try:
            op.request.Free()
            freed += 1
        except MPI.Exception:  # a request a lost peer left matched: MPI keeps it
            pass
    return freed


def _free_requests_left() -> None:
    """Free the persistent requests no run's end freed (a script or test that made them
    on a Comm of its own): MPI_Finalize must not find any (MPICH prints a line for each).
    A started one still pending gets a cancel and one second, then is freed all the same."""

    def cancel(op) -> None:
        try:
            op.request.Cancel()
            deadline = time.monotonic() + 1.0
            while not op.request.Test() and time.monotonic() < deadline:
                time.sleep(0.001)
        except _load_mpi().Exception:
            pass

    free_persistent(cancel)


before_finalize(_free_requests_left)
