"""MPI communication for mpitrain: the only module that imports mpi4py.

Trainers receive a :class:`Comm` and use its small verbs; they never touch MPI.

Design rules that every verb here follows:

* **Buffers, not objects, on the hot path.** Gradients and weights move as
  contiguous float32 numpy arrays through mpi4py's uppercase methods, in place.
  Pickled objects (``*_objects``) are for rare metadata exchanges only.
* **Every wait is bounded.** Each operation is started nonblocking and completed
  by :meth:`Comm.wait`, which raises :class:`CommTimeout` naming the operation
  and the peer after ``timeout`` seconds instead of hanging forever.
* **Waiting does not burn a core.** Open MPI's blocking waits busy-poll; on a
  host with more ranks than cores (``-np 4`` on 2 cores) a spinning rank steals
  the core a worker needs. :class:`Backoff` yields the core while it polls,
  then sleeps with growing intervals. Measured on 2 cores, sync LR, 3 workers:
  Iallreduce with this policy 1.6 ms/step against 2.6 ms with sleeps alone,
  while a sleeping parameter server uses ~1.5% of a core.
* **Traffic is counted exactly.** Every verb adds its payload bytes and message
  count, by kind (allreduce, push, pull, broadcast, control), to :attr:`traffic`.

Collective verbs must be called by every rank of the communicator in the same
order (the MPI rule); point-to-point verbs name their peer.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, List, Optional, Sequence

import numpy as np

from .errors import CommTimeout, MpitrainError, PeerFailure

_MPI = None


#: seconds MPI_Finalize may take before the process leaves without it (see finalize)
FINALIZE_BOUND = 60
_finalize_bound: Optional[float] = None  # set by bound_finalize()


def _load_mpi():
    """Import mpi4py (which initialises MPI) once."""
    global _MPI
    if _MPI is None:
        if recovery_enabled():
            # Open MPI 4.1 opens MPI_Finalize with a PMIx fence over every rank of the
            # job; when a rank has left early (a dropped async worker), that fence
            # waits for it forever about one run in three (measured: LeNet async -np 4,
            # a SIGSTOPped worker dropped and woken). Every message of the protocols is
            # completed before finalizing, so the fence protects nothing here.
            os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")
        from mpi4py import MPI  # noqa: WPS433  (import initialises MPI)

        _MPI = MPI
        # runs before mpi4py's own exit hook, which would call MPI_Finalize unbounded
        atexit.register(finalize)
    return _MPI


def bound_finalize(seconds: float = FINALIZE_BOUND) -> None:
    """Bound the MPI_Finalize at this process's exit by ``seconds``: for programs whose
    ranks all reach their end together (the CLI). A user's script under mpitrain.fit
    keeps MPI's own finalize (bounded only under --enable-recovery): its rank 0 may
    work on long after the other ranks are done and waiting there."""
    global _finalize_bound
    _finalize_bound = seconds


def finalize(bound: Optional[float] = None) -> None:
    """End MPI on this rank (a collective in MPI's terms). With a bound (``bound``, or
    the one set by :func:`bound_finalize`, or FINALIZE_BOUND under --enable-recovery)
    it never waits longer: past it the kernel ends the process (SIGALRM's default
    action), the run's files already written. A no-op when MPI is not running.

    A plain alarm because MPI_Finalize holds the interpreter: no Python thread or
    handler could run while it waits."""
    if not world_size_if_running():
        return
    if bound is None:
        bound = _finalize_bound or (FINALIZE_BOUND if recovery_enabled() else None)
    sys.stdout.flush()
    sys.stderr.flush()
    if bound is None:
        _MPI.Finalize()
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(bound)))
    _MPI.Finalize()
    signal.alarm(0)


def launcher_rank() -> int:
    """This process's rank as told by the launcher's environment, without initialising MPI.

    Lets usage errors be printed once (by rank 0) before MPI starts.
    """
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def launcher_world_size() -> int:
    """The job's size as told by the launcher's environment (1 when run without one)."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 1


class Role(Enum):
    """What a rank does; decided once from (rank, world size)."""

    SINGLE = "single"  # -np 1: trains, evaluates and writes results alone
    SERVER = "server"  # rank 0 of several: owns the canonical model, evaluates, writes
    WORKER = "worker"  # ranks 1..N-1: train on their shard

    @classmethod
    def of(cls, rank: int, size: int) -> "Role":
        if size == 1:
            return cls.SINGLE
        return cls.SERVER if rank == 0 else cls.WORKER

    @property
    def trains(self) -> bool:
        return self is not Role.SERVER

    @property
    def serves(self) -> bool:
        """Owns the canonical model, evaluates and writes results."""
        return self is not Role.WORKER


