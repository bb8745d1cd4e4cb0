"""How busy a host is with processes other than this job's: what the wait policy
(:func:`.communicator.spins`) counts besides the job's own ranks.

The 1-minute load average, what it used to count, still holds the ranks of a job that
ended seconds ago: a job started right after another one (a sweep, a benchmark, the
test suite) counted a core or two as busy that nobody used, and polled where it could
have spun. Instead every rank of the job sleeps for :data:`WINDOW` seconds at the
same moment and reads how much CPU time the host's processes used meanwhile: the
others', since this job's ranks are asleep.
"""

from __future__ import annotations

import os
import time
from typing import Optional

#: seconds every rank sleeps while the host's CPU time is read (Linux counts it in
#: ticks of 10 ms: a window of 0.1 s sees another busy process as about 10 ticks)
WINDOW = 0.1
#: busy cores below this are the system's own noise (daemons, interrupts), not a
#: process that needs a core: up to two ticks of the window
NOISE = 0.25


def others_busy_cores(window: float = WINDOW) -> float:
    """Cores that processes other than this one kept busy over the next ``window``
    seconds while this rank sleeps (0.0 below :data:`NOISE`); the 1-minute load average
    where the OS has no ``/proc/stat``. Local to this rank; meaningful when the job's
    other ranks on this host sleep at the same time (Comm.world has them all do so)."""
    before = _host_busy_seconds()
    if before is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    mine, start = time.process_time(), time.monotonic()
    time.sleep(window)
    after = _host_busy_seconds()
    elapsed, mine = time.monotonic() - start, time.process_time() - mine
    if after is None or elapsed <= 0:
        return 0.0
    busy = max(0.0, (after - before - mine) / elapsed)
    return busy if busy >= NOISE else 0.0


def _host_busy_seconds() -> Optional[float]:
    """CPU seconds the host has spent busy since boot, all cores (user, nice, system,
    interrupts; not idle, I/O wait nor the time a hypervisor stole), or None."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
