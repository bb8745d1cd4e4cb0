"""How a sync worker's gradient reaches the allreduce: whole after back-propagation, or
in buckets while back-propagation still runs (``--overlap``).

Back-propagation produces the gradient from the last layer to the first. With
overlap, the gradient is cut into buckets of whole variables of about
``--bucket-mb`` each, in that order (:meth:`Replica.gradient_buckets`); as soon as
TensorFlow has a bucket's gradients, a ``numpy_function`` inside the step copies
them into their place in the fused buffer and a background thread of this module
allreduces that bucket while TensorFlow computes the layers before it: Horovod's
and PyTorch DDP's design. The caller then sums the status tail (stop flag,
losses) with one small allreduce once the step has returned, so every worker
still learns at the same step who stopped or diverged.

Cross-rank contract: every worker makes the same calls in the same order, bucket
0 (the last layers) first, then the tail, whatever order TensorFlow fills the
buckets in; each bucket's sum is bit-identical on every worker (one MPI
allreduce each), so replicas stay identical. With two workers a sum is one
addition, so the weights are also bit-identical to the fused exchange's.

The phase timer (timing.csv) charges the step to compute and only the wait after
it to comm and waiting: what the background thread hides is not counted twice.

This module's two threads never make MPI calls at the same time: the background
thread while the step computes (its polled waits also send the heartbeats), the
caller's once the buckets are summed (it waits for them first). The
heartbeats a blocking allreduce's watchdog sends need MPI_THREAD_MULTIPLE, which
mpi4py initialises, as before.
"""

from __future__ import annotations

import threading
from typing import List, Optional, Tuple

import numpy as np

from ..errors import CommTimeout

#: seconds the background thread waits for TensorFlow between looks at an abort
LOOK_EVERY = 1.0


class FusedExchange:
    """The whole gradient and the status tail in ONE allreduce after the step, through
    ``engine`` (:class:`~.engines.Engine`)."""

    def __init__(self, replica, engine, tail: int, scale: float):
        self.replica, self.engine, self.tail, self.scale = replica, engine, tail, scale

    def grad(self, x: np.ndarray, y: np.ndarray) -> Tuple[np.ndarray, float, float]:
        """(fused buffer: ``scale`` x the gradient then ``tail`` zeros, loss, gradient
        norm)."""
        return self.replica.grad(x, y, tail=self.tail, scale=self.scale)

    def allreduce_(self, buf: np.ndarray) -> None:
        """Sum ``buf`` (the gradient and the status tail the caller wrote) over the
        workers, in place. Collective over the workers."""
        self.engine.allreduce_sum_(buf)

    def take_codec_seconds(self) -> float:
        """Seconds the compression computed in the exchanges since the last call (its
        engine's ``codec_seconds``; 0 without compression)."""
        seconds = getattr(self.engine, "codec_seconds", 0.0)
        if seconds:
            self.engine.codec_seconds = 0.0
        return seconds

    def codec_state(self) -> Optional[np.ndarray]:
        """What a checkpoint carries of this worker's compression (a copy: its residuals,
        PowerSGD's warm start), or None: its engine compresses nothing."""
        return getattr(self.engine, "state", None)

    def restore_codec(self, state: np.ndarray) -> bool:
        """Continue the compression from a checkpoint's :meth:`codec_state`; False (and
        nothing changed) where it does not fit this run's (other compression settings).
        The same on every worker: the fit depends on the settings alone."""
        mine = self.codec_state()
        if mine is None or mine.size != state.size:
            return False
        self.engine.restore(state)
        return True

    def close(self) -> None:
        pass


class BucketedExchange(FusedExchange):
    """The gradient's buckets allreduced in a background thread as back-propagation
    fills them; :meth:`allreduce_` waits for them and sums the status tail."""

    def __init__(self, replica, engine, tail: int, scale: float,
                 bounds: List[Tuple[int, int]], bound_seconds: float, me: str):
        super().__init__(replica, engine, tail, scale)
        self.bounds = bounds
        self.bound_seconds = bound_seconds  # the caller's wait for the background buckets
        self.me = me  # 'rank R on HOST', for the timeout's message
        self._ready = [threading.Event() for _ in bounds]
        # the engine's own memory for the buffer, where it has some (shared memory: the
        # gradient step writes straight into what the other workers read)
        self._grad, self._buf = replica.bucketed_grad(
            bounds, tail, self._ready_now, out=engine.fused_buffer(replica.n_params + tail))
        self._start = threading.Event()  # a step began: its buckets are coming
        self._done = threading.Event()  # this step's buckets are summed, or one failed
        self._done.set()
        self._error: Optional[BaseException] = None
        self._abort = False  # the step failed on this rank: sum no more buckets
        self._closing = False
        self._thread: Optional[threading.Thread] = None

    def _ready_now(self, bucket: int) -> None:  # called from a TensorFlow thread
        self._ready[bucket].set()

    def grad(self, x: np.ndarray, y: np.ndarray) -> Tuple[np.ndarray, float, float]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True,
                                            name="mpitrain bucket allreduce")
            self._thread.start()
        for ready in self._ready:
            ready.clear()
        self._error, self._abort = None, False
        self._done.clear()
        self._start.set()
        try:
            return self._grad(x, y, self.scale)
        except BaseException:
            self._abort = True  # the others will time out on this rank's buckets
            raise

    def allreduce_(self, buf: np.ndarray) -> None:
        if not self._done.wait(self.bound_seconds):
            raise CommTimeout(f"{self.me} waited {self.bound_seconds:g} s for the gradient "
                              "buckets' allreduce; a rank is stalled or dead (raise "
                              "--timeout if this step is legitimately slower)")
        if self._error is not None:
            raise self._error
        self._sum(buf, self.replica.n_params, buf.size, "the status allreduce", False)

    def take_codec_seconds(self) -> float:
        super().take_codec_seconds()  # (the buckets' encoding overlapped back-propagation:
        return 0.0  # it is not part of the wait after the step)

    def _sum(self, buf: np.ndarray, lo: int, hi: int, what: str, computing: bool) -> None:
        self.engine.allreduce_sum_(buf[lo:hi], lo, what=what, computing=computing)

    def _serve(self) -> None:
        while True:
            self._start.wait()  # idle between steps; a daemon thread, ended by close()
            self._start.clear()
            if self._closing:
                return
            try:
                self._sum_buckets()
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                self._error = e
            finally:
                self._done.set()

    def _sum_buckets(self) -> None:
        count = len(self.bounds)
        for b, (lo, hi) in enumerate(self.bounds):
            while not self._ready[b].wait(LOOK_EVERY):
                if self._abort:
                    return
            self._sum(self._buf, lo, hi, f"the gradient allreduce (bucket {b + 1} of "
                                         f"{count})", True)

    def close(self) -> None:
        """End the background thread (after the last step)."""
        if self._thread is not None:
            self._closing = True
            self._start.set()
            self._thread.join(LOOK_EVERY)
