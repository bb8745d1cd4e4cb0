"""Horovod's gradient compression interface: ``Compression.none`` and ``Compression.fp16``,
and the ``Compressor`` base class a script may subclass.

``fp16`` casts floating tensors to float16 before the allreduce and back after it,
as Horovod's does; the float16 sum then moves float16 bytes, each value summed in
float32 by one rank (:meth:`mpitrain.comm.Comm.allreduce_sum_half_`), where Horovod
sums pairwise in float16. (The CLI's ``--compression fp16`` also carries each
worker's rounding error into its next gradient; Horovod's API does not, nor does
this one.)
"""

from __future__ import annotations


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


class Compression:
    """The compressions Horovod offers: ``none`` (default) and ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
