"""The order in which a streamed training set is visited: which examples each worker
trains on at each step, computed from indices alone (no data read), so that a worker
reads only its own examples and a resumed run starts where the checkpoint left off.

One epoch's order, the same on every rank:

1. the shard files in an order shuffled per (seed, epoch) and put end to end: the
   epoch's *sequence* of the N training examples;
2. the sequence cut into windows of :attr:`EpochOrder.window` examples (by default
   :func:`window_for`: 16 files' worth, so a worker reads from few files at once),
   each shuffled within itself per (seed, epoch, window): a shuffle buffer that needs
   no memory for examples (only the window's indices), since reading is by example;
3. the first ``W * (N // W)`` positions of it dealt to the W workers a batch at a time,
   round robin: worker ``w``'s ``i``-th batch is the ``(i * W + w)``-th run of ``B``
   positions; where ``N // W`` is not a multiple of ``B``, the last, shorter batch of
   each worker takes the same round-robin turn with its own length. The last
   ``N mod W`` positions are left out of that epoch (which examples those are changes
   from epoch to epoch).

So within an epoch every example is trained on at most once, and all but ``N mod W`` of
them exactly once; after every worker took ``i`` batches, the examples trained on are the
sequence's first ``i * W * B`` positions, whatever W is. That makes resuming onto
another number of workers nearly exact: the run goes on from the step after which as
many examples were trained on (:func:`mpitrain.run.resume.remap_position`), and the
examples trained on twice are fewer than one step's of all the new workers, none left
out (:func:`resume_overlap`).
Pure arithmetic: numpy only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, Sequence, Tuple

import numpy as np

#: the seed streams of the file order and of the windows' shuffles
FILE_ORDER, WINDOWS = 0, 1
#: the largest window of the shuffle: a window's permutation is 4 bytes an example
DEFAULT_WINDOW = 1 << 20
#: files a window spans at most (the files a worker reads from at once)
WINDOW_FILES = 16


def window_for(counts: Sequence[int]) -> int:
    """The shuffle's window for files of ``counts`` examples: :data:`WINDOW_FILES` of
    the largest, at most :data:`DEFAULT_WINDOW` examples."""
    return max(1, min(DEFAULT_WINDOW, WINDOW_FILES * max(counts, default=1)))


@dataclass(frozen=True)
class EpochOrder:
    """The order of a training set of shard files holding ``counts`` examples each."""

    counts: Tuple[int, ...]
    seed: int = 0
    window: int = DEFAULT_WINDOW
    #: the first example's global id in each file (files in their natural order)
    starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.counts or min(self.counts) < 0 or self.window < 1:
            raise ValueError(f"an order needs files with examples and a window >= 1, got "
                             f"{len(self.counts)} file(s) and window {self.window}")
        object.__setattr__(self, "starts", np.concatenate(
            [[0], np.cumsum(self.counts, dtype=np.int64)[:-1]]).astype(np.int64))

    @property
    def size(self) -> int:
        return int(sum(self.counts))

    def file_order(self, epoch: int) -> np.ndarray:
        """The files' indices in the order of ``epoch``'s sequence."""
        return np.random.default_rng([self.seed, epoch, FILE_ORDER]).permutation(
            len(self.counts))

    def ids(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Global ids (file-major in the files' natural order) of ``epoch``'s positions
        ``start..stop-1`` (after the windows' shuffle)."""
        order = self.file_order(epoch)
        ends = np.cumsum(np.asarray(self.counts, dtype=np.int64)[order])
        out = np.empty(max(0, stop - start), dtype=np.int64)
        done = 0
        for w in range(start // self.window, -(-stop // self.window)):
            lo, hi = w * self.window, min((w + 1) * self.window, self.size)
            perm = _window_permutation(self.seed, epoch, w, hi - lo)
            a, b = max(start, lo), min(stop, hi)
            seq = lo + perm[a - lo:b - lo].astype(np.int64)  # (sequence positions)
            out[done:done + b - a] = self._global(seq, order, ends)
            done += b - a
        return out

    def _global(self, seq: np.ndarray, order: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Sequence positions (before the shuffle) as global ids."""
        k = np.searchsorted(ends, seq, side="right")
        first_of_file = ends[k] - np.asarray(self.counts, dtype=np.int64)[order][k]
        return self.starts[order[k]] + (seq - first_of_file)

    def locate(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(file index, row within the file) of each global id."""
        files = np.searchsorted(self.starts, ids, side="right") - 1
        return files, ids - self.starts[files]


@functools.lru_cache(maxsize=2)  # (a batch's positions are in one window or two)
def _window_permutation(seed: int, epoch: int, window: int, n: int) -> np.ndarray:
    """The shuffle of one window, as int32 (half the memory: a window is far below 2**31)."""
    perm = np.random.default_rng([seed, epoch, WINDOWS, window]).permutation(n).astype(
        np.int32)
    perm.flags.writeable = False
    return perm


@dataclass(frozen=True)
class Deal:
    """How one epoch's positions are dealt to ``workers`` workers in batches of
    ``batch_size`` (see the module docstring, point 3)."""

    examples: int
    workers: int
    batch_size: int

    @property
    def per_worker(self) -> int:
        """Examples each worker trains on in an epoch (the remainder is left out)."""
        return self.examples // self.workers

    @property
    def batches(self) -> int:
        """Each worker's batches in an epoch; the last may be shorter."""
        return -(-self.per_worker // self.batch_size)

    def positions(self, worker: int, batch: int) -> Tuple[int, int]:
        """[start, stop) of the epoch's positions of ``worker``'s batch ``batch``."""
        full = self.per_worker // self.batch_size
        if batch < full:
            start = (batch * self.workers + worker) * self.batch_size
            return start, start + self.batch_size
        if batch >= self.batches:
            raise IndexError(f"batch {batch} of an epoch of {self.batches}")
        last = self.per_worker - full * self.batch_size
        start = full * self.workers * self.batch_size + worker * last
        return start, start + last


def resume_overlap(examples: int, before: Deal, batches_done: int, after: Deal,
                   resumed_at: int) -> Dict[str, int]:
    """How many of an epoch's positions a resume repeats and leaves out: ``before``'s
    workers each took ``batches_done`` batches, ``after``'s go on from batch
    ``resumed_at``. (Positions, so the same for every order.)"""
    def taken(deal: Deal, batches: Sequence[int]) -> np.ndarray:
        mask = np.zeros(examples, dtype=bool)
        for w in range(deal.workers):
            for b in batches:
                start, stop = deal.positions(w, b)
                mask[start:stop] = True
        return mask

    first = taken(before, range(batches_done))
    second = taken(after, range(resumed_at, after.batches))
    both = first & second
    used = np.zeros(examples, dtype=bool)
    used[:after.workers * after.per_worker] = True
    return {"repeated": int(both.sum()), "left_out": int((used & ~first & ~second).sum())}
