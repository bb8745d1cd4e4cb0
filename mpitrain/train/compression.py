"""Gradient compression (``--compression fp16``): gradients travel as float16, half the
bytes, in both protocols (the sync allreduce and the async pushes).

What the cast to float16 rounds away is not dropped: each worker keeps it as a
residual and adds it to its next gradient before the next cast (error feedback,
as in 1-bit SGD and EF-SGD), so every part of every gradient reaches the model,
some of it one step late. What remains is the rounding of the average itself
(sync: the mean segments travel back as float16) and a gradient's values above
float16's range (65504), which become infinite and stop the run as a divergence.

With ``--overlap`` the gradient travels in buckets, each encoded with its own part
of the residual: the same bits as the whole buffer at once.

Weights, BatchNorm statistics, the sync status tail's flags and the protocol
headers stay float32. A resumed run starts with zero residuals, so under
compression a resume is not bit-exact with the uninterrupted run (it is without).
"""

from __future__ import annotations

import numpy as np

from ..half import encode_, widen_


class ErrorFeedback:
    """Casts float32 vectors to float16, carrying what each cast loses into the next.

    Only the first ``n`` values are compensated (the gradient); values after them (a
    status tail of flags and losses) are cast as they are.
    """

    def __init__(self, n: int):
        self.residual = np.zeros(n, np.float32)

    def encode(self, values: np.ndarray, out: np.ndarray, at: int = 0) -> np.ndarray:
        """``out[:len(values)]`` := float16(values + residual); the residual keeps what the
        cast lost. ``values`` may be a part of the vector, from index ``at`` (a gradient
        bucket): the residual's same part is used. ``out`` is float16; returns it."""
        n = min(values.size, max(0, self.residual.size - at))
        encode_(values[:n], self.residual[at:at + n], out)
        out[n:values.size] = values[n:]
        return out


class HalfPrecisionEngine:
    """A sync gradient engine moving the fused buffer as float16 with error feedback.

    Same contract as :meth:`mpitrain.comm.Comm.allreduce_sum_` (every worker calls
    it with its fused buffer; every worker gets the same sum, in place); ``engine``
    provides ``allreduce_sum_half_`` and ``size``, the number of workers (the workers'
    communicator or Horovod).
    """

    def __init__(self, engine, n_gradient: int, size: int):
        self.engine = engine
        self.size = engine.size
        self.feedback = ErrorFeedback(n_gradient)
        self._halves = {}  # float16 buffer by the length of the part it carries
        self.half = self._half_for(size)  # the whole fused buffer's

    def allreduce_sum_(self, buf: np.ndarray, what: str = "the gradient allreduce",
                       kind: str = "allreduce", computing: bool = False,
                       at: int = 0) -> np.ndarray:
        """``buf``: the fused buffer, or its part from index ``at`` (an overlapped
        bucket, :mod:`.overlap`); each value gets its own error feedback either way,
        and its sum is the same bits (summed in float32 in rank order by one rank)."""
        half = self._half_for(buf.size)
        self.feedback.encode(buf, half, at)
        return self.engine.allreduce_sum_half_(half, buf, what, kind)

    def _half_for(self, size: int) -> np.ndarray:
        half = self._halves.get(size)
        if half is None:  # the exchange splits it in equal segments, one per worker
            half = self._halves[size] = np.zeros(-(-size // self.size) * self.size, np.float16)
        return half


def sync_engine(engine, compression: str, n_gradient: int, size: int):
    """``engine``, or it wrapped to move a fused buffer of ``size`` values (the first
    ``n_gradient`` the gradient) as float16 (``compression`` 'fp16')."""
    if compression == "fp16":
        return HalfPrecisionEngine(engine, n_gradient, size)
    return engine


class PushCodec:
    """How an async push carries its gradient in a float32 message: as it is, or as
    float16 pairs packed into float32 slots (with error feedback on the worker)."""

    def __init__(self, compression: str, n: int):
        self.half = compression == "fp16"
        self.n = n
        #: float32 slots the gradient takes in the message
        self.slots = (n + 1) // 2 if self.half else n
        self.feedback = ErrorFeedback(n) if self.half else None
        self._decoded = np.zeros(n if self.half else 0, np.float32)

    def encode(self, grad: np.ndarray, slots: np.ndarray) -> None:
        """Write ``grad`` into the message's gradient ``slots`` (worker)."""
        if self.half:
            self.feedback.encode(grad, slots.view(np.float16))
        else:
            slots[:] = grad

    def decode(self, slots: np.ndarray) -> np.ndarray:
        """The float32 gradient in the message's gradient ``slots`` (server)."""
        if self.half:  # (reused: the server applies one push at a time)
            return widen_(slots.view(np.float16)[:self.n], self._decoded)
        return slots
