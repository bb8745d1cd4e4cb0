"""Horovod's gradient compression interface: ``Compression.none`` and ``Compression.fp16``,
the ``Compressor`` base class a script may subclass, and (mpitrain's, not Horovod's)
``Compression.powersgd(rank=...)`` and ``Compression.topk(ratio=...)``.

``fp16`` casts floating tensors to float16 before the allreduce and back after it,
as Horovod's does; the float16 sum then moves float16 bytes, each value summed in
float32 by one rank (:meth:`mpitrain.comm.Comm.allreduce_sum_half_`), where Horovod
sums pairwise in float16. (The CLI's ``--compression fp16`` also carries each
worker's rounding error into its next gradient; Horovod's API does not, nor does
this one.)

``powersgd`` and ``topk`` are not a cast around the allreduce: they replace the sum
itself (PowerSGD's two small allreduces, top-k's allgather) with error feedback, the
engines of ``mpitrain --compression`` (:mod:`mpitrain.exchange.powersgd`,
:mod:`mpitrain.exchange.topk`). Each call returns a compressor with its own state:
every worker's residuals, kept per list of tensor shapes it reduced (a
``DistributedGradientTape`` or ``DistributedOptimizer`` reduces the same list each
step). They sum float32 (other floating dtypes are cast), for Sum and Average.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Sequence, Tuple

from ..errors import UsageError
from ..config.sections import COMPRESSION_MIN_SIZE, POWERSGD_RANK, POWERSGD_WARMUP, TOPK_RATIO
from ..exchange import PowerSGDEngine, TopKEngine


class Compressor:
    """Compresses a tensor before an allreduce and decompresses the result."""

    @staticmethod
    def compress(tensor):
        """(the tensor to reduce, the context ``decompress`` needs)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16."""

    @staticmethod
    def compress(tensor):
        import tensorflow as tf

        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        import tensorflow as tf

        return tensor if ctx is None else tf.cast(tensor, ctx)


class SumReplacing(NoneCompressor):
    """A compression that replaces the allreduce's sum (:func:`Compression.powersgd`,
    :func:`Compression.topk`); ``make(summing, shapes)`` builds its engine over the
    float32 sum of the world (an :class:`mpitrain.exchange.Engine`) for one list of
    tensor shapes. Collective: every rank makes the same compressor and the same calls.
    Around the sum the tensors are as they are (NoneCompressor's compress and
    decompress): what travels is the engine's."""

    def __init__(self, name: str, make: Callable):
        self.name, self._make = name, make
        self._engines: Dict[Tuple, object] = {}

    def engine_for(self, summing, shapes: Sequence[Tuple[int, ...]]):
        """The engine (and so the residuals) of the tensors of ``shapes``, made once."""
        key = tuple(tuple(s) for s in shapes)
        if key not in self._engines:
            self._engines[key] = self._make(summing, list(key))
        return self._engines[key]


def _size(shapes) -> int:
    return sum(math.prod(shape) for shape in shapes)


def powersgd(rank: int = POWERSGD_RANK, warmup_steps: int = POWERSGD_WARMUP,
             min_size: int = COMPRESSION_MIN_SIZE) -> SumReplacing:
    """PowerSGD: each matrix of a reduced list travels as factors of ``rank`` (the CLI's
    ``--compression powersgd``); the first ``warmup_steps`` reductions of a list are
    exact; tensors under ``min_size`` values travel whole."""
    def make(summing, shapes):
        n = _size(shapes)
        return PowerSGDEngine(summing, shapes, n, n, rank, min_size, warmup_steps)
    return SumReplacing(f"powersgd(rank={rank})", make)


def topk(ratio: float = TOPK_RATIO, warmup_steps: int = POWERSGD_WARMUP,
         min_size: int = COMPRESSION_MIN_SIZE) -> SumReplacing:
    """Top-k: each tensor of a reduced list sends its ``ratio`` largest values, gathered
    from every rank (the CLI's ``--compression topk``); the first ``warmup_steps``
    reductions of a list are exact; tensors under ``min_size`` values travel whole."""
    def make(summing, shapes):
        n = _size(shapes)
        return TopKEngine(summing, shapes, n, n, ratio, min_size, warmup_steps)
    return SumReplacing(f"topk(ratio={ratio})", make)


def compressor(compression):
    """``compression`` if it is one (a Compressor class or instance); a one-line error
    for ``Compression.powersgd`` or ``topk`` given uncalled."""
    if getattr(compression, "compress", None) is None:
        name = getattr(compression, "__name__", repr(compression))
        raise UsageError(f"compression={name} is not a compressor: call it, e.g. "
                         f"hvd.Compression.{name}() (it keeps state of its own)")
    return compression


class Compression:
    """The compressions Horovod offers, ``none`` (default) and ``fp16``; and mpitrain's
    ``powersgd(rank=...)`` and ``topk(ratio=...)``, which are called: each call is a
    compressor with state of its own."""

    none = NoneCompressor
    fp16 = FP16Compressor
    powersgd = staticmethod(powersgd)
    topk = staticmethod(topk)
