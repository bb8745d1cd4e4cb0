"""The serving rank's CPU priority: a sync server makes room for the workers on its host.

Its work (taking reports, evaluating, writing checkpoints) is off the sync workers'
critical path while it keeps up with them, so on a host with fewer cores than ranks it
should take only the CPU they leave (its evaluation of the initial model beside the
workers' first steps slowed a large model's run measurably: docs/architecture.md, "The
sync server at the lowest priority"). At the lowest priority it still runs at once
whenever they wait, and at full speed once they are done; where other processes keep
the host busy it falls behind, the workers say so, and it takes its own priority back
(:meth:`Deference.end`). The async server applies every update: it is the critical
path and keeps its priority.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional

from ..comm import Role

#: the niceness of a sync server that shares its host with workers (the most deferent)
SERVER_NICENESS = 19


def defers_to_workers(async_mode: bool, role: Role, workers_on_host: int) -> bool:
    """Whether this rank runs below its host's workers' priority: a sync server with a
    worker on its host (``workers_on_host``: how many ranks there train)."""
    return role is Role.SERVER and not async_mode and workers_on_host > 0


class Deference:
    """What :func:`deferring_to_workers` yields: ``niceness``, the one its block runs at
    (None where the OS has none), and :meth:`end`."""

    def __init__(self, niceness: Optional[int], restore: Optional[Callable[[], None]] = None):
        self.niceness = niceness
        self._restore = restore

    def end(self) -> bool:
        """Run at the priority from before the block again, for the rest of it; whether
        that changed anything (only a lowered priority that may be raised again is).

        For when the workers wait for this rank after all: on a host that other
        processes keep busy, niceness 19 gives it almost none of the CPU, and the
        workers block on the weights it has not taken yet. Local to this rank."""
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        return restore is not None


@contextlib.contextmanager
def deferring_to_workers(ctx) -> Iterator[Deference]:
    """Inside the block, run at SERVER_NICENESS if :func:`defers_to_workers`, every
    thread of the process (Linux keeps a niceness per thread; threads made later,
    TensorFlow's, inherit it), then the previous niceness again. Yields the
    :class:`Deference` (its niceness; ending it early). Undoing it needs the privilege to
    raise a priority (root, or RLIMIT_NICE): without it only a run that ends its
    process (``ctx.ends_process``: the CLI's) defers, so a user's script under
    mpitrain.fit does not go on below the priority it had. Local to this rank."""
    before = niceness()
    can_undo = before is not None and _may_raise_priority_to(before)
    if before is None or not (can_undo or ctx.ends_process) or not defers_to_workers(
            ctx.cfg.async_mode, ctx.role, len(ctx.comm.workers_on_host())):
        yield Deference(before)
        return
    _set_niceness(max(SERVER_NICENESS, before))
    deference = Deference(niceness(), (lambda: _set_niceness(before)) if can_undo else None)
    try:
        yield deference
    finally:
        deference.end()


def niceness() -> Optional[int]:
    """This thread's niceness (None where the OS has none)."""
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None


def _may_raise_priority_to(value: int) -> bool:
    import resource

    return os.geteuid() == 0 or 20 - value <= resource.getrlimit(resource.RLIMIT_NICE)[0]


def _set_niceness(value: int) -> None:
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's
        threads = [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except OSError:  # a thread that just ended
            pass