@dataclass
class Backoff:
    """How a rank polls a request it is waiting on.

    For the first ``yield_for`` seconds, test the request and call
    ``sched_yield`` in between: on a free core that is a spin (no added
    latency); on an oversubscribed host it hands the core to a rank that is
    still computing, the one everybody waits for. After that, sleep between
    tests, doubling from ``first_sleep`` to ``max_sleep``, so a long wait costs
    almost no CPU. Measured, sync LR allreduce on 2 cores: 3 workers 2.6 ms/step
    with sleeps only, 1.6 ms/step with the yield phase; 2 workers 0.98 -> 0.71.
    """

    yield_for: float
    first_sleep: float = 2e-5
    max_sleep: float = 1e-3


#: Workers inside a collective: partners usually arrive within a step's jitter.
HOT = Backoff(yield_for=2e-3)
#: A server, or a rank waiting on something slow (evaluation, a slow worker).
IDLE = Backoff(yield_for=0.0, first_sleep=5e-5, max_sleep=1e-3)
#: The async server between pushes: workers keep computing while it sleeps (their
#: pipeline hides its reply latency), so it polls less often. Measured, async LR
#: at -np 3 and 4: protocol loop 17-19% of a core with a 50 us first sleep,
#: 13-14% with 500 us, at the same update rate.
SERVING = Backoff(yield_for=0.0, first_sleep=5e-4, max_sleep=1e-3)


#: seconds between calls of Comm.while_waiting during a long wait
WAITING_CALL_EVERY = 1.0
#: see Comm._split_workers
WORKERS_TIMEOUT_FACTOR = 1.5
#: tag of the one-line failure reports that ranks send rank 0 before the job ends
TAG_FAILURE = 77
#: tag of :meth:`Comm.gather_objects`
TAG_GATHER = 78
FAILURE_BYTES = 2048


@dataclass
class Traffic:
    """Payload bytes and messages through this rank's communication layer, by kind."""

    sent_bytes: dict = field(default_factory=lambda: defaultdict(int))
    sent_msgs: dict = field(default_factory=lambda: defaultdict(int))
    recv_bytes: dict = field(default_factory=lambda: defaultdict(int))
    recv_msgs: dict = field(default_factory=lambda: defaultdict(int))
    #: seconds spent blocked in :meth:`Comm.wait`, by kind
    wait_seconds: dict = field(default_factory=lambda: defaultdict(float))

    def add_sent(self, kind: str, nbytes: int) -> None:
        self.sent_bytes[kind] += nbytes
        self.sent_msgs[kind] += 1

    def add_recv(self, kind: str, nbytes: int) -> None:
        self.recv_bytes[kind] += nbytes
        self.recv_msgs[kind] += 1

    def rows(self) -> List[dict]:
        """One row per kind: kind, sent/received bytes and messages, wait seconds."""
        kinds = sorted(set(self.sent_bytes) | set(self.recv_bytes) | set(self.wait_seconds))
        return [{"kind": k, "sent_bytes": self.sent_bytes[k], "sent_msgs": self.sent_msgs[k],
                 "recv_bytes": self.recv_bytes[k], "recv_msgs": self.recv_msgs[k],
                 "wait_s": round(self.wait_seconds[k], 6)} for k in kinds]


class Pending:
    """A started nonblocking operation, with what it is for (used in timeout messages).

    A receive adds the bytes it actually received (from its MPI status) to the
    traffic table when it completes.
    """

    __slots__ = ("request", "what", "peer", "kind", "done", "_traffic", "_status")

    def __init__(self, request, what: str, peer: Optional[int], kind: str,
                 traffic: Optional["Traffic"] = None):
        self.request = request
        self.what = what
        self.peer = peer
        self.kind = kind
        self.done = False
        self._traffic = traffic  # set for receives only
        self._status = _load_mpi().Status() if traffic is not None else None

    def test(self) -> bool:
        if not self.done and self.request.Test(self._status):
            self.done = True
            if self._traffic is not None:
                self._traffic.add_recv(self.kind, self._status.Get_count(_load_mpi().BYTE))
        return self.done


