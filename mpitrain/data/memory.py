"""How much data a rank may read: checked against the memory its host has left before
a byte is read, so data that cannot fit is one line instead of a rank the kernel kills.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from ..errors import DataError


@dataclass(frozen=True)
class MemoryBudget:
    """What one rank may hold: the memory its host has ``available``, shared by the
    ``ranks`` of the job there. Data is checked against it before it is read."""

    available: int
    ranks: int = 1
    host: str = "this host"
    #: the share of the training split this rank keeps as float32 (a worker's shard)
    train_share: float = 1.0

    @classmethod
    def of(cls, comm, shard: Optional[Tuple[int, int]] = None) -> "MemoryBudget":
        return cls(available_memory(), max(1, list(comm.hosts).count(comm.host)), comm.host,
                   1.0 / shard[0] if shard else 1.0)

    def check(self, needed: float, what: str, fix: str, error=DataError) -> None:
        """``error`` (not agreed on yet: see :func:`mpitrain.data.load`) if ``needed``
        bytes per rank will not fit."""
        if needed > self.available / self.ranks:
            raise error(f"{what} need {_size(needed)} of memory on each rank, but "
                        f"{self.host} has {_size(self.available)} available for its "
                        f"{self.ranks} rank(s); {fix}", everywhere=False)

    def array(self, shape: Tuple[int, ...], dtype, key: str) -> float:
        """Bytes of the array ``key`` (x_train, y_test...) of ``shape`` and ``dtype``
        read whole, and for examples of the float32 copy of this rank's share of them
        (none for float32, used as it is)."""
        n = float(np.prod(shape, dtype=np.float64))
        share = self.train_share if key == "x_train" else 1.0
        floats = key.startswith("x_") and np.dtype(dtype) != np.float32
        return n * np.dtype(dtype).itemsize + (4 * n * share if floats else 0)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def available_memory() -> int:
    """Bytes this host can still give this process: the kernel's MemAvailable, or less
    where a control group limits it (a container, a SLURM job)."""
    import psutil

    free = psutil.virtual_memory().available
    for group in _cgroup_dirs():
        for limit, usage in (("memory.max", "memory.current"),
                             ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            try:
                free = min(free, int((group / limit).read_text()) -
                           int((group / usage).read_text()))
            except (OSError, ValueError):  # not this version's file, or "max": no limit
                continue
    return max(0, free)


def _cgroup_dirs() -> List[Path]:
    """This process's memory control group directories (v2 unified, v1 memory)."""
    found = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if controllers == "":
                found.append(Path("/sys/fs/cgroup") / where.lstrip("/"))
            elif "memory" in controllers.split(","):
                found.append(Path("/sys/fs/cgroup/memory") / where.lstrip("/"))
    except (OSError, ValueError):
        pass
    return found

