"""Gradient compression (``--compression fp16``): gradients travel as float16, half the
bytes, in both protocols (the sync allreduce and the async pushes).

What the cast to float16 rounds away is not dropped: each worker keeps it as a
residual and adds it to its next gradient before the next cast (error feedback,
as in 1-bit SGD and EF-SGD), so every part of every gradient reaches the model,
some of it one step late. What remains is the rounding of the average itself
(sync: the mean segments travel back as float16) and a gradient's values above
float16's range (65504), which become infinite and stop the run as a divergence.

With ``--overlap`` the gradient travels in buckets, each encoded with its own part
of the residual: the same bits as the whole buffer at once. The async pushes use
:class:`ErrorFeedback` too (:class:`mpitrain.train.asynchronous.mailbox.PushCodec`).

Weights, BatchNorm statistics, the sync status tail's flags and the protocol
headers stay float32. A sync checkpoint carries every worker's residual, so a resumed
sync run is bit-exact with the uninterrupted one (:mod:`mpitrain.train.sync`); an
async worker's residual starts at zero in a resumed run.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import numpy as np

from ..kernels.half import encode_


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
    """An engine (:class:`~.engines.Engine`) moving the fused buffer as float16 with error
    feedback, through ``engine``'s ``allreduce_sum_half_`` (the workers' communicator or
    Horovod): the same contract, every worker gets the same float32 sum, in place.
    ``n_gradient`` values of the fused buffer of ``size`` are the gradient (compensated);
    the rest, the status tail, is cast as it is."""

    def __init__(self, engine, n_gradient: int, size: int):
        self.engine = engine
        self.size = engine.size
        self.feedback = ErrorFeedback(n_gradient)
        #: float16 buffer by the length of the part it carries
        self._halves: Dict[int, np.ndarray] = {}
        self.half = self._half_for(size)  # the whole fused buffer's
        self.codec_seconds = 0.0  # encoding (timing.csv's codec_s)

    def allreduce_sum_(self, buf: np.ndarray, at: int = 0, *,
                       what: str = "the gradient allreduce", kind: str = "allreduce",
                       computing: bool = False) -> np.ndarray:
        """``buf``: the fused buffer, or its part from index ``at`` (an overlapped
        bucket); each value gets its own error feedback either way, and its sum is the
        same bits (summed in float32 in rank order by one rank). (``computing``: the
        float16 exchange always polls.)"""
        started = time.perf_counter()
        half = self._half_for(buf.size)
        self.feedback.encode(buf, half, at)
        self.codec_seconds += time.perf_counter() - started
        return self.engine.allreduce_sum_half_(half, buf, what, kind)

    @property
    def state(self) -> np.ndarray:
        """What a resumed run needs to continue bit-identically: the residual (a copy)."""
        return self.feedback.residual.copy()

    def restore(self, state: np.ndarray) -> None:
        self.feedback.residual[:] = state

    def fused_buffer(self, size: int) -> Optional[np.ndarray]:
        return None  # the float16 copy is what travels: any float32 buffer will do

    def _half_for(self, size: int) -> np.ndarray:
        half = self._halves.get(size)
        if half is None:  # the exchange splits it in equal segments, one per worker
            half = self._halves[size] = np.zeros(-(-size // self.size) * self.size, np.float16)
        return half
