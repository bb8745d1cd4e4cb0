"""The async server's policies, pure (no MPI, no clock of their own; unit-tested).

* :class:`Leases`: who may compute next under bounded staleness (``--staleness K``).
* :class:`Liveness`: when a silent worker counts as lost (async: a lease holder, under
  ``--enable-recovery``; sync: any worker).
* :class:`Quotas`: how many steps each worker runs, and who takes a lost worker's.
* :func:`first_look`: how long the server may sleep before it looks for a push.
* :class:`Pipelining`: whether a worker keeps a second push in flight (``--pipeline``).
"""

from __future__ import annotations

import collections
import statistics
from typing import Deque, Dict, Iterable, Iterator, List, Optional, Tuple


class Leases:
    """Which workers hold a lease (the weights of a version, to compute a gradient at)
    and which wait for one, under a staleness bound.

    With ``bound`` K the server grants a lease only if every worker holding one
    would still see its gradient applied with staleness <= K, even if every
    other lease holder pushes first. With ``v`` the server version, ``base[u]``
    the version of worker ``u``'s lease and ``O`` the lease holders, a grant
    keeps ``(v - base[u]) + |O| - 1 <= K`` for all ``u`` in ``O``. So K = 0 lets
    exactly one worker compute at a time, always on the current weights; no K
    (``None``) never holds anyone. A grant is always possible when nobody holds a
    lease, so the protocol cannot deadlock; waiting workers are served first
    come, first served.
    """

    def __init__(self, bound: Optional[int], waiting: Iterable[int]):
        self.bound = bound
        #: lease holder -> the version of its lease
        self.base: Dict[int, int] = {}
        self.waiting: Deque[int] = collections.deque(waiting)

    def holds(self, rank: int) -> bool:
        return rank in self.base

    @property
    def holders(self):
        return list(self.base)

    def may_grant(self, version: int) -> bool:
        """Whether one more lease at ``version`` keeps every holder within the bound."""
        if self.bound is None:
            return True
        bases = list(self.base.values()) + [version]  # the candidate's lease
        return all((version - b) + len(bases) - 1 <= self.bound for b in bases)

    def next_waiting(self, version: int, force: bool = False) -> Iterator[int]:
        """The waiting workers that may be answered now, in order; each is taken off
        the queue. The caller either grants it a lease (:meth:`grant`) or dismisses
        it; ``force`` (the run is ending) answers every waiting worker."""
        while self.waiting and (force or self.may_grant(version)):
            yield self.waiting.popleft()

    def grant(self, rank: int, version: int) -> None:
        self.base[rank] = version

    def returned(self, rank: int) -> int:
        """``rank`` pushed the gradient of its lease; returns the lease's version."""
        return self.base.pop(rank)

    def wait(self, rank: int) -> None:
        """``rank`` wants its next lease."""
        self.waiting.append(rank)

    def drop(self, rank: int) -> None:
        """``rank`` is gone: its lease no longer holds the others back."""
        self.base.pop(rank, None)
        if rank in self.waiting:
            self.waiting.remove(rank)


class Liveness:
    """When a silent worker counts as lost.

    A worker's bound is ``factor`` times its usual interval (an EWMA of what it
    has shown so far: async, between its lease and its push; sync, between its
    messages), at least ``floor`` seconds (a garbage collection, a page-in or
    the server's evaluation thread must not cost a worker its place) and at
    most ``timeout`` (``--timeout``, the stall bound that ends the job). Before
    its first push or message (which includes building and tracing the model)
    a worker gets the whole ``timeout``.
    """

    def __init__(self, timeout: float, floor: float = 10.0, factor: float = 20.0):
        self.timeout, self.floor, self.factor = timeout, floor, factor
        self.interval: Dict[int, float] = {}

    def observe(self, rank: int, seconds: float) -> None:
        """Record that ``rank`` pushed ``seconds`` after its lease was granted."""
        previous = self.interval.get(rank)
        self.interval[rank] = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def bound(self, rank: int) -> float:
        if rank not in self.interval:
            return self.timeout
        return min(self.timeout, max(self.floor, self.factor * self.interval[rank]))

    def lost_because(self, rank: int, silent_for: float, alive: bool) -> str:
        """Why a lease holder silent for ``silent_for`` seconds counts as lost, or ''."""
        if not alive:
            return f"its process died (no push for {silent_for:.1f} s)"
        bound = self.bound(rank)
        if silent_for > bound:
            return (f"silent for {silent_for:.1f} s, past its liveness bound of {bound:.1f} s "
                    f"({self.factor:g}x its usual interval, at least {self.floor:g} s)")
        return ""