class LargeAllreduceRing:
    """Picks Open MPI's nonblocking-allreduce algorithm by buffer size, per call.

    Open MPI's libnbc uses a binomial tree for in-place allreduces on fewer than
    four ranks: best for small buffers, but an AlexNet-sized gradient (244 MB) at
    two workers took 250-500 ms against 123-128 ms with the ring (measured side by
    side in one job; 4M floats: 8-9 ms vs 3 ms; LR and LeNet sizes: the tree wins,
    0.06 vs 0.10 ms). The choice is the MCA variable
    ``coll_libnbc_iallreduce_algorithm``, which libnbc reads at every call; this
    writes it through the MPI tool interface (MPI_T) only when the size class
    changes. Anything unexpected (another MPI, no MPI_T, the user set the variable
    with ``OMPI_MCA_...``) turns it into a no-op and Open MPI's own choice stands.
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
        self._current = self.DEFAULT
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
        if (lib.MPI_T_init_thread(0, ctypes.byref(provided))
                or lib.MPI_T_cvar_get_index(self.VARIABLE.encode(), ctypes.byref(index))
                or lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle),
                                               ctypes.byref(count)) or count.value != 1):
            return None
        value = ctypes.c_int()

        def write(algorithm: int) -> bool:
            value.value = algorithm
            return lib.MPI_T_cvar_write(handle, ctypes.byref(value)) == 0

        return write if write(self.DEFAULT) else None

    def before(self, nbytes: int) -> None:
        """Call before starting an allreduce of ``nbytes``; every rank of the
        collective must call it with the same size (they then agree on the algorithm)."""
        wanted = self.RING if nbytes >= self.MIN_BYTES else self.DEFAULT
        if self._write is not None and wanted != self._current:
            if not self._write(wanted):
                self._write = None
                return
            self._current = wanted


_ALGORITHM: Optional[LargeAllreduceRing] = None


def _allreduce_algorithm() -> LargeAllreduceRing:
    """The process's one :class:`LargeAllreduceRing` (MPI_T state is per process)."""
    global _ALGORITHM
    if _ALGORITHM is None:
        _ALGORITHM = LargeAllreduceRing()
    return _ALGORITHM


