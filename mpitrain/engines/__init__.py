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

from typing import Optional


def gradient_engine(cfg, workers, run_dir: Optional[str] = None):
    """The engine ``cfg.allreduce`` names, over the workers' communicator ``workers``.
    Collective over the workers (Horovod initialises on it)."""
    if cfg.allreduce != "horovod":
        return workers
    from .horovod import HorovodAllreduce

    timeline = f"{run_dir}/horovod-timeline.json" if cfg.horovod_timeline else None
    return HorovodAllreduce(workers, timeline, stall_seconds=cfg.timeout)
