"""The communicator: construction and views, buffer collectives, point to point, and
the waits that complete them. Polling, failure reports, pickled exchanges and the
allreduce algorithm are in the sibling modules it delegates to."""

from __future__ import annotations

import functools
import os
import time
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..config.bounds import Bounds
from ..errors import RanksLost
from ..kernels.half import mean_rows_, widen_
from .failures import FailureListener
from .load import others_busy_cores
from .objects import ObjectExchanges
from .runtime import Role, _load_mpi
from .traffic import Traffic
from .tuning import allreduce_algorithm
from .processes import LOOK_EVERY, PeerProcesses, rank_exited, settles
from .pending import (FAILED_RANKS, Matched, Pending, Persistent, free_persistent,
                      is_process_failure, note_process_failure)
from .waiting import (HOT, IDLE, Backoff, SpinWatch, blocking_call_bound, poll, spin_watch,
                      timeout_error)

#: seconds a cancelled receive gets to complete; from a lost peer (see Comm.cancel)
CANCEL_BOUND, LOST_PEER_CANCEL_BOUND = 10.0, 1.0


class Comm(ObjectExchanges):
    """A bounded, traffic-counting view of one MPI communicator.

    ``Comm.world()`` wraps MPI_COMM_WORLD; :attr:`workers` is the communicator of
    the ranks that train (every rank but 0, or the single rank at -np 1) and is
    ``None`` on the server. All views of a process share one :class:`Traffic`. The
    rare exchanges of pickled objects (``allgather_objects``, ``gather_objects``,
    ``agree``) come from :class:`~.objects.ObjectExchanges`.

    Why one class of this size (over the ~250 lines we hold classes to): it is the
    one boundary to MPI, and every primitive the protocols use is a method of it so
    that each goes through the same three rules: a bounded wait (``_poll``), the
    traffic count and the lost-peer handling of :mod:`.pending`. Split by primitive,
    each part would repeat them; what needs none of them (pickled objects, the
    reductions other than sums, shared memory) already lives in its own module.
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
        self._worker_comm: Optional[Comm] = None
        #: called about once a second while this rank is blocked in a wait, so a
        #: protocol can tell a watcher "alive, waiting" (the sync workers do)
        self.while_waiting: Optional[Callable[[], None]] = None
        self._failures = FailureListener()  # rank 0: reports from failing ranks
        self._half: Dict[int, tuple] = {}  # see _half_buffers
        #: the bound on MPI's blocking allreduce when this rank may spin in it, else None
        self._spin: Optional[SpinWatch] = None
        # MPI's blocking in-place sum (SUM: Allreduce's default op), made once
        self._sum_in_place = functools.partial(mpi_comm.Allreduce, _load_mpi().IN_PLACE)
        #: process id of every rank (world communicator only; for fencing a lost rank)
        self.pids: List[int] = []
        #: the run's parameter servers, ranks 0..servers-1 (async --servers), set once by
        #: :meth:`assign_roles`; 1 before it. (Raising on a read before it instead made
        #: rank 0 fail to name a stopped sync worker in test_faults' sync-spin case; which
        #: read did that is not yet found.)
        self.servers: int = 1
        #: how its allreduces wait (``--allreduce-wait``; see :func:`spins`), kept for a
        #: communicator made from this one (:meth:`over`)
        self.allreduce_wait = "auto"
        #: while the job starts, where a loss can be survived: the check of the start-up's
        #: watch (:meth:`.regroup.StartupWatch.check`), which every wait calls; else None
        self.startup_check: Optional[Callable[[], None]] = None
        #: cores other processes kept busy on this rank's host as the job started
        #: (world only; None where it was not measured: see _decide_waits)
        self.others_busy: Optional[float] = None

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def world(cls, timeout: float = 300.0, allreduce_wait: str = "auto",
              start_timeout: Optional[float] = None) -> "Comm":
        """Initialise MPI and wrap COMM_WORLD. Every rank must call it (collective), with
        the same ``allreduce_wait`` (auto, spin or poll: see :func:`spins`). MPI's
        start-up waits at most ``start_timeout`` seconds for the other ranks (default
        :data:`.runtime.START_BOUND`); later calls find MPI started."""
        MPI = _load_mpi(start_timeout)
        return cls.over(MPI.COMM_WORLD, range(MPI.COMM_WORLD.Get_size()), timeout,
                        allreduce_wait)

    @classmethod
    def over(cls, mpi_comm, world_ranks: Sequence[int], timeout: float = 300.0,
             allreduce_wait: str = "auto", traffic: Optional[Traffic] = None) -> "Comm":
        """Wrap ``mpi_comm`` as the job's communicator (its ranks' world ranks in
        ``world_ranks``): the world, or the ranks that go on after a loss at start-up
        (:mod:`.regroup`). Collective over ``mpi_comm``, as :meth:`world`."""
        MPI, c = _load_mpi(), mpi_comm
        # Which ranks share a host (threads per rank, per-node telemetry, shared memory)
        # is MPI's own word (the ranks of one shared-memory communicator), not host names
        # nor a launcher's environment variables; it is exchanged once, with the host
        # names and what decides how ranks wait (see spins), by a bounded allgather.
        bootstrap = cls(c, timeout, traffic or Traffic(),
                        [MPI.Get_processor_name()] * c.Get_size(), world_ranks)
        names, nodes, pids, cpus, thread_multiple = zip(*bootstrap.allgather_objects(
            (MPI.Get_processor_name(), bootstrap._node_leader(), os.getpid(),
             os.cpu_count() or 1, MPI.Query_thread() == MPI.THREAD_MULTIPLE), kind="control"))
        hosts = node_names(names, nodes)
        job = cls(c, timeout, bootstrap.traffic, hosts, world_ranks)
        job.pids, job.allreduce_wait = list(pids), allreduce_wait
        job._worker_comm = job._split_workers()
        job._decide_waits(allreduce_wait, cpus, thread_multiple)
        return job

    def _decide_waits(self, allreduce_wait: str, cpus: Sequence[int],
                      thread_multiple: Sequence[bool]) -> None:
        """Which of the world's and the workers' communicators spin in the allreduce
        (:func:`spins`). The workers' counts the workers alone: the sync
        server does not join their allreduce and, while they train, runs at the lowest
        priority (:mod:`mpitrain.train.priority`). Other processes' load is measured
        only where it can change the answer for a communicator that allreduces (two ranks
        or more), every rank sleeping at once for it (:func:`.load.others_busy_cores`).
        Collective over the world: every rank computes both answers from the same
        gathered values."""
        ranks = {"world": slice(None), "workers": slice(1 if self.size > 1 else 0, None)}
        args = {name: (self.hosts[r], cpus[r], thread_multiple[r]) for name, r in ranks.items()}
        loads = [0.0] * self.size
        if allreduce_wait == "auto" and any(len(a[0]) > 1 and spins("auto", *a)
                                            for a in args.values()):
            self.others_busy = others_busy_cores()
            loads = self.allgather_objects(self.others_busy, kind="control")
        for comm, name in ((self, "world"), (self._worker_comm, "workers")):
            if comm is not None and spins(allreduce_wait, *args[name], loads[ranks[name]]):
                comm._spin = spin_watch(comm.name(comm.rank))

    def _node_leader(self) -> int:
        """The lowest rank of this rank's node: of MPI_Comm_split_type(SHARED), the ranks
        that can share memory with it (collective, bounded like the split below)."""
        MPI = _load_mpi()
        with blocking_call_bound(self.timeout, "the ranks of this host "
                                 "(MPI_Comm_split_type)", self.name(self.rank)):
            node = self._c.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            return MPI.Group.Translate_ranks(node.Get_group(), [0], self._c.Get_group())[0]
        finally:
            node.Free()

    def _split_workers(self) -> Optional["Comm"]:
        MPI = _load_mpi()
        if self.size == 1:
            return self
        color = 0 if self.rank > 0 else MPI.UNDEFINED
        # MPI_Comm_split has no nonblocking form in MPI 3, so it is bounded by a watchdog.
        # The bounded allgather just before it already saw every rank arrive, so a rank
        # missing here has died or stalled in between; it returns at once on shared memory.
        with blocking_call_bound(self.timeout, "the workers' communicator (MPI_Comm_split)",
                                 self.name(self.rank)):
            sub = self._c.Split(color, self.rank)  # collective
        if sub == MPI.COMM_NULL:
            return None
        # Workers wait for each other longer than rank 0 waits for their heartbeats,
        # so that a stall is reported by rank 0, which can name the silent worker.
        return Comm(sub, self.bounds.workers, self.traffic,
                    self.hosts[1:], self.world_ranks[1:])

    @property
    def bounds(self) -> Bounds:
        """Every wait derived from this communicator's ``timeout`` (:class:`Bounds`)."""
        return Bounds(self.timeout)

    def assign_roles(self, servers: int) -> Role:
        """Decide every rank's role once, from the run's ``servers`` (``--servers``: the
        ranks 0..servers-1 serve); returns this rank's. Local (every rank decides alike)."""
        self.servers = servers
        return self.role

    @property
    def role(self) -> Role:
        """This rank's role in the run (the session calls :meth:`assign_roles` first)."""
        return Role.of(self.rank, self.size, self.servers)

    @property
    def workers(self) -> Optional["Comm"]:
        """The communicator of the worker ranks (the ranks that train); None on the
        parameter server. Its users name it ``worker_comm``; the attribute keeps its
        short name, which tests and benchmarks read."""
        return self._worker_comm

    @property
    def spinning(self) -> bool:
        """Whether this rank waits inside MPI's blocking allreduce on this communicator
        (see :func:`spins`) rather than polling."""
        return self._spin is not None

    @property
    def mpi4py_comm(self):
        """The underlying mpi4py communicator, for an engine that is itself an MPI
        library (Horovod's init takes one); nothing else outside mpitrain.comm may use it."""
        return self._c

    def with_timeout(self, seconds: float) -> "Comm":
        """The same communicator with another wait bound (shares the traffic table)."""
        view = Comm(self._c, seconds, self.traffic, self.hosts, self.world_ranks)
        view.pids, view.servers = self.pids, self.servers
        return view

    def name(self, rank: int) -> str:
        """'rank R on HOST' for messages, with R the world rank."""
        return f"rank {self.world_ranks[rank]} on {self.hosts[rank]}"

    def ranks_on_host(self, host: Optional[str] = None) -> List[int]:
        """Ranks of this communicator that run on ``host`` (default: this rank's host)."""
        host = self.host if host is None else host
        return [r for r, h in enumerate(self.hosts) if h == host]

    def workers_on_host(self) -> List[int]:
        """Ranks on this rank's host that train (workers, or the single rank)."""
        return [r for r in self.ranks_on_host() if Role.of(r, self.size, self.servers).trains]

    # ---- waiting ----------------------------------------------------------------------
    def wait(self, pending: Pending, backoff: Backoff = HOT,
             timeout: Optional[float] = None) -> None:
        """Complete ``pending`` or raise :class:`CommTimeout` after ``timeout`` seconds
        (default: the communicator's)."""
        if not pending.test():  # most waits find it done: no poll loop to set up
            self.wait_all([pending], backoff, timeout)

    def wait_all(self, pendings: Sequence[Pending], backoff: Backoff = HOT,
                 timeout: Optional[float] = None) -> None:
        """Complete every request in ``pendings`` (bounded, see :meth:`wait`)."""
        deadline = time.perf_counter() + (self.timeout if timeout is None else timeout)
        for p in pendings:
            self._poll(p.test, [p], backoff, max(0.0, deadline - time.perf_counter()),
                       timeout_for_message=timeout)

    def wait_any(self, pendings: Sequence[Optional[Pending]], backoff: Backoff = IDLE,
                 timeout: Optional[float] = None, tested: bool = False) -> Optional[int]:
        """Index of the first of ``pendings`` to complete (None entries are skipped).

        Without ``timeout``, bounded by the communicator's timeout (CommTimeout);
        with it, returns None when ``timeout`` seconds pass with nothing complete,
        so a server can decide itself which silent peer to name. ``tested``: the
        caller has just tested each of them and found none complete, so they are
        tested again only after the first yield or sleep (each test drives MPI's
        progress engine: a few microseconds).
        """
        live = [(i, p) for i, p in enumerate(pendings) if p is not None]
        if not live:
            raise ValueError("wait_any needs at least one pending request")
        for i, p in ([] if tested else live):  # one already complete (a server's next
            if p.test():  # push often is, after an update): no poll loop to set up
                return i
        live_pendings = [p for _, p in live]
        found: List[int] = []

        def any_done() -> bool:
            # One MPI_Test per request, not one MPI_Testany for all: each Test drives
            # Open MPI's progress engine once, and a ~31 KB shared-memory message
            # needs several progress calls: more updates a second than with Testany
            # (docs/architecture.md, "One MPI_Test per request").
            for j, p in enumerate(live_pendings):
                if p.test():
                    found.append(live[j][0])
                    return True
            return False

        if not self._poll(any_done, live_pendings, backoff, timeout,
                          raise_on_timeout=timeout is None, tested=tested):
            return None
        return found[0]

    def _poll(self, done: Callable[[], bool], pendings: Sequence[Pending], backoff: Backoff,
              timeout: Optional[float] = None, raise_on_timeout: bool = True,
              timeout_for_message: Optional[float] = None, tested: bool = False) -> bool:
        """:func:`poll` with this communicator's bound, failure channel and
        while_waiting; a timeout raises CommTimeout (or returns False)."""
        seconds = self.timeout if timeout is None else timeout
        # a collective (no one peer) cannot complete once any rank has exited: the ranks
        # on this host are looked at once a second, so one lost during start-up is named
        # in seconds, not after the timeout (a point-to-point wait's peer is left to the
        # protocol: async training under recovery goes on without it)
        watch_peers = pendings[0].peer is None and bool(self.pids)
        next_look = time.perf_counter() + LOOK_EVERY
        peers: Optional[PeerProcesses] = None  # made at the first look

        def check() -> None:
            nonlocal next_look, peers
            self._failures.check()
            if self.startup_check is not None:
                self.startup_check()
            if all(p.failed for p in pendings):  # nothing left that could complete
                raise peer_died(pendings, self)
            if watch_peers and time.perf_counter() >= next_look:
                next_look = time.perf_counter() + LOOK_EVERY
                peers = peers or PeerProcesses(self)
                gone = peers.gone()
                # a rank may exit right after its part of the collective: gone only if
                # the collective still cannot complete, tested again after the exit
                if gone and not settles(pendings):
                    raise rank_exited(pendings[0], gone, self)

        if poll(done, pendings[0].kind, backoff, seconds, self.traffic, check,
                self.while_waiting, tested):
            return True
        if raise_on_timeout:
            raise timeout_error(pendings, timeout_for_message or self.timeout,
                                self.name(self.rank), self.name)
        return False

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

    def allreduce_sum_(self, buf: np.ndarray, what: str = "the gradient allreduce",
                       kind: str = "allreduce", computing: bool = False) -> np.ndarray:
        """Replace ``buf`` on every rank by the sum of all ranks' ``buf``, in place.

        One MPI allreduce on the whole (fused) buffer; a sync worker sends its
        gradient already divided by the number of workers, so the sum is the mean
        (no pass over the buffer after the exchange). Collective: every rank of
        this communicator calls it with a buffer of the same size and dtype; every
        rank gets the bit-identical result (MPI's reductions deliver the same sum to
        all ranks), which keeps sync replicas identical.

        How this rank waits (:func:`spins`): inside MPI's blocking allreduce, its
        bound held by a watchdog thread (:class:`SpinWatch`), when this host has a
        core for every rank of the job; else started nonblocking and polled with the HOT
        backoff, which yields the core. Both are bounded by the communicator's
        timeout and keep calling :attr:`while_waiting`. ``computing``: this process
        computes meanwhile (an overlapped bucket, :mod:`mpitrain.exchange.overlap`), so
        it polls even where it could spin: a spinning thread would take a core from
        the computation it overlaps.
        """
        if self.size == 1:
            return buf
        spin = self._spin  # (a sync step's hot path: at LR's size each 0.1 us is 1%)
        if spin is not None and not computing and self._failures.pending is None:
            try:
                seconds = spin.run(self._sum_in_place, buf, self.timeout, what,
                                   self.while_waiting)
            except Exception as error:  # noqa: BLE001 - MPI.Exception, read below
                if not is_process_failure(error):
                    raise
                note_process_failure()
                raise peer_died([Pending(None, what, None, kind)], self) from None
        else:
            p = Pending(allreduce_algorithm().iallreduce_sum(self._c, buf), what, None, kind)
            self._poll(p.test, [p], HOT)  # (adds its wait to the traffic table)
            seconds = 0.0
        self.traffic.add_exchanged(kind, buf.nbytes, seconds)
        return buf

    def allreduce_mean_(self, buf: np.ndarray, what: str = "the allreduce",
                        kind: str = "allreduce") -> np.ndarray:
        """Replace ``buf`` on every rank by the mean of all ranks' ``buf``, in place
        (:meth:`allreduce_sum_`, then one scaling pass). Collective, bit-identical."""
        self.allreduce_sum_(buf, what, kind)
        buf *= np.float32(1.0 / self.size) if buf.dtype == np.float32 else 1.0 / self.size
        return buf

    def allreduce_sum_half_(self, half: np.ndarray, out: np.ndarray,
                            what: str = "the gradient allreduce",
                            kind: str = "allreduce") -> np.ndarray:
        """``out`` (float32) := the sum of all ranks' ``half`` (float16), moving float16.

        A reduce-scatter then an allgather, both on float16 bytes: one alltoall gives
        each rank every rank's copy of its segment, which it sums in float32 in rank
        order; one allgather then gives every rank every summed segment (as
        float16). Half the bytes of a float32 ring allreduce, no user-defined MPI
        reduction (a Python one costs an order of magnitude more or worse:
        docs/architecture.md, "A float16 sum without a user-defined reduction"), and
        every rank gets the
        bit-identical result: each segment is summed once, by its owner. Collective:
        every rank calls it with ``len(half)`` a multiple of ``size``, the same on all;
        ``out`` may be shorter (the caller's padding is dropped).
        """
        if self.size == 1:
            return widen_(half[:out.size], out)
        segment = half.size // self.size
        if segment * self.size != half.size:
            raise ValueError(f"allreduce_sum_half_ needs a length divisible by {self.size}")
        gathered, mine, sums = self._half_buffers(segment)
        self.wait(Pending(self._c.Ialltoall(half.view(np.uint16), gathered.view(np.uint16)),
                          what, None, kind), HOT)
        mean_rows_(gathered, 1.0, mine)  # in rank order: one owner, one order
        self.wait(Pending(self._c.Iallgather(mine.view(np.uint16), sums.view(np.uint16)),
                          what, None, kind), HOT)
        self.traffic.add_sent(kind, half.nbytes)
        self.traffic.add_recv(kind, half.nbytes)
        return widen_(sums[:out.size], out)

    def allgather_(self, mine: np.ndarray, out: np.ndarray,
                   what: str = "the gradient allgather", kind: str = "allreduce") -> np.ndarray:
        """``out`` (``size`` rows of ``len(mine)``) := every rank's ``mine``, in rank order,
        on every rank (one MPI allgather of float32 buffers; bounded). Collective: every
        rank calls it with buffers of the same size."""
        if self.size == 1:
            out.reshape(-1)[:] = mine
            return out
        self.wait(Pending(self._c.Iallgather(mine, out), what, None, kind), HOT)
        self.traffic.add_sent(kind, mine.nbytes)
        self.traffic.add_recv(kind, out.nbytes - mine.nbytes)
        return out

    def _half_buffers(self, segment: int):
        """The exchange buffers of :meth:`allreduce_sum_half_` by segment length, kept
        between calls (a large model's are 100s of MB: allocating them every step costs
        page faults; an overlapped gradient has one set per bucket size)."""
        if segment not in self._half:
            self._half[segment] = (np.empty((self.size, segment), np.float16),
                                   np.empty(segment, np.float16),
                                   np.empty(self.size * segment, np.float16))
        return self._half[segment]

    def barrier(self, what: str = "a barrier", backoff: Backoff = IDLE,
                kind: str = "control") -> None:
        """Wait until every rank has arrived (bounded; the wait counts under ``kind``).
        Collective."""
        if self.size > 1:
            self.wait(Pending(self._c.Ibarrier(), what, None, kind), backoff)

    # ---- point to point on buffers ----------------------------------------------------
    def isend(self, buf: np.ndarray, dest: int, tag: int, kind: str, what: str) -> Pending:
        """Start sending ``buf`` to ``dest``; ``buf`` must not change until completed."""
        self.traffic.add_sent(kind, buf.nbytes)
        return Pending(self._c.Isend(buf, dest=dest, tag=tag), what, dest, kind)

    def irecv(self, buf: np.ndarray, source: int, tag: int, kind: str, what: str) -> Pending:
        """Post a receive into ``buf`` (a message may be shorter) from ``source``."""
        return Pending(self._c.Irecv(buf, source=source, tag=tag), what, source, kind,
                       traffic=self.traffic)

    def send_init(self, buf: np.ndarray, dest: int, tag: int, kind: str,
                  what: str) -> Persistent:
        """A persistent send of ``buf`` to ``dest``, not started (see :meth:`start`)."""
        return Persistent(self._c.Send_init(buf, dest=dest, tag=tag), what, dest, kind,
                          sent_bytes=buf.nbytes)

    def recv_init(self, buf: np.ndarray, source: int, tag: int, kind: str,
                  what: str) -> Persistent:
        """A persistent receive into ``buf`` from ``source``, not started (see
        :meth:`start`); a message may be shorter."""
        return Persistent(self._c.Recv_init(buf, source=source, tag=tag), what, source, kind,
                          traffic=self.traffic)

    def matched_recv(self, source: int, tag: int, kind: str, what: str,
                     take: Callable[[int], Optional[np.ndarray]]) -> Matched:
        """A receive of the next message from ``source`` with ``tag`` into the buffer
        ``take(nbytes)`` lends once that message is there (None: none yet; asked again at
        each test): no buffer is held for a message that has not come (a matched probe,
        :class:`~.pending.Matched`). Waited on, tested and cancelled like :meth:`irecv`'s."""
        return Matched(self._c, source, tag, what, kind, take, self.traffic)

    def start(self, op: Persistent) -> Persistent:
        """Start ``op`` (completed or never started) again; returns it, to wait on."""
        op.request.Start()
        op.done = op.failed = False
        if op.sent_bytes:
            self.traffic.add_sent(op.kind, op.sent_bytes)
        return op

    def cancel(self, pending: Optional[Pending], peer_lost: bool = False) -> None:
        """Cancel a posted receive that will never be matched, so none is left at exit.

        ``peer_lost``: the receive is from a peer dropped as dead or stalled. If that
        peer died (or stopped) in the middle of sending, Open MPI has already matched
        the receive, which can then neither complete nor be cancelled (its
        single-copy read fails: "Read -1, expected N, errno = 3"); it is abandoned
        after ``LOST_PEER_CANCEL_BOUND`` seconds instead of failing the run the drop
        was to save. A receive nothing matched is cancelled at once."""
        if pending is None or pending.done:
            return
        if pending.failed:  # MPI ended it when its peer died: nothing left to cancel
            pending.done = True
            return
        if isinstance(pending, Matched):  # a matched message is received, not cancelled
            if not pending.drop_match():  # nothing matched: nothing to cancel
                pending.done = True
                return
        else:
            pending.request.Cancel()
        bound = LOST_PEER_CANCEL_BOUND if peer_lost else CANCEL_BOUND
        self._poll(lambda: bool(pending.request.Test()), [pending], IDLE, timeout=bound,
                   raise_on_timeout=not peer_lost, timeout_for_message=bound)
        pending.done = True

    def free_requests(self) -> None:
        """Free every persistent request (:meth:`send_init`, :meth:`recv_init`) this process
        still holds, cancelling a started receive nothing matched: at the end of a run
        (the session's), so that none is left at MPI_Finalize. Local."""
        free_persistent(lambda op: self.cancel(op, peer_lost=True))

    # ---- failures of other ranks ------------------------------------------------------
    def listen_for_failures(self) -> None:
        """On rank 0: from now on every wait also notices a failure report from any rank.

        A rank that hits an error only it knows about (a timeout, a crash) sends
        a one-line report (:func:`report_failure`) before the job is aborted, so
        rank 0 can record the run as failed with the reason.
        """
        self._failures.start()

    def stop_listening(self) -> None:
        self.cancel(self._failures.pending)
        self._failures.pending = None


