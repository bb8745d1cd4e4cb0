"""How a rank waits: polling policies, the started operations it waits on, the bounded
poll loop and its timeout message, and the bound around the few blocking MPI calls."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from ..errors import EXIT_FAILURE, CommTimeout
from .failures import report_failure
from .pending import Pending
from .runtime import end_job_through_launcher, open_mpi_4_recovery
from .traffic import Traffic


@dataclass
class Backoff:
    """How a rank polls a request it is waiting on.

    For the first ``yield_for`` seconds, test the request and call
    ``sched_yield`` in between: on a free core that is a spin (no added
    latency); on an oversubscribed host it hands the core to a rank that is
    still computing, the one everybody waits for. After that, sleep between
    tests, doubling from ``first_sleep`` to ``max_sleep``; once the wait has lasted
    long, up to ``patience`` of the time already waited (at most LONGEST_SLEEP), so
    a wait of seconds costs almost no CPU and answers at most that fraction late.
    The yield phase makes an oversubscribed sync step faster than sleeps alone
    (docs/architecture.md, "How a rank waits").
    """

    yield_for: float
    first_sleep: float = 2e-5
    max_sleep: float = 1e-3
    patience: float = 0.01

    def next_sleep(self, slept: float, waited: float) -> float:
        """The sleep after one of ``slept`` seconds, ``waited`` seconds into the wait."""
        cap = max(self.max_sleep, min(LONGEST_SLEEP, waited * self.patience))
        return min(slept * 2.0, cap)


#: the longest sleep between two tests of a long wait (its lateness, at worst)
LONGEST_SLEEP = 0.02


#: Workers inside a collective: partners usually arrive within a step's jitter.
HOT = Backoff(yield_for=2e-3)
#: A server, or a rank waiting on something slow (evaluation, a slow worker).
IDLE = Backoff(yield_for=0.0, first_sleep=5e-5, max_sleep=1e-3)
#: The async server between pushes: workers keep computing while it sleeps (their
#: pipeline hides its reply latency), so it polls less often: a longer first sleep
#: saves CPU at the same update rate (docs/architecture.md, "How a rank waits").
SERVING = Backoff(yield_for=0.0, first_sleep=5e-4, max_sleep=1e-3)


#: seconds between calls of Comm.while_waiting during a long wait
WAITING_CALL_EVERY = 1.0


def poll(done: Callable[[], bool], kind: str, backoff: Backoff, seconds: float,
         traffic: Traffic, check: Optional[Callable[[], None]] = None,
         while_waiting: Optional[Callable[[], None]] = None, tested: bool = False) -> bool:
    """Call ``done`` until it returns True (then True) or ``seconds`` pass (then False),
    yielding the core or sleeping in between as ``backoff`` says.

    The time spent is added to ``traffic.wait_seconds[kind]``. After each test that
    found nothing, ``check`` may raise (rank 0's failure channel), and
    ``while_waiting`` is called about every WAITING_CALL_EVERY seconds. Local to this
    rank: the other ranks' part is whatever ``done`` tests. ``tested``: the caller has
    just found ``done`` False, so the first test comes after the first yield or sleep.
    """
    if not tested and done():
        return True
    start = time.perf_counter()
    deadline = start + seconds
    yield_until = start + backoff.yield_for
    next_call = start + WAITING_CALL_EVERY
    sleep = backoff.first_sleep
    now = start
    while True:
        if now < yield_until:
            os.sched_yield()
        else:
            time.sleep(sleep)
            sleep = backoff.next_sleep(sleep, now - start)
        if done():
            break
        if check is not None:
            check()
        now = time.perf_counter()
        if now >= next_call and while_waiting is not None:
            next_call = now + WAITING_CALL_EVERY
            while_waiting()
        if now > deadline:
            traffic.wait_seconds[kind] += now - start
            return False
    traffic.wait_seconds[kind] += time.perf_counter() - start
    return True


def timeout_error(pendings: Sequence[Pending], seconds: float, me: str,
                  name: Callable[[int], str]) -> CommTimeout:
    """The error of a wait that ran out: ``me`` ('rank R on HOST') waited ``seconds``
    for the first of ``pendings`` still open, from its peer (``name(peer)``) if any."""
    waiting = [p for p in pendings if not p.done] or list(pendings)
    p = waiting[0]
    return CommTimeout(timeout_text(me, seconds, p.what,
                                    name(p.peer) if p.peer is not None else None))


def timeout_text(me: str, seconds: float, what: str, peer: Optional[str] = None) -> str:
    """The one line of a wait that ran out (see :func:`timeout_error`)."""
    source = f" from {peer}" if peer is not None else ""
    return (f"{me} waited {seconds:g} s for {what}{source}; "
            f"that rank is stalled or dead (raise --timeout if this step is legitimately slower)")


class SpinWatch:
    """The bound on blocking MPI calls of the hot path (see :meth:`Comm.allreduce_sum_`).

    Open MPI's blocking allreduce is the fastest one (its tuned algorithms; the
    nonblocking one runs libnbc's schedule and completes only as it is polled),
    but it cannot time out. :meth:`run` makes the call in the calling thread
    and a watchdog thread of this object holds the bound: past ``seconds`` it
    reports the failure to rank 0 (:func:`.failures.report_failure`) and ends the
    process with the same one-line message a timed-out wait raises; while the
    call lasts it calls ``while_waiting`` about every WAITING_CALL_EVERY seconds
    (the sync workers' heartbeats), as :func:`poll` does. In the caller's thread
    it only reads the clock and takes a lock, a fraction of the polled wait's
    machinery (docs/architecture.md, "How a rank waits").

    The watchdog runs ``while_waiting`` only while the call is in flight, so the two
    threads never run the protocol's Python at the same time: it raises a flag, then
    checks the call is still the one in flight, and runs it holding a lock; the
    caller, after marking the call finished, takes that lock only when it sees the
    flag (under the interpreter lock each thread's two steps happen in order, so at
    least one of them sees the other's): taking the lock on every call cost a few
    percent of an LR-size allreduce. Its MPI calls (a heartbeat's send, the
    failure report) go to other communicators while the caller's thread is inside
    MPI: that needs MPI_THREAD_MULTIPLE, what mpi4py initialises (checked before
    anyone spins: :func:`.communicator.spins`). Local to this rank.
    """

    #: seconds between the watchdog's looks at the call in flight (the bound's precision)
    LOOK_EVERY = 0.2

    def __init__(self, me: str):
        self.me = me
        self._lock = threading.Lock()
        self._began = 0.0  # perf_counter() when the call in flight began; 0.0 if none
        self._bound: tuple = (0.0, "", None)  # (seconds, what, while_waiting) of that call
        self._beating = False  # the watchdog is about to call, or calls, while_waiting
        self._thread: Optional[threading.Thread] = None

    def run(self, call: Callable[[object], object], arg, seconds: float, what: str,
            while_waiting: Optional[Callable[[], None]] = None,
            clock: Callable[[], float] = time.perf_counter) -> float:
        """Make the blocking ``call(arg)`` (it must release the interpreter while it waits,
        as mpi4py's do) under the bound; return the seconds it took, when it returns."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="mpitrain blocking-call watchdog")
            self._thread.start()
        self._bound = (seconds, what, while_waiting)
        self._began = began = clock()
        try:
            call(arg)
        finally:
            self._began = 0.0
            if self._beating:  # the watchdog may be in while_waiting: let it finish
                with self._lock:
                    pass
        return clock() - began

    def _watch(self) -> None:
        # the call the last beat belongs to, and when it came (a call's start counts as
        # one): beats are WAITING_CALL_EVERY apart from the last one, so one this thread
        # gave late (a loaded host) is not followed by another at once
        beats_of, last_beat = 0.0, 0.0
        while True:
            time.sleep(self.LOOK_EVERY)
            with self._lock:
                began = self._began
                if not began:
                    continue
                seconds, what, while_waiting = self._bound
                waited = time.perf_counter() - began
                if waited > seconds:
                    line = timeout_text(self.me, seconds, what)
                    report_failure(line, grace=1.0)
                    _leave(f"mpitrain: error: {line}\n")
                if beats_of != began:
                    beats_of, last_beat = began, began
                now = began + waited
                if while_waiting is not None and now - last_beat >= WAITING_CALL_EVERY:
                    self._beating = True  # first the flag, then the check (see the class)
                    if self._began == began:
                        last_beat = now
                        while_waiting()
                    self._beating = False


_SPIN_WATCH: Optional[SpinWatch] = None


def spin_watch(me: str) -> SpinWatch:
    """The process's one :class:`SpinWatch` (``me``: this rank, 'rank R on HOST'): one
    watchdog thread however many communicators spin, or runs a script makes."""
    global _SPIN_WATCH
    if _SPIN_WATCH is None:
        _SPIN_WATCH = SpinWatch(me)
    return _SPIN_WATCH


@contextlib.contextmanager
def blocking_call_bound(seconds: float, what: str, who: str = "this rank") -> Iterator[None]:
    """Bound a blocking call that has no nonblocking form (the bootstrap's MPI_Comm_split).

    If the body has not finished after ``seconds``, a watchdog thread prints one line
    on stderr naming ``who`` ('rank R on HOST'), ``what`` it waited for and the fix,
    and ends the process with exit code 1; mpirun then ends the job. Local: each
    rank bounds its own call (use the same ``seconds`` on every rank).

    The call must release the interpreter while it waits, or the thread cannot run:
    mpi4py's Comm.Split does (checked: another thread runs throughout a Split);
    MPI_Init (importing mpi4py) and MPI_Finalize do not (see :func:`.runtime.finalize`). The
    thread makes no MPI call, so MPI's thread level does not matter (it is
    MPI_THREAD_MULTIPLE here anyway). When the body returns in time, the thread is
    stopped and joined before this returns.
    """
    returned = threading.Event()
    line = (f"mpitrain: {who} waited {seconds:g} s for {what}; a rank did not arrive "
            "(raise --timeout if start-up is legitimately slower)\n")

    def watch() -> None:
        if not returned.wait(seconds):
            _leave(line)

    watchdog = threading.Thread(target=watch, name=f"mpitrain bound on {what}", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        returned.set()
        watchdog.join()


def _leave(line: str) -> None:
    """Print ``line`` and end the process at once, from a thread other than the blocked
    one: os._exit, because SystemExit would end only this thread, and an exit that
    runs the atexit hooks would call MPI_Finalize next to the blocked call."""
    for stream, text in ((sys.stdout, ""), (sys.stderr, line)):
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: leave all the same
            pass
    if open_mpi_4_recovery():  # (its mpirun would exit 0 for this failure)
        end_job_through_launcher()
    os._exit(EXIT_FAILURE)
