"""MPI communication for mpitrain: the only package that imports mpi4py.

Trainers receive a :class:`Comm` and use its small verbs; they never touch MPI.

Design rules that every verb here follows:

* **Buffers, not objects, on the hot path.** Gradients and weights move as
  contiguous float32 numpy arrays through mpi4py's uppercase methods, in place.
  Pickled objects (``*_objects``) are for rare metadata exchanges only.
* **Every wait is bounded.** Each operation is started nonblocking and completed
  by :meth:`Comm.wait`, which raises :class:`CommTimeout` naming the operation
  and the peer after ``timeout`` seconds instead of hanging forever. The
  blocking calls, the bootstrap's MPI_Comm_split and the gradient allreduce
  where every rank has a core (:meth:`Comm.allreduce_sum_`), are bounded by a
  watchdog thread that names the call and ends the process
  (:func:`waiting.blocking_call_bound`, :class:`waiting.SpinWatch`).
* **Waiting does not burn a core.** Open MPI's blocking waits busy-poll; on a
  host with more ranks than cores (``-np 4`` on 2 cores) a spinning rank steals
  the core a worker needs, so there the allreduce is polled too.
  :class:`Backoff` yields the core while it polls,
  then sleeps with growing intervals: a sync step takes less time than with
  sleeps alone, and a sleeping parameter server uses little of a core
  (docs/architecture.md, "How a rank waits").
* **Traffic is counted exactly.** Every verb adds its payload bytes and message
  count, by kind (allreduce, push, pull, broadcast, control), to :attr:`traffic`.

Collective verbs must be called by every rank of the communicator in the same
order (the MPI rule); point-to-point verbs name their peer.

The parts, one concern each:

* ``runtime``: loading MPI (the one import of mpi4py), the bounded finalize,
  aborting the job, the launcher's rank and size, :class:`Role`;
* ``pending``: the started operations (:class:`Pending`, :class:`Persistent`) and
  the peers' deaths MPI reports on them;
* ``waiting``: :class:`Backoff` and its policies, the bounded poll loop and its
  timeout message, the bounds around blocking calls;
* ``traffic``: the :class:`Traffic` table;
* ``tuning``: Open MPI's allreduce algorithm by buffer size (MPI_T);
* ``failures``: the one-line failure reports to rank 0;
* ``objects``: the pickled exchanges (allgather, gather, agree), a part of
  :class:`Comm` (its base class);
* ``reductions``: buffer collectives beyond the gradient sum (min/max/product, gathers
  of parts of different lengths, broadcasts of any dtype), for :mod:`mpitrain.horovod`;
* ``processes``: the other ranks' processes on this host (alive, kill, watch);
* ``load``: the cores other processes keep busy on this host, for the wait policy;
* ``shared``: memory ranks of one host share: the workers' sum, and the async
  messages' payloads;
* ``communicator``: :class:`Comm`, which puts them together.

The names below are the package's interface; the rest of mpitrain imports from here.
Settings such as FINALIZE_BOUND are read where they are defined: change them on
their module (``mpitrain.comm.runtime.FINALIZE_BOUND``), not on this package.
"""

from ..errors import CommTimeout, PeerFailure
from .communicator import Comm, spins
from .failures import FAILURE_BYTES, TAG_FAILURE, report_failure
from .objects import TAG_GATHER
from .processes import PeerProcesses
from . import reductions
from .runtime import (FINALIZE_BOUND, Role, abort_world, bound_finalize, open_mpi_4_recovery,
                      finalize, launcher_rank, launcher_world_size, library_versions,
                      recovery_enabled, world_rank_if_running, world_size_if_running)
from .shared import (PeerSlots, SharedMemorySum, one_host, share_with_server,
                     shares_with_server)
from .traffic import Traffic
from .tuning import LargeAllreduceRing
from .pending import Pending, Persistent
from .regroup import StartupWatch, go_on_without
from .waiting import HOT, IDLE, SERVING, WAITING_CALL_EVERY, Backoff, blocking_call_bound

__all__ = [
    "Comm", "spins", "PeerProcesses", "SharedMemorySum", "one_host", "share_with_server",
    "shares_with_server", "PeerSlots", "Role",
    "Traffic", "Pending", "Persistent", "Backoff", "HOT",
    "IDLE", "SERVING",
    "CommTimeout", "PeerFailure", "LargeAllreduceRing", "blocking_call_bound",
    "WAITING_CALL_EVERY", "TAG_FAILURE", "TAG_GATHER",
    "FAILURE_BYTES", "FINALIZE_BOUND",
    "finalize", "bound_finalize", "launcher_rank", "launcher_world_size",
    "recovery_enabled", "world_size_if_running", "world_rank_if_running",
    "abort_world", "report_failure", "library_versions", "reductions",
    "StartupWatch", "go_on_without", "open_mpi_4_recovery",
]