def peer_died(pendings: Sequence[Pending], comm: Comm) -> RanksLost:
    """The error of a wait whose peer MPI reported dead (ULFM), naming it where it can."""
    p = pendings[0]
    dead = [r for r, world in enumerate(comm.world_ranks) if world in FAILED_RANKS]
    who = (comm.name(p.peer) if p.peer is not None else
           ", ".join(comm.name(r) for r in dead) if dead else "a rank of the job")
    return RanksLost(f"{comm.name(comm.rank)} stops: {who} died while it waited for {p.what} "
                     "(MPI reported MPI_ERR_PROC_FAILED; mpitrain launch restarts the run from "
                     "its last checkpoint)", lost=[p.peer] if p.peer is not None else dead)


def node_names(names: Sequence[str], leaders: Sequence[int]) -> List[str]:
    """The host of each rank as named in messages and files: its node leader's processor
    name (``leaders[r]``: the lowest rank on rank r's node), so that ranks MPI puts on one
    node share one name and ranks on two nodes never do (two hosts that call themselves
    alike, e.g. containers named localhost, get ``#`` and their leader's rank added)."""
    by_name: dict = {}
    for leader in sorted(set(leaders)):
        by_name.setdefault(names[leader], []).append(leader)
    return [names[leader] if len(by_name[names[leader]]) == 1 else f"{names[leader]}#{leader}"
            for leader in leaders]


