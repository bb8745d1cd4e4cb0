"""Top-k sparsification (``--compression topk``): of each large variable's gradient, a
worker sends only the ``--compression-ratio`` share of values largest in magnitude, as
(index, value) pairs, and keeps the rest as a residual it adds to its next gradient
(error feedback: Stich, Cordonnier and Jaggi, "Sparsified SGD with memory", 2018; Lin
et al.'s Deep Gradient Compression, 2018, without its momentum correction: the
optimizer here applies momentum to the summed gradient, after the exchange).

What a worker's message holds (:class:`TopKFeedback`): the k indices (int32, in the
float32 slots' bits), then the k values, then the values that travel whole (variables
under ``--compression-min-size`` values, vectors such as biases, and in a sync step the
status tail). Every variable of ``min_size`` values or more sends ``ceil(ratio x
size)`` of them, so the message's length is fixed.

Sync (:class:`TopKEngine`): the workers' selections differ, so they are not summed
by an allreduce but gathered: one MPI allgather of every worker's message, then each
worker adds them up in rank order (the same additions in the same order on every
worker: bit-identical sums). Each worker receives W messages, so the bytes grow with
the number of workers where an allreduce's do not: top-k pays where 2 x ratio x W is
well under 1 (docs/usage.md). Async: a push carries one message; the server scatters
it into a zero gradient (:class:`mpitrain.train.asynchronous.mailbox.PushCodec`).

Selecting exactly k of n values costs a partition of all n (numpy's introselect);
:func:`top_k` first keeps the values above a threshold drawn from a strided sample,
which holds all of the k largest whenever it holds k or more, and partitions only
those: exact, and several times faster on a large layer.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .engines import WholeGradientEngine, seconds_of
from .pieces import Span, gather_whole, merge_whole, scatter_whole, variables_in

#: one value of this many is sampled for :func:`top_k`'s threshold
SAMPLE_STRIDE = 97
#: the threshold keeps about this many times k of the sample (a margin, so that the
#: values above it are k or more)
SAMPLE_MARGIN = 1.25


class Sparse(NamedTuple):
    """A variable's part sent as its ``k`` largest values: ``size`` values from ``at``."""

    at: int
    size: int
    k: int


def plan_sparse(shapes: Sequence[Tuple[int, ...]], ratio: float, min_size: int,
                span: Optional[Span] = None) -> Tuple[List[Sparse], List[Span]]:
    """Which parts of ``span`` of the fused gradient (variables of ``shapes``; None: all
    of it) send their top ``ratio`` values: (those, the spans that travel whole).
    A part is sparsified where it has ``min_size`` values or more and its pairs are at
    most half its values."""
    sparse: List[Sparse] = []
    whole: List[Span] = []
    for part in variables_in(shapes, span):
        k = max(1, math.ceil(ratio * part.size))
        if part.size >= min_size and 2 * k <= part.size // 2:
            sparse.append(Sparse(part.at, part.size, k))
        else:
            merge_whole(whole, part)
    return sparse, whole


