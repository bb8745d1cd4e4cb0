"""The engine protocol, and MPI as an engine (see the package's docstring)."""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

import numpy as np

from ..comm import SharedMemorySum


class Engine(Protocol):
    """What sums the sync workers' fused gradient buffer (the contract: the package's
    docstring)."""

    size: int

    def allreduce_sum_(self, buf: np.ndarray, at: int = 0, *,
                       what: str = "the gradient allreduce", kind: str = "allreduce",
                       computing: bool = False) -> np.ndarray:
        """``buf`` := the sum of every worker's ``buf`` (the fused buffer's part from
        index ``at``), in place, bit-identical on every worker. Collective, bounded."""

    def fused_buffer(self, size: int) -> Optional[np.ndarray]:
        """The engine's own memory for a fused buffer of ``size`` float32 (zeroed), or
        None. Collective over the workers, once."""


def seconds_of(call: Callable, *args, **kwargs) -> float:
    """The seconds ``call(*args, **kwargs)`` took: what a compressing engine's inner sums
    take, the rest of its call being its own computing (``codec_seconds``)."""
    started = time.perf_counter()
    call(*args, **kwargs)
    return time.perf_counter() - started


class WholeGradientEngine:
    """What PowerSGD's and top-k's engines share: they compress the whole fused buffer
    at once (no buckets: a ValueError), sum it exactly for their first ``warmup`` steps
    (counted on from ``steps``, a resumed run's) or where their plan compresses
    nothing, and count their own computing (``codec_seconds``, timing.csv's codec_s).
    A subclass names itself (``title``), says whether it ``compresses`` and moves a
    step in :meth:`_compressed_sum_`, over ``engine``'s sums."""

    title = "a compressing engine"
    compresses = True

    def __init__(self, engine, n_gradient: int, size: int, warmup: int, steps: int):
        self.engine, self.size = engine, engine.size
        self.n_gradient, self.total, self.warmup, self.steps = n_gradient, size, warmup, steps
        self.codec_seconds = 0.0

    def allreduce_sum_(self, buf: np.ndarray, at: int = 0, *,
                       what: str = "the gradient allreduce", kind: str = "allreduce",
                       computing: bool = False) -> np.ndarray:
        """``buf``: the whole fused buffer."""
        if at or buf.size != self.total:
            raise ValueError(f"{self.title} sums the whole fused buffer at once (no buckets)")
        self.steps += 1
        if self.steps <= self.warmup or not self.compresses:
            return self.engine.allreduce_sum_(buf, what=what, kind=kind, computing=computing)
        started = time.perf_counter()
        moving = self._compressed_sum_(buf, what, kind, computing)
        self.codec_seconds += time.perf_counter() - started - moving
        return buf

    def _compressed_sum_(self, buf: np.ndarray, what: str, kind: str,
                         computing: bool) -> float:
        """Sum ``buf`` compressed, in place; the seconds spent in ``engine``'s sums."""
        raise NotImplementedError

    def fused_buffer(self, size: int) -> Optional[np.ndarray]:
        return None  # what travels is the engine's own: any float32 buffer will do


class MpiEngine:
    """The workers' communicator as the engine (``--allreduce mpi``): one MPI allreduce
    per call (:meth:`mpitrain.comm.Comm.allreduce_sum_`), or, given ``shared``, the sum
    through memory every worker maps (:class:`mpitrain.comm.SharedMemorySum`) for the
    parts of its fused buffer large enough (its ``min_bytes``). Also moves float16
    (``allreduce_sum_half_``, for :class:`~.fp16.HalfPrecisionEngine`) and gathers
    (``allgather_``, for :class:`~.topk.TopKEngine`)."""

    def __init__(self, worker_comm, shared: Optional[SharedMemorySum] = None):
        self.worker_comm, self.shared, self.size = worker_comm, shared, worker_comm.size
        self._sum = (shared or worker_comm).allreduce_sum_

    def allreduce_sum_(self, buf: np.ndarray, at: int = 0, *,
                       what: str = "the gradient allreduce", kind: str = "allreduce",
                       computing: bool = False) -> np.ndarray:
        # (shared memory finds its part from the buffer's address: it needs no ``at``)
        return self._sum(buf, what, kind, computing)

    def allreduce_sum_half_(self, half: np.ndarray, out: np.ndarray,
                            what: str = "the gradient allreduce",
                            kind: str = "allreduce") -> np.ndarray:
        return self.worker_comm.allreduce_sum_half_(half, out, what, kind)

    def allgather_(self, mine: np.ndarray, out: np.ndarray, what: str = "the gradient allgather",
                   kind: str = "allreduce") -> np.ndarray:
        return self.worker_comm.allgather_(mine, out, what, kind)

    def fused_buffer(self, size: int) -> Optional[np.ndarray]:
        return self.shared.fused_buffer(size) if self.shared is not None else None
