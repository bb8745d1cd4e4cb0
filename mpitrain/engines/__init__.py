"""Sync gradient engines: what averages the workers' fused gradient buffer.

An engine has the contract of :meth:`mpitrain.comm.Comm.allreduce_sum_`: every
worker calls ``engine.allreduce_sum_(buf)`` with its fused gradient buffer (the
same size on every worker) and gets the sum of all workers' buffers, in place,
bit-identical on every worker. (The workers' gradients arrive already divided by
their number, so the sum is the mean.) mpitrain's own engine is the workers'
communicator itself; Horovod (:mod:`.horovod`) is the other. Kept out of
:mod:`mpitrain.comm` so that the communication layer never imports TensorFlow or
Horovod.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

from ..comm import SharedMemorySum, one_host
from ..errors import UsageError


@contextmanager
def gradient_engine(cfg, workers, run_dir: Optional[str] = None):
    """``with gradient_engine(...) as engine:`` the engine ``cfg.allreduce`` names, over
    the workers' communicator ``workers``, for one run: for mpi, the communicator
    itself, or its sum through shared memory where every worker runs on one host
    (``--shared-memory``, :mod:`mpitrain.comm.shared`); for horovod, recording the run's
    timeline to ``run_dir`` while inside if ``cfg.horovod_timeline``. Collective over
    the workers (Horovod initialises on it)."""
    if cfg.allreduce != "horovod":
        yield _mpi_engine(cfg, workers)
        return
    from .horovod import HorovodAllreduce

    engine = HorovodAllreduce(workers, stall_seconds=cfg.timeout)
    with engine.timeline(f"{run_dir}/horovod-timeline.json" if cfg.horovod_timeline else None):
        yield engine


def _mpi_engine(cfg, workers):
    if cfg.shared_memory == "off" or cfg.compression != "none":
        return workers
    if one_host(workers):
        return SharedMemorySum(workers, min_bytes=0) if cfg.shared_memory == "on" \
            else SharedMemorySum(workers)
    if cfg.shared_memory == "on":
        raise UsageError(f"--shared-memory on needs every worker on one host; these run on "
                         f"{len(set(workers.hosts))} ({', '.join(sorted(set(workers.hosts)))})"
                         ": use --shared-memory auto")
    return workers
