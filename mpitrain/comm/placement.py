"""Where a rank runs on its host: its CPU affinity and how many threads TensorFlow gets.
One rule for the CLI's runs (:mod:`mpitrain.run.session`) and ``mpitrain.horovod`` scripts.

Ranks share a host's cores: TensorFlow's default (one thread per core in every process)
oversubscribes the CPU as soon as two ranks share a host, so the training ranks on a
host divide its cores among them. Open MPI binds each rank to one core at -np 1 and 2,
which would leave one core for a rank's every thread: the affinity is widened to the
whole host unless the user keeps the launcher's binding."""

from __future__ import annotations

import os
from typing import Optional


def place(keep_binding: bool, trainers_on_host: int, trains: bool = True,
          threads: Optional[int] = None) -> int:
    """Widen this rank's CPU affinity to every core of the host (unless ``keep_binding``)
    and return TensorFlow's intra-op threads for it: ``threads`` if given, else the usable
    cores shared among the ``trainers_on_host`` training ranks on the host (at least
    one); a rank that does not train (a parameter server, mostly asleep) gets one.
    Local to the rank: each rank decides from what its host has."""
    if not keep_binding and hasattr(os, "sched_setaffinity"):
        try:  # the kernel intersects this with any cgroup/cpuset limit
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError:
            pass
    if threads:
        return threads
    if not trains:
        return 1
    return max(1, usable_cpus() // max(1, trainers_on_host))


def usable_cpus() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
