"""Where the fused gradient's variables lie in a part of it: what the compressions that
work per variable (PowerSGD's matrices, top-k's per-variable selection) plan from.

A sync worker compresses the whole fused gradient; an async worker's push to one of
``--servers K`` carries that server's share, a contiguous part that may begin or end
inside a variable (:mod:`mpitrain.train.asynchronous.sharded.partition`). Both plan
from :func:`variables_in`: the variables' parts inside the span, where a matrix cut by
the span keeps its whole rows as a (shorter) matrix and its cut rows become vectors.
"""

from __future__ import annotations

from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

Span = Tuple[int, int]


class Part(NamedTuple):
    """A variable's part in a span: ``size`` values from ``at`` (relative to the span's
    start), viewed as ``rows x cols`` (a kernel's whole rows; a convolution's as fan-in x
    filters), or ``rows == 0``: a vector (biases, BatchNorm's, a cut row)."""

    at: int
    size: int
    rows: int
    cols: int


def variables_in(shapes: Sequence[Tuple[int, ...]], span: Optional[Span] = None
                 ) -> Iterator[Part]:
    """The parts of the variables of ``shapes`` (in the fused buffer's order) inside
    ``span`` (start, end) of the fused buffer (None: all of it), in order."""
    sizes = [int(np.prod(shape)) if shape else 1 for shape in shapes]
    start, end = span if span is not None else (0, sum(sizes))
    offset = 0
    for shape, size in zip(shapes, sizes):
        a, b = max(offset, start), min(offset + size, end)
        if a < b:
            yield from _cut(a - start, b - start, offset - start,
                            shape[-1] if len(shape) >= 2 else 0)
        offset += size


def _cut(a: int, b: int, origin: int, cols: int) -> Iterator[Part]:
    """The part [a, b) of a variable starting at ``origin`` with rows of ``cols`` (0: a
    vector): its whole rows as a matrix, what is left of the rows cut as vectors."""
    if not cols:
        yield Part(a, b - a, 0, 0)
        return
    first = origin + -(-(a - origin) // cols) * cols  # the first whole row's start
    last = origin + (b - origin) // cols * cols  # the end of the last whole row
    if first >= last:
        yield Part(a, b - a, 0, 0)
        return
    if a < first:
        yield Part(a, first - a, 0, 0)
    yield Part(first, last - first, (last - first) // cols, cols)
    if last < b:
        yield Part(last, b - last, 0, 0)


def merge_whole(whole: List[Span], part: Part) -> None:
    """Add ``part``'s values to the spans that travel whole, merging adjacent ones."""
    if whole and whole[-1][1] == part.at:
        whole[-1] = (whole[-1][0], part.at + part.size)
    else:
        whole.append((part.at, part.at + part.size))


def gather_whole(values: np.ndarray, whole: Sequence[Span], out: np.ndarray) -> None:
    """``out`` := the values of ``values`` in the ``whole`` spans, one after the other."""
    at = 0
    for start, end in whole:
        out[at:at + end - start] = values[start:end]
        at += end - start


def scatter_whole(packed: np.ndarray, whole: Sequence[Span], out: np.ndarray,
                  add: bool = False) -> None:
    """The inverse of :func:`gather_whole`: ``packed``'s values back into their spans
    (``add``: added to what the spans hold)."""
    at = 0
    for start, end in whole:
        if add:
            out[start:end] += packed[at:at + end - start]
        else:
            out[start:end] = packed[at:at + end - start]
        at += end - start
