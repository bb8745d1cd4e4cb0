"""Open MPI's allreduce algorithm, chosen per call by buffer size (through MPI_T)."""

from __future__ import annotations

import os
from typing import Optional

from .runtime import _load_mpi


class LargeAllreduceRing:
    """Picks Open MPI's nonblocking-allreduce algorithm by buffer size, per call.

    Open MPI's libnbc uses a binomial tree for in-place allreduces on fewer than
    four ranks: best for small buffers (LR's and LeNet's gradients), but two to
    four times slower than the ring for large ones (from millions of floats up;
    docs/architecture.md, "The ring for large allreduces"). The choice is the MCA variable
    ``coll_libnbc_iallreduce_algorithm``, which libnbc reads at every call; this
    writes it through the MPI tool interface (MPI_T) around each large call and
    sets the default back right after it. Anything unexpected (another MPI, no
    MPI_T, the user set the variable with ``OMPI_MCA_...``) turns it into a no-op
    and Open MPI's own choice stands.
    Every rank of a collective must make the same choice, which holds when they
    run the same Open MPI build in the same environment (mpirun forwards ``-x``
    variables to all of them).
    """

    VARIABLE = "coll_libnbc_iallreduce_algorithm"
    RING, DEFAULT = 1, 0
    #: buffers of at least this many bytes use the ring
    MIN_BYTES = 1 << 20

    def __init__(self):
        self._write = None
        if "OMPI_MCA_" + self.VARIABLE in os.environ:
            return
        try:
            self._write = self._bind()
        except Exception:  # noqa: BLE001 - an optimisation; never a reason to fail
            self._write = None

    def _bind(self):
        import ctypes
        import ctypes.util

        lib = ctypes.CDLL(None)
        if not hasattr(lib, "MPI_T_cvar_write"):
            lib = ctypes.CDLL(ctypes.util.find_library("mpi") or "libmpi.so.40")
        provided, index = ctypes.c_int(), ctypes.c_int()
        handle, count = ctypes.c_void_p(), ctypes.c_int()
        # Ask for the thread level MPI already runs at: Open MPI 4.1's MPI_T_init_thread
        # overwrites the library's level with the one asked for (asking for
        # MPI_THREAD_SINGLE turned MPI_Query_thread from MULTIPLE to SINGLE, and with it
        # Open MPI's own locking off, under the watchdog's calls from a second thread).
        if (lib.MPI_T_init_thread(_load_mpi().Query_thread(), ctypes.byref(provided))
                or lib.MPI_T_cvar_get_index(self.VARIABLE.encode(), ctypes.byref(index))
                or lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle),
                                               ctypes.byref(count)) or count.value != 1):
            return None
        value = ctypes.c_int()

        def write(algorithm: int) -> bool:
            value.value = algorithm
            return lib.MPI_T_cvar_write(handle, ctypes.byref(value)) == 0

        return write if write(self.DEFAULT) else None

    def iallreduce_sum(self, mpi_comm, buf):
        """Start an in-place nonblocking sum of ``buf`` on ``mpi_comm``; its request.

        A large buffer gets the ring for this call only (libnbc reads the variable
        when the call starts). Every other collective, Open MPI's own included (the
        nonblocking allreduce that agrees on a new communicator's context id: with
        the ring left set, an MPI_Comm_split at -np 3 hung), and the user's after the
        run, gets the default. Every rank of the collective must call it with the
        same size (they then agree on the algorithm)."""
        MPI = _load_mpi()
        ring = self._write is not None and buf.nbytes >= self.MIN_BYTES
        if ring and not self._write(self.RING):
            self._write, ring = None, False
        try:
            return mpi_comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        finally:
            if ring and not self._write(self.DEFAULT):
                self._write = None


_ALGORITHM: Optional[LargeAllreduceRing] = None


def allreduce_algorithm() -> LargeAllreduceRing:
    """The process's one :class:`LargeAllreduceRing` (MPI_T state is per process)."""
    global _ALGORITHM
    if _ALGORITHM is None:
        _ALGORITHM = LargeAllreduceRing()
    return _ALGORITHM
