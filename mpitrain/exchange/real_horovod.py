"""Horovod as the sync gradient engine (``--allreduce horovod``; the optional
``.venv-horovod`` environment: Horovod 0.28.1 builds against TensorFlow <= 2.18)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

import numpy as np

from ..config.bounds import Bounds
from ..comm import Comm


class HorovodEngine:
    """Horovod as the sync gradient engine (:class:`~.engines.Engine`), on the workers'
    communicator only.

    Horovod is initialised with the workers' sub-communicator, so the
    parameter server (rank 0) never imports or starts it (Horovod with every
    rank plus a process set would keep a Horovod thread busy on rank 0).
    It sums with Horovod, exactly like the MPI engine, so the two differ only in
    how the bytes travel. Its wait is bounded by Horovod's stall shutdown
    (:attr:`mpitrain.config.bounds.Bounds.horovod_stall_shutdown`, the workers' own bound).
    Horovod's own knobs come from the environment: HOROVOD_CYCLE_TIME (ms, default 1:
    its latency floor), HOROVOD_FUSION_THRESHOLD. A run's timeline is :meth:`timeline`.
    """

    def __init__(self, worker_comm: Comm, bounds: Bounds):
        # Horovod starts once per process (a second hvd.init does nothing) and reads
        # HOROVOD_TIMELINE only then: DYNAMIC lets every run of the process (mpitrain.fit
        # called twice) start and stop a timeline file of its own
        os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")
        # Horovod's allreduce blocks in C++; its stall detector is the bound there
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS",
                              str(int(bounds.horovod_stall_check)))
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                              str(int(bounds.horovod_stall_shutdown)))
        import horovod.tensorflow as hvd
        import tensorflow as tf

        hvd.init(comm=worker_comm.mpi4py_comm)
        self.hvd, self.tf, self.worker_comm = hvd, tf, worker_comm
        self.size = hvd.size()

    @contextmanager
    def timeline(self, path: Optional[str]):
        """Record Horovod's Chrome-trace timeline of what runs inside to ``path`` (written
        by the first worker; nothing if ``path`` is None). Collective over the workers."""
        if not path:
            yield
            return
        self.hvd.start_timeline(path)
        try:
            yield
        finally:
            self.hvd.stop_timeline()

    def allreduce_sum_(self, buf: np.ndarray, at: int = 0, *,
                       what: str = "the gradient allreduce", kind: str = "allreduce",
                       computing: bool = False) -> np.ndarray:
        # (computing: Horovod's background thread waits for it in any case)
        total = self.hvd.allreduce(self.tf.constant(buf), op=self.hvd.Sum,
                                   name="mpitrain_gradient")
        buf[:] = total.numpy()
        self.worker_comm.traffic.add_sent(kind, buf.nbytes)
        self.worker_comm.traffic.add_recv(kind, buf.nbytes)
        return buf

    def fused_buffer(self, size: int) -> Optional[np.ndarray]:
        return None  # Horovod copies the buffer into a tensor of its own

    def allreduce_sum_half_(self, half: np.ndarray, out: np.ndarray,
                            what: str = "the gradient allreduce",
                            kind: str = "allreduce") -> np.ndarray:
        """The contract of :meth:`mpitrain.comm.Comm.allreduce_sum_half_` (float16 on the
        wire, the float32 sum in ``out``); Horovod sums float16 natively."""
        total = self.hvd.allreduce(self.tf.constant(half), op=self.hvd.Sum,
                                   name="mpitrain_gradient_half")
        out[:] = total.numpy()[:out.size]
        self.worker_comm.traffic.add_sent(kind, half.nbytes)
        self.worker_comm.traffic.add_recv(kind, half.nbytes)
        return out