def spins(allreduce_wait: str, hosts: Sequence[str], cpus: Sequence[int],
          thread_multiple: Sequence[bool], loads: Optional[Sequence[float]] = None) -> bool:
    """Whether the ranks wait in the allreduce inside MPI's blocking call (``spin``) rather
    than polling, from every rank's host, its host's CPU count, its MPI thread level and
    the cores its host's other processes keep busy (:func:`.load.others_busy_cores`,
    measured as the job starts; None: taken as 0): mpitrain's one wait-policy decision
    (``Comm.world`` makes it for its communicators; so may anyone).

    'auto' spins only where every host has a core to spare for every rank of the
    communicator on it: its ranks plus the others' busy cores fit in its cores. A
    spinning rank keeps a core busy for the whole wait (the blocking waits of Open MPI
    4.1, Open MPI 5 and MPICH all busy-poll), the core that the rank it waits for, or
    another busy process, needs when they outnumber the cores; a polling rank yields
    it. Spinning saves microseconds an allreduce where every rank has a core of its
    own, and costs whole scheduler time slices where it has not (``python -m bench
    mpis``, docs/architecture.md, "Spin or poll": the same on the three
    implementations). 'poll' never spins; neither does any choice without
    MPI_THREAD_MULTIPLE on every rank (the watchdog's heartbeats and failure report are
    MPI calls from a second thread). The same answer on every rank, as the ranks of one
    allreduce must all make the same call.
    """
    if allreduce_wait == "poll" or not all(thread_multiple):
        return False
    if allreduce_wait == "spin":
        return True
    per_host = Counter(hosts)
    loads = [0.0] * len(hosts) if loads is None else loads
    return all(per_host[host] + load <= n for host, n, load in zip(hosts, cpus, loads))