def top_k(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` largest of ``magnitudes`` (non-negative, finite), in no
    particular order; the same indices for the same values on every machine (numpy's
    introselect is deterministic)."""
    n = magnitudes.size
    if k >= n:
        return np.arange(n)
    sample = magnitudes[::SAMPLE_STRIDE]
    keep = min(sample.size, int(sample.size * k / n * SAMPLE_MARGIN) + 1)
    if sample.size >= 64 and keep < sample.size:
        threshold = np.partition(sample, sample.size - keep)[sample.size - keep]
        candidates = np.flatnonzero(magnitudes >= threshold)
        if candidates.size >= k:  # every value of the k largest is >= the threshold
            chosen = np.argpartition(magnitudes[candidates], candidates.size - k)
            return candidates[chosen[candidates.size - k:]]
    return np.argpartition(magnitudes, n - k)[n - k:]


class TopKFeedback:
    """One worker's top-k codec for ``span`` of the fused gradient (variables of
    ``shapes``), with its residual: :meth:`encode` writes a message of :attr:`slots`
    float32, :meth:`add_to`/:meth:`decode` read one. The same ``shapes``, ``span``,
    ``ratio`` and ``min_size`` at both ends of a message; ``sends``: the end that
    encodes (an async server only decodes: no residual)."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]], ratio: float, min_size: int,
                 span: Optional[Span] = None, sends: bool = True):
        self.sparse, self.whole = plan_sparse(shapes, ratio, min_size, span)
        self.k = sum(s.k for s in self.sparse)
        self.n_whole = sum(end - start for start, end in self.whole)
        #: float32 slots of a message: k indices, k values, the values sent whole
        self.slots = 2 * self.k + self.n_whole
        #: what was not sent yet, of the sparsified parts (the rest is sent whole)
        sizes = [s.size for s in self.sparse] if sends else []
        self.residual = np.zeros(sum(sizes), np.float32)
        self._magnitudes = np.empty(max(sizes, default=0), np.float32)

    def encode(self, values: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` (:attr:`slots` float32) := the message for ``values`` (the span's
        gradient) plus the residual; the residual keeps what was not sent."""
        indices, sent = out[:self.k].view(np.int32), out[self.k:2 * self.k]
        at = kept = 0
        for part in self.sparse:
            residual = self.residual[kept:kept + part.size]
            residual += values[part.at:part.at + part.size]
            magnitudes = np.abs(residual, out=self._magnitudes[:part.size])
            chosen = top_k(magnitudes, part.k)
            sent[at:at + part.k] = residual[chosen]
            residual[chosen] = 0.0
            indices[at:at + part.k] = chosen + part.at
            at, kept = at + part.k, kept + part.size
        gather_whole(values, self.whole, out[2 * self.k:])
        return out

    def add_to(self, message: np.ndarray, out: np.ndarray) -> None:
        """``out`` (the span's float32 gradient) += what ``message`` carries. A worker's
        indices are distinct, so one fancy-indexed addition is exact."""
        indices = message[:self.k].view(np.int32)
        out[indices] += message[self.k:2 * self.k]
        scatter_whole(message[2 * self.k:], self.whole, out, add=True)

    def decode(self, message: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` (the span's float32 gradient) := what ``message`` carries (zero
        where it sends nothing)."""
        for part in self.sparse:
            out[part.at:part.at + part.size] = 0.0
        out[message[:self.k].view(np.int32)] = message[self.k:2 * self.k]
        scatter_whole(message[2 * self.k:], self.whole, out)
        return out


class TopKEngine(WholeGradientEngine):
    """An engine (:class:`~.engines.Engine`) moving the fused buffer as every worker's
    top-k message through one allgather of ``engine`` (:class:`~.engines.MpiEngine`),
    summed by every worker in rank order (see the module): the same contract, every
    worker gets the same sum, in place. ``shapes``: the gradient's variables in the
    fused buffer's order (``n_gradient`` values; then the status tail, up to ``size``,
    which travels whole). Warm-up and the rest: :class:`~.engines.WholeGradientEngine`.
    Collective over the workers, the same arguments on each."""

    title = "top-k"

    def __init__(self, engine, shapes: Sequence[Tuple[int, ...]], n_gradient: int,
                 size: int, ratio: float, min_size: int, warmup: int = 0, steps: int = 0):
        super().__init__(engine, n_gradient, size, warmup, steps)
        self.codec = TopKFeedback(shapes, ratio, min_size)
        self.compresses = bool(self.codec.sparse)
        self.mine = np.zeros(self.codec.slots + size - n_gradient, np.float32)
        self.gathered = np.empty((self.size, self.mine.size), np.float32)

    @property
    def values_sent(self) -> int:
        """How many float32 values a worker sends a step once compressing."""
        return self.mine.size

    @property
    def state(self) -> np.ndarray:
        """What a resumed run needs to continue bit-identically: the residual (a copy)."""
        return self.codec.residual.copy()

    def restore(self, state: np.ndarray) -> None:
        self.codec.residual[:] = state

    def _compressed_sum_(self, buf: np.ndarray, what: str, kind: str,
                         computing: bool) -> float:
        slots, gradient = self.codec.slots, buf[:self.n_gradient]
        self.codec.encode(gradient, self.mine[:slots])
        self.mine[slots:] = buf[self.n_gradient:]
        moving = seconds_of(self.engine.allgather_, self.mine, self.gathered,
                            what=f"{what} (top-k's allgather)", kind=kind)
        gradient[:] = 0.0
        tail = buf[self.n_gradient:]
        tail[:] = 0.0
        for message in self.gathered:  # in rank order, on every worker
            self.codec.add_to(message[:slots], gradient)
            tail += message[slots:]
        return moving