class Comm:
    """A bounded, traffic-counting view of one MPI communicator.

    ``Comm.world()`` wraps MPI_COMM_WORLD; :attr:`workers` is the communicator of
    the ranks that train (every rank but 0, or the single rank at -np 1) and is
    ``None`` on the server. All views of a process share one :class:`Traffic`.
    """

    def __init__(self, mpi_comm, timeout: float, traffic: Traffic, hosts: Sequence[str],
                 world_ranks: Sequence[int]):
        self._c = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.timeout = float(timeout)
        self.traffic = traffic
        #: host name of every rank of this communicator, by its rank here
        self.hosts: List[str] = list(hosts)
        #: world rank of every rank of this communicator (for messages that name ranks)
        self.world_ranks: List[int] = list(world_ranks)
        self.host: str = self.hosts[self.rank]
        self._workers: Optional[Comm] = None
        #: called about once a second while this rank is blocked in a wait, so a
        #: protocol can tell a watcher "alive, waiting" (the sync workers do)
        self.while_waiting: Optional[Callable[[], None]] = None
        self._failures: Optional[Pending] = None  # rank 0: reports from failing ranks
        #: process id of every rank (world communicator only; for fencing a lost rank)
        self.pids: List[int] = []
        self._failure_buf = np.zeros(FAILURE_BYTES, np.uint8)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def world(cls, timeout: float = 300.0) -> "Comm":
        """Initialise MPI and wrap COMM_WORLD. Every rank must call it (collective)."""
        MPI = _load_mpi()
        c = MPI.COMM_WORLD
        # Host names are exchanged once with a bounded allgather so every rank
        # knows which ranks share its host (threads per rank, per-node telemetry).
        bootstrap = cls(c, timeout, Traffic(), [MPI.Get_processor_name()] * c.Get_size(),
                        range(c.Get_size()))
        where = bootstrap.allgather_objects((MPI.Get_processor_name(), os.getpid()),
                                            kind="control")
        world = cls(c, timeout, bootstrap.traffic, [h for h, _ in where], range(c.Get_size()))
        world.pids = [pid for _, pid in where]
        world._workers = world._split_workers()
        return world

    def _split_workers(self) -> Optional["Comm"]:
        MPI = _load_mpi()
        if self.size == 1:
            return self
        color = 0 if self.rank > 0 else MPI.UNDEFINED
        sub = self._c.Split(color, self.rank)  # collective; returns at once on shared memory
        if sub == MPI.COMM_NULL:
            return None
        # Workers wait for each other longer than rank 0 waits for their heartbeats,
        # so that a stall is reported by rank 0, which can name the silent worker.
        return Comm(sub, WORKERS_TIMEOUT_FACTOR * self.timeout + 2.0, self.traffic,
                    self.hosts[1:], range(1, self.size))

    @property
    def role(self) -> Role:
        return Role.of(self.rank, self.size)

    @property
    def workers(self) -> Optional["Comm"]:
        """The training ranks' communicator; None on the parameter server."""
        return self._workers

    @property
    def mpi4py_comm(self):
        """The underlying mpi4py communicator, for an engine that is itself an MPI
        library (Horovod's init takes one); nothing else of mpitrain may use it."""
        return self._c

    def with_timeout(self, seconds: float) -> "Comm":
        """The same communicator with another wait bound (shares the traffic table)."""
        view = Comm(self._c, seconds, self.traffic, self.hosts, self.world_ranks)
        view.pids = self.pids
        return view

    def name(self, rank: int) -> str:
        """'rank R on HOST' for messages, with R the world rank."""
        return f"rank {self.world_ranks[rank]} on {self.hosts[rank]}"

    def ranks_on_host(self, host: Optional[str] = None) -> List[int]:
        """Ranks of this communicator that run on ``host`` (default: this rank's host)."""
        host = self.host if host is None else host
        return [r for r, h in enumerate(self.hosts) if h == host]

    # ---- waiting ----------------------------------------------------------------------
    def wait(self, pending: Pending, backoff: Backoff = HOT,
             timeout: Optional[float] = None) -> None:
        """Complete ``pending`` or raise :class:`CommTimeout` after ``timeout`` seconds
        (default: the communicator's)."""
        self.wait_all([pending], backoff, timeout)

    def wait_all(self, pendings: Sequence[Pending], backoff: Backoff = HOT,
                 timeout: Optional[float] = None) -> None:
        """Complete every request in ``pendings`` (bounded, see :meth:`wait`)."""
        deadline = time.perf_counter() + (self.timeout if timeout is None else timeout)
        for p in pendings:
            self._poll(p.test, [p], backoff, max(0.0, deadline - time.perf_counter()),
                       timeout_for_message=timeout)

    def wait_any(self, pendings: Sequence[Optional[Pending]], backoff: Backoff = IDLE,
                 timeout: Optional[float] = None) -> Optional[int]:
        """Index of the first of ``pendings`` to complete (None entries are skipped).

        Without ``timeout``, bounded by the communicator's timeout (CommTimeout);
        with it, returns None when ``timeout`` seconds pass with nothing complete,
        so a server can decide itself which silent peer to name.
        """
        live = [(i, p) for i, p in enumerate(pendings) if p is not None]
        if not live:
            raise ValueError("wait_any needs at least one pending request")
        for i, p in live:
            if p.done:
                return i
        live_pendings = [p for _, p in live]
        found: List[int] = []

        def any_done() -> bool:
            # One MPI_Test per request, not one MPI_Testany for all: each Test drives
            # Open MPI's progress engine once, and a ~31 KB shared-memory message
            # needs several progress calls. Measured, async LR -np 3: 2430 updates/s
            # with Test per request, 1780 with Testany.
            for j, p in enumerate(live_pendings):
                if p.test():
                    found.append(live[j][0])
                    return True
            return False

        if not self._poll(any_done, live_pendings, backoff, timeout,
                          raise_on_timeout=timeout is None):
            return None
        return found[0]

    def _poll(self, done: Callable[[], bool], pendings: Sequence[Pending], backoff: Backoff,
              timeout: Optional[float] = None, raise_on_timeout: bool = True,
              timeout_for_message: Optional[float] = None) -> bool:
        if done():
            return True
        start = time.perf_counter()
        deadline = start + (self.timeout if timeout is None else timeout)
        yield_until = start + backoff.yield_for
        next_call = start + WAITING_CALL_EVERY
        sleep = backoff.first_sleep
        now = start
        while True:
            if now < yield_until:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2.0, backoff.max_sleep)
            if done():
                break
            if self._failures is not None and self._failures.test():
                raise self._peer_failure()
            now = time.perf_counter()
            if now >= next_call and self.while_waiting is not None:
                next_call = now + WAITING_CALL_EVERY
                self.while_waiting()
            if now > deadline:
                self.traffic.wait_seconds[pendings[0].kind] += now - start
                if raise_on_timeout:
                    raise self._timeout_error(pendings, timeout_for_message or self.timeout)
                return False
        self.traffic.wait_seconds[pendings[0].kind] += time.perf_counter() - start
        return True

    def _timeout_error(self, pendings: Sequence[Pending], seconds: float) -> CommTimeout:
        waiting = [p for p in pendings if not p.done] or list(pendings)
        p = waiting[0]
        peer = f" from {self.name(p.peer)}" if p.peer is not None else ""
        return CommTimeout(
            f"{self.name(self.rank)} waited {seconds:g} s for {p.what}{peer}; "
            f"that rank is stalled or dead (raise --timeout if this step is legitimately slower)")

    # ---- collectives on buffers -------------------------------------------------------
    def bcast_(self, buf: np.ndarray, root: int = 0, kind: str = "broadcast",
               backoff: Backoff = HOT) -> np.ndarray:
        """Overwrite ``buf`` on every rank with root's ``buf``. Collective."""
        if self.size > 1:
            p = Pending(self._c.Ibcast(buf, root=root), f"{kind} from {self.name(root)}",
                        None, kind)
            self.wait(p, backoff)
            if self.rank == root:
                self.traffic.add_sent(kind, buf.nbytes)
            else:
                self.traffic.add_recv(kind, buf.nbytes)
        return buf

    def allreduce_mean_(self, buf: np.ndarray, what: str = "the gradient allreduce",
                        kind: str = "allreduce") -> np.ndarray:
        """Replace ``buf`` on every rank by the mean of all ranks' ``buf``, in place.

        One MPI allreduce on the whole (fused) buffer. Collective: every rank of
        this communicator calls it with a buffer of the same size and dtype; every
        rank gets the bit-identical result (MPI's reductions deliver the same sum to
        all ranks), which keeps sync replicas identical.
        """
        if self.size > 1:
            MPI = _load_mpi()
            _allreduce_algorithm().before(buf.nbytes)
            p = Pending(self._c.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM), what, None, kind)
            self.wait(p, HOT)
            self.traffic.add_sent(kind, buf.nbytes)
            self.traffic.add_recv(kind, buf.nbytes)
            buf *= np.float32(1.0 / self.size) if buf.dtype == np.float32 else 1.0 / self.size
        return buf

    def barrier(self, what: str = "a barrier", backoff: Backoff = IDLE) -> None:
        """Wait until every rank has arrived (bounded). Collective."""
        if self.size > 1:
            self.wait(Pending(self._c.Ibarrier(), what, None, "control"), backoff)

    # ---- point to point on buffers ----------------------------------------------------
    def isend(self, buf: np.ndarray, dest: int, tag: int, kind: str, what: str) -> Pending:
        """Start sending ``buf`` to ``dest``; ``buf`` must not change until completed."""
        self.traffic.add_sent(kind, buf.nbytes)
        return Pending(self._c.Isend(buf, dest=dest, tag=tag), what, dest, kind)

    def irecv(self, buf: np.ndarray, source: int, tag: int, kind: str, what: str) -> Pending:
        """Post a receive into ``buf`` (a message may be shorter) from ``source``."""
        return Pending(self._c.Irecv(buf, source=source, tag=tag), what, source, kind,
                       traffic=self.traffic)

    def cancel(self, pending: Optional[Pending]) -> None:
        """Cancel a posted receive that will never be matched, so none is left at exit."""
        if pending is None or pending.done:
            return
        pending.request.Cancel()
        self._poll(lambda: bool(pending.request.Test()), [pending], IDLE, timeout=10.0,
                   timeout_for_message=10.0)
        pending.done = True

    # ---- failures of other ranks ------------------------------------------------------
    def listen_for_failures(self) -> None:
        """On rank 0: from now on every wait also notices a failure report from any rank.

        A rank that hits an error only it knows about (a timeout, a crash) sends
        a one-line report (:func:`report_failure`) before the job is aborted, so
        rank 0 can record the run as failed with the reason.
        """
        self._failures = Pending(self._c.Irecv(self._failure_buf, source=_load_mpi().ANY_SOURCE,
                                               tag=TAG_FAILURE),
                                 "a failure report", None, "control")

    def stop_listening(self) -> None:
        self.cancel(self._failures)
        self._failures = None

    def _peer_failure(self) -> PeerFailure:
        self._failures = None
        text = bytes(self._failure_buf).split(b"\0", 1)[0].decode(errors="replace")
        return PeerFailure(text)

    # ---- rare metadata exchanges (pickled objects) ------------------------------------
    def allgather_objects(self, obj, kind: str = "control") -> list:
        """Every rank's ``obj``, in rank order, on every rank. Collective, bounded."""
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        self.wait(Pending(self._c.Iallgather(np.array([payload.size], np.int64), sizes),
                          "a metadata exchange (sizes)", None, kind), IDLE)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.wait(Pending(self._c.Iallgatherv(payload, [out, sizes, offsets, _load_mpi().BYTE]),
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
        reports = self.allgather_objects(
            None if error is None else (type(error), str(error)))
        for rank, report in enumerate(reports):
            if report is not None:
                error_type, message = report
                where = "" if self.size == 1 else f"{self.name(rank)}: "
                error = error_type(where + message)
                error.everywhere = True
                raise error


def recovery_enabled() -> bool:
    """True when the job runs under ``mpirun --enable-recovery`` (Open MPI 4.x), which
    keeps the other ranks running after one dies; an async server may then go on
    without a lost worker instead of ending the job."""
    value = os.environ.get("OMPI_MCA_orte_enable_recovery", "").lower()
    return value in ("1", "true", "yes", "on")


def world_size_if_running() -> int:
    """Size of MPI_COMM_WORLD if MPI was initialised (and not finalised), else 0."""
    if _MPI is None or not _MPI.Is_initialized() or _MPI.Is_finalized():
        return 0
    return _MPI.COMM_WORLD.Get_size()


def world_rank_if_running() -> int:
    """This process's world rank if MPI is running, else the launcher's rank."""
    return _MPI.COMM_WORLD.Get_rank() if world_size_if_running() else launcher_rank()


#: the processes that start ranks: mpirun on its own host, its daemon on the others
OPEN_MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "orted")


def abort_world(code: int) -> None:
    """Abort every rank of the job (no-op when MPI is not running).

    Under ``mpirun --enable-recovery`` MPI_Abort ends only the calling process and the
    others run on (and a SIGSTOPped rank would keep mpirun waiting forever), so the
    job is ended through the process that started this rank instead: mpirun, or its
    daemon on another host, ends the whole job on SIGTERM (measured: 2.5 s, with a
    stopped rank too).
    """
    if world_size_if_running():
        sys.stdout.flush()
        sys.stderr.flush()
        if recovery_enabled() and _parent_name() in OPEN_MPI_LAUNCHERS:
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(30.0)  # mpirun ends this process meanwhile; else abort below
        _MPI.COMM_WORLD.Abort(code)


def _parent_name() -> str:
    try:
        with open(f"/proc/{os.getppid()}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def report_failure(message: str, grace: float = 3.0) -> None:
    """Tell rank 0 why this rank is failing, then give it ``grace`` seconds to end the job.

    Rank 0 records the failure and aborts the job (which ends this process too);
    if it cannot (it is dead or stalled), this returns and the caller aborts.
    """
    if not world_size_if_running() or _MPI.COMM_WORLD.Get_rank() == 0:
        return
    payload = np.zeros(FAILURE_BYTES, np.uint8)
    raw = message.encode()[:FAILURE_BYTES - 1]
    payload[:len(raw)] = np.frombuffer(raw, np.uint8)
    request = _MPI.COMM_WORLD.Isend(payload, dest=0, tag=TAG_FAILURE)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if request.Test():
            time.sleep(max(0.0, deadline - time.monotonic()))  # rank 0 aborts us meanwhile
            return
        time.sleep(0.01)


def library_versions() -> dict:
    """Versions of mpi4py and the MPI library this process runs on."""
    MPI = _load_mpi()
    import mpi4py

    return {"mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
            "mpi_standard": "%d.%d" % MPI.Get_version()}