class Quotas:
    """How many steps each worker runs before its FINAL push.

    Every worker starts with the run's steps per worker. When one is lost, the
    steps it had left go to the workers still training, as evenly as possible
    (lowest ranks first for the remainder), so the run keeps its planned number
    of updates; if none is left to take them they are counted as ``short``.
    """

    def __init__(self, ranks, total_steps: int):
        self.of: Dict[int, int] = {r: total_steps for r in ranks}
        self.short = 0

    def reassign(self, rank: int, steps_done: int, active) -> Dict[int, int]:
        """Take ``rank`` out at ``steps_done``; return the steps each of ``active`` gained."""
        left = max(0, self.of[rank] - steps_done)
        self.of[rank] = steps_done
        return self.share(left, [r for r in active if r != rank])

    def share(self, steps: int, takers) -> Dict[int, int]:
        """Give ``steps`` to ``takers``; return the steps each gained (none: short)."""
        takers = sorted(takers)
        if not takers:
            self.short += steps
            return {}
        share, remainder = divmod(steps, len(takers))
        gained = {r: share + (1 if i < remainder else 0) for i, r in enumerate(takers)}
        for r, extra in gained.items():
            self.of[r] += extra
        return gained


#: pipelined workers need the reply to push k when they would push k+2, two steps
#: after push k; the server first looks this many steps after the oldest lease
LOOK_AFTER_STEPS = 2.0
#: ... but never sleeps longer than this at once (a stop is noticed within it)
MAX_FIRST_SLEEP = 0.05


def first_look(oldest_lease: float, step: float, now: float) -> float:
    """Seconds the server may sleep before it first looks for a push from pipelined
    workers: until LOOK_AFTER_STEPS steps of ``step`` seconds after ``oldest_lease``
    (when the oldest lease it is owed a push for was granted), at most MAX_FIRST_SLEEP;
    0 or less: look now. The push is then in, and its reply still a step early."""
    return min(oldest_lease + LOOK_AFTER_STEPS * step - now, MAX_FIRST_SLEEP)


class Pipelining:
    """How many pushes an async worker keeps in flight: 1, or 2 (pipelined).

    Pipelined, the worker computes its next gradient while its push and the reply
    travel, so the round trip is hidden; but each gradient it pushes is then at
    least one of its own updates older, which costs accuracy (docs/architecture.md,
    "Pipelining only where it pays"). So 'auto' pipelines only where the round trip is
    worth hiding. The
    worker starts with one push in flight and measures each window of ``WINDOW``
    steps (the first step, which traces the model, not counted): its median wait
    for a reply over its median compute. From the ``JUDGED``-th window on, while it
    has measured at most ``WINDOWS``, it turns pipelining on for the rest of the run
    once the median of those ratios is at least ``WORTH``: LR's windows lie above
    it, LeNet's below (a worker's first steps share the cores with the other
    workers' tracing and the server's first evaluation, so one window can mislead:
    hence the median of windows). 'on' always pipelines, 'off' never (nor does a
    bounded staleness, which needs one gradient per lease).
    """

    WINDOW, JUDGED, WINDOWS, WORTH = 8, 3, 16, 0.3

    def __init__(self, mode: str):
        self.mode = mode
        self.depth = 2 if mode == "on" else 1
        self.measuring = mode == "auto"
        self.skip = 1  # the first step
        self.samples: List[Tuple[float, float]] = []  # (compute, wait) in this window
        self.ratios: List[float] = []  # wait / compute, per window

    def observe(self, compute: float, wait: float) -> int:
        """One step with one push in flight took ``compute`` seconds to compute and
        ``wait`` seconds waiting for its reply; returns the depth from now on."""
        if not self.measuring:
            return self.depth
        if self.skip:
            self.skip -= 1
            return self.depth
        self.samples.append((compute, wait))
        if len(self.samples) == self.WINDOW:
            compute = statistics.median(c for c, _ in self.samples)
            wait = statistics.median(w for _, w in self.samples)
            self.samples.clear()
            self.ratios.append(wait / max(compute, 1e-9))
            judged = len(self.ratios) >= self.JUDGED
            if judged and statistics.median(self.ratios) >= self.WORTH:
                self.depth = 2
            self.measuring = self.depth == 1 and len(self.ratios) < self.WINDOWS
        return self.depth
