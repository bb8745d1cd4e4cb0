"""PowerSGD (``--compression powersgd``): a worker's weight matrices travel as two thin
factors of rank R, found by one step of power iteration warm-started from the last
step's (Vogels, Karimireddy and Jaggi, "PowerSGD", NeurIPS 2019; what PyTorch DDP's
``powerSGD_hook`` does). For a layer's kernel M of n x m values (a convolution's viewed
as fan-in x filters) every worker sends R (n + m) values a step instead of n m.

Each step, every worker, for each compressed matrix M of its fused gradient:

1. adds its residual: M += e (error feedback: nothing the approximation misses is lost,
   it arrives in a later step);
2. P = M Q, with Q (m x R) the last step's sum (at the first step a random matrix,
   the same on every worker: drawn from ``seed``);
3. sums P over the workers, in ONE allreduce with every matrix's P and the values that
   travel whole (biases, BatchNorm's vectors, matrices too small to gain) and the
   status tail;
4. makes P's columns orthonormal (Gram-Schmidt);
5. Q = M^T P, summed over the workers in a second allreduce (every matrix's Q);
6. takes P Q^T as the sum of the workers' M, and keeps e = M - P Q^T / workers.

A matrix is compressed only where that at least halves its values, (n + m) R <= n m / 2
(PyTorch's default rule); what is not compressed is summed exactly, as without
compression. Steps 4 and 6 start from the same sums on every worker, so every worker
gets the same bits (with the same numpy and BLAS: on a cluster of different CPUs the
replicas' checksums would catch a difference). The first ``warmup`` steps are exact
sums (the early gradients are large and change fast; PyTorch's ``start_powerSGD_iter``).

Not with ``--overlap`` (the factors need the whole gradient) nor async training (a
server applies one worker's push at a time: there is no sum to approximate). A resumed
run starts with zero residuals and a new Q, so under compression a resume is not
bit-exact with the uninterrupted run (as with fp16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

#: a matrix is compressed only if its factors are at most this fraction of its values
MOST_FACTOR_SHARE = 0.5
#: below this norm a column of P counts as zero (it is left zero, not divided by ~0)
TINY = 1e-8
#: a column of P whose part orthogonal to those before it is under this share of its
#: length is taken as dependent on them (float32 keeps about 7 digits)
DEPENDENT = 1e-3


@dataclass(frozen=True)
class Matrix:
    """A compressed variable: ``rows x cols`` values of the fused buffer from ``at``."""

    at: int
    rows: int
    cols: int


def plan_matrices(shapes: Sequence[Tuple[int, ...]], rank: int
                  ) -> Tuple[List[Matrix], List[Tuple[int, int]]]:
    """Which variables (``shapes``, in the fused buffer's order) travel as factors of
    ``rank``: (the matrices, the (start, end) spans of the fused gradient that travel
    whole, adjacent ones merged)."""
    matrices: List[Matrix] = []
    whole: List[Tuple[int, int]] = []
    at = 0
    for shape in shapes:
        size = int(np.prod(shape)) if shape else 1
        rows, cols = (size // shape[-1], shape[-1]) if len(shape) >= 2 and shape[-1] else (0, 0)
        if rows and (rows + cols) * rank <= MOST_FACTOR_SHARE * rows * cols:
            matrices.append(Matrix(at, rows, cols))
        elif whole and whole[-1][1] == at:
            whole[-1] = (whole[-1][0], at + size)
        else:
            whole.append((at, at + size))
        at += size
    return matrices, whole


def orthonormalize_(p: np.ndarray) -> np.ndarray:
    """``p``'s columns made orthonormal in place, in order (Gram-Schmidt, twice: in
    float32 one pass leaves columns visibly non-orthogonal); a column that is (nearly) a
    combination of those before it (what is left of it under ``DEPENDENT`` of its
    length) is left zero, not blown up from rounding noise."""
    for _ in range(2):
        lengths = np.linalg.norm(p, axis=0)
        for i in range(p.shape[1]):
            column = p[:, i]
            norm = float(np.linalg.norm(column))
            if norm <= max(TINY, DEPENDENT * float(lengths[i])):
                column[:] = 0.0
                continue
            column /= norm
            rest = p[:, i + 1:]
            if rest.shape[1]:
                rest -= np.outer(column, column @ rest)
    return p


class PowerSGDEngine:
    """An engine (:class:`~.engines.Engine`) moving the fused buffer's weight matrices as
    PowerSGD's factors through ``engine`` (two allreduces a step; see the module's
    docstring): the same contract, every worker gets the same sum, in place, of what
    the matrices approximate and of the rest exactly. ``shapes``: the gradient's
    variables in the fused buffer's order (``n_gradient`` values, then the status
    tail, up to ``size``). Collective over the workers, the same ``rank``, ``warmup``
    and ``seed`` on each."""

    def __init__(self, engine, shapes: Sequence[Tuple[int, ...]], n_gradient: int,
                 size: int, rank: int, warmup: int = 0, seed: int = 0):
        self.engine, self.size = engine, engine.size
        self.n_gradient, self.total, self.rank, self.warmup = n_gradient, size, rank, warmup
        self.matrices, self.whole = plan_matrices(shapes, rank)
        self.steps = 0
        n_p = sum(m.rows for m in self.matrices) * rank
        n_whole = sum(end - start for start, end in self.whole) + size - n_gradient
        #: the first sum: every P, then what travels whole, then the status tail
        self.first = np.zeros(n_p + n_whole, np.float32)
        #: the second sum: every Q (also the next step's warm start)
        self.second = np.random.default_rng(seed).standard_normal(
            sum(m.cols for m in self.matrices) * rank, dtype=np.float32)
        self.residuals = [np.zeros((m.rows, m.cols), np.float32) for m in self.matrices]
        self._p = self._views(self.first, "rows")
        self._q = self._views(self.second, "cols")
        self._n_p = n_p
        self._scratch = np.empty(max((m.rows * m.cols for m in self.matrices), default=0),
                                 np.float32)

    @property
    def values_sent(self) -> int:
        """How many values a worker sends a step once compressing (both sums)."""
        return self.first.size + self.second.size

    def allreduce_sum_(self, buf: np.ndarray, at: int = 0, *,
                       what: str = "the gradient allreduce", kind: str = "allreduce",
                       computing: bool = False) -> np.ndarray:
        """``buf``: the whole fused buffer (PowerSGD takes no buckets)."""
        if at or buf.size != self.total:
            raise ValueError("PowerSGD sums the whole fused buffer at once (no buckets)")
        self.steps += 1
        if self.steps <= self.warmup or not self.matrices:
            return self.engine.allreduce_sum_(buf, what=what, kind=kind, computing=computing)
        grads = [buf[m.at:m.at + m.rows * m.cols].reshape(m.rows, m.cols)
                 for m in self.matrices]
        for grad, residual, p, q in zip(grads, self.residuals, self._p, self._q):
            grad += residual
            np.matmul(grad, q, out=p)
        self._pack_whole(buf)
        self.engine.allreduce_sum_(self.first, what=f"{what} (PowerSGD's P)", kind=kind,
                                   computing=computing)
        self._unpack_whole(buf)
        for grad, p, q in zip(grads, self._p, self._q):
            orthonormalize_(p)
            np.matmul(grad.T, p, out=q)
        self.engine.allreduce_sum_(self.second, what=f"{what} (PowerSGD's Q)", kind=kind,
                                   computing=computing)
        share = np.float32(1.0 / self.size)
        for grad, residual, p, q in zip(grads, self.residuals, self._p, self._q):
            residual[:] = grad
            np.matmul(p, q.T, out=grad)  # the workers' sum, approximated, goes out...
            scratch = self._scratch[:grad.size].reshape(grad.shape)
            np.multiply(grad, share, out=scratch)
            residual -= scratch  # ...and what it missed of this worker's part stays
        return buf

    def fused_buffer(self, size: int) -> Optional[np.ndarray]:
        return None  # the factors are what travels: any float32 buffer will do

    # ---- the buffers ---------------------------------------------------------------------
    def _views(self, flat: np.ndarray, side: str) -> List[np.ndarray]:
        views, at = [], 0
        for m in self.matrices:
            n = getattr(m, side)
            views.append(flat[at:at + n * self.rank].reshape(n, self.rank))
            at += n * self.rank
        return views

    def _pack_whole(self, buf: np.ndarray) -> None:
        for part, place in self._whole_parts(buf):
            place[:] = part

    def _unpack_whole(self, buf: np.ndarray) -> None:
        for part, place in self._whole_parts(buf):
            part[:] = place

    def _whole_parts(self, buf: np.ndarray):
        """(a part of ``buf`` that travels whole, its place in the first sum), in order:
        the gradient's uncompressed spans after the P's, then the status tail."""
        at = self._n_p
        for start, end in [*self.whole, (self.n_gradient, self.total)]:
            yield buf[start:end], self.first[at:at + end - start]
            at += end - start
